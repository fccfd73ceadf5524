"""Resolving a definition into locked inputs: what :func:`imagebuilder.lock.create_lock` runs.

:class:`Resolver` fetches every input through the cache and records what vouches for its
digest: the installer ISO and artifacts against upstream checksum files and their OpenPGP
signatures (:func:`expected_digest`), OS and Kubernetes debs from signed apt indexes with
their dependency closure minus the installer's base system, and the agent's wheels for the
target's Python, compiling source-only requirements on a host that matches the target.
"""

from __future__ import annotations

import logging
from pathlib import Path

from imagebuilder import aptindex, media, wheelhouse
from imagebuilder.cache import Cache
from imagebuilder.definition import AptRepository, Checksums, Definition
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.fetch import fetch_small
from imagebuilder.lock import FIRST_USE, LockedInput, plain_name, url_basename
from imagebuilder.openpgp import checksum_for, verify_detached

log = logging.getLogger(__name__)


_basename = url_basename


def expected_digest(
    name: str, url: str, pin: str | None, checksums: Checksums | None
) -> tuple[str | None, str]:
    """The digest an input must have, and what vouches for it."""
    if checksums is None:
        if pin:
            return pin, "definition pin"
        log.warning("%s: %s; its digest is recorded on this first download", name, FIRST_USE)
        return None, FIRST_USE
    text = fetch_small(checksums.url, name=f"{name} checksums")
    source = _basename(checksums.url)
    if checksums.signature:
        if checksums.keyring is None:  # the schema requires it; a defensive check
            raise VerificationError(f"{name}: a checksum signature needs a keyring")
        signature = fetch_small(checksums.signature, name=f"{name} checksums signature")
        verify_detached(text, signature, checksums.keyring, what=f"{name}: {source}")
        how = f"{source} signed by {checksums.keyring.name}"
    else:
        how = f"{source} (published, unsigned)"
    digest = checksum_for(text.decode("utf-8", errors="replace"), _basename(url), what=f"{name}: {source}")
    if pin and pin != digest:
        raise VerificationError(
            f"{name}: the definition pins sha256 {pin} but {source} says {digest}",
            hint="one of them is wrong or the upstream file changed; do not lock until you know which",
        )
    return digest, how + (" and the definition pin" if pin else "")


class _AptFetcher:
    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def small(self, url: str, *, name: str) -> bytes:
        return fetch_small(url, name=name)

    def blob(self, url: str, *, name: str, sha256: str, size: int) -> bytes:
        return self.cache.fetch(name, [url], sha256=sha256, size=size).path.read_bytes()


class Resolver:
    """Resolves one definition into locked inputs, fetching everything through ``cache``."""

    def __init__(self, defn: Definition, cache: Cache) -> None:
        self.defn = defn
        self.cache = cache
        self.inputs: list[LockedInput] = []
        self.base: dict[str, str] = {}
        self.agent_requires: list[str] = []
        self._indexes: dict[str, list[aptindex.PackageEntry]] = {}

    def resolve(self, workdir: Path) -> list[LockedInput]:
        self._iso()
        for artifact in self.defn.artifacts:
            self._fetch_pinned(
                key=f"artifact/{artifact.name}",
                name=artifact.name,
                kind=artifact.kind,
                version=artifact.version,
                url=artifact.url,
                mirrors=artifact.mirrors,
                pin=artifact.sha256,
                checksums=artifact.checksums,
                role="wheelhouse" if artifact.kind == "wheel" else "stage",
                destination=artifact.destination,
                strip_components=artifact.strip_components,
                mode=artifact.mode,
            )
        self._apt()
        self._wheels(workdir)
        return self.inputs

    def _fetch_pinned(
        self,
        *,
        key: str,
        name: str,
        kind: str,
        version: str,
        url: str,
        mirrors: tuple[str, ...],
        pin: str | None,
        checksums: Checksums | None,
        role: str,
        destination: str = "",
        strip_components: int = 0,
        mode: str = "",
    ) -> Path:
        digest, how = expected_digest(name, url, pin, checksums)
        fetched = self.cache.fetch(name, [url, *mirrors], sha256=digest)
        self.inputs.append(
            LockedInput(
                key=key,
                name=name,
                kind=kind,
                version=version,
                url=url,
                sha256=fetched.sha256,
                size=fetched.size,
                role=role,
                destination=destination,
                filename=_basename(url),
                mirrors=mirrors,
                verified_by=how,
                strip_components=strip_components,
                mode=mode,
            )
        )
        return fetched.path

    def _iso(self) -> None:
        iso = self.defn.installer.iso
        path = self._fetch_pinned(
            key="iso",
            name="installer-iso",
            kind="iso",
            version=iso.version,
            url=iso.url,
            mirrors=iso.mirrors,
            pin=iso.sha256,
            checksums=iso.checksums,
            role="installer",
        )
        for manifest in self.defn.installer.base_manifests:
            text = media.read_member(path, manifest).decode("utf-8", errors="replace")
            self.base.update(aptindex.parse_manifest(text))
        log.info("installer base system: %d packages", len(self.base))

    def _index(self, repo: AptRepository) -> list[aptindex.PackageEntry]:
        if repo.url not in self._indexes:
            self._indexes[repo.url] = aptindex.load_index(
                repo, self.defn.architecture, _AptFetcher(self.cache)
            )
        return self._indexes[repo.url]

    def _add_deb(
        self, key: str, entry: aptindex.PackageEntry, *, role: str, destination: str, how: str
    ) -> None:
        fetched = self.cache.fetch(entry.filename, [entry.url], sha256=entry.sha256, size=entry.size)
        self.inputs.append(
            LockedInput(
                key=key,
                name=entry.name,
                kind="deb",
                version=entry.version,
                url=entry.url,
                sha256=fetched.sha256,
                size=fetched.size,
                role=role,
                destination=destination,
                filename=entry.filename,
                verified_by=how,
            )
        )

    def _apt(self) -> None:
        defn = self.defn
        os_index = [e for repo in defn.apt_sources for e in self._index(repo)]
        signed_by = {
            repo.name: f"InRelease of {repo.name} signed by {repo.keyring.name}" for repo in defn.apt_sources
        }
        requests = [(p.name, p.version) for p in defn.packages]
        installed: dict[str, aptindex.PackageEntry] = {}
        if requests:
            if not self.base:
                raise LockError(
                    "packages are requested but the installer's base package list is unknown",
                    hint="set installer.base_manifests (e.g. casper/ubuntu-server-minimal.manifest)",
                )
            resolution = aptindex.resolve(requests, os_index, self.base)
            for name in resolution.already_installed:
                log.info("package %s is already in the installed base", name)
            installed.update(resolution.selected)
        kube = defn.kubernetes
        if kube is not None:
            for version in kube.versions:
                repo = kube.repository_for(version)
                signed_by[repo.name] = f"InRelease of {repo.name} signed by {repo.keyring.name}"
                index = self._index(repo) + os_index
                wanted = [(p, kube.deb_version(version)) for p in kube.packages]
                is_installed = version == kube.installed
                base = (
                    dict(self.base)
                    if is_installed
                    else {**self.base, **{n: e.version for n, e in installed.items()}}
                )
                resolution = aptindex.resolve(wanted, index, base, install_requested_even_if_present=True)
                for entry in resolution.packages():
                    if entry.name in kube.packages:
                        key = f"kubernetes/{version}/{entry.name}"
                    elif is_installed:
                        key = f"deb/{entry.name}"
                    else:
                        key = f"kubernetes/{version}/{entry.name}"
                    if is_installed:
                        if key.startswith("deb/") and entry.name in installed:
                            continue
                        installed[entry.name] = entry
                        self._add_deb(
                            key, entry, role="apt", destination="", how=signed_by[entry.repository]
                        )
                    else:
                        self._add_deb(
                            key,
                            entry,
                            role="stage",
                            destination=kube.staged_dir(version),
                            how=signed_by[entry.repository],
                        )
        kube_installed = set(kube.packages) if kube else set()
        for name, entry in sorted(installed.items()):
            if name in kube_installed:
                continue
            if not any(i.key == f"deb/{name}" for i in self.inputs):
                self._add_deb(
                    f"deb/{name}", entry, role="apt", destination="", how=signed_by[entry.repository]
                )

    def _wheels(self, workdir: Path) -> None:
        defn = self.defn
        agent_dir, compiled_dir, prebuilt_dir = workdir / "agent", workdir / "compiled", workdir / "prebuilt"
        prebuilt_dir.mkdir(parents=True, exist_ok=True)
        agent_wheel, _source = wheelhouse.build_agent_wheel(defn.agent.source, agent_dir)
        agent_name, _version, requires = wheelhouse.wheel_metadata(agent_wheel)
        self.agent_requires = wheelhouse.requirements_for(requires, defn.agent.extras)
        compiled: set[str] = set()
        for requirement in defn.agent.compile:
            sdist = wheelhouse.pip_report(
                [requirement], defn.target, defn.architecture, find_links=[], only_binary=False, no_deps=True
            )[0]
            if not sdist.sha256:
                raise LockError(f"{requirement}: the package index gave no sha256 for {sdist.url}")
            fetched = self.cache.fetch(sdist.filename, [sdist.url], sha256=sdist.sha256)
            self.inputs.append(
                LockedInput(
                    key=f"sdist/{sdist.name}",
                    name=sdist.name,
                    kind="sdist",
                    version=sdist.version,
                    url=sdist.url,
                    sha256=fetched.sha256,
                    size=fetched.size,
                    role="sdist",
                    filename=sdist.filename,
                    verified_by="package index digest",
                )
            )
            wheelhouse.check_compile_host(defn.target, requirement)
            wheel = wheelhouse.compile_sdist(fetched.path, compiled_dir, filename=sdist.filename)
            entry = self.cache.put(wheel)
            self.inputs.append(
                LockedInput(
                    key=f"compiled/{sdist.name}",
                    name=sdist.name,
                    kind="wheel",
                    version=sdist.version,
                    url=f"sdist:sha256:{sdist.sha256}",
                    sha256=entry.sha256,
                    size=entry.size,
                    role="compiled",
                    filename=wheel.name,
                    destination=defn.agent.venv,
                    verified_by=f"compiled by imagebuilder lock from the locked sdist (Python "
                    f"{wheelhouse.host_python()}, glibc {wheelhouse.host_glibc()})",
                )
            )
            compiled.add(sdist.name)
        for item in self.inputs:
            if item.role == "wheelhouse" and item.kind == "wheel":
                (prebuilt_dir / plain_name(item.filename)).write_bytes(
                    self.cache.entry(item.sha256).read_bytes()
                )
                compiled.add(wheelhouse.normalise(item.filename.split("-")[0]))
        extras = ",".join(defn.agent.extras)
        requirement = f"{agent_wheel}[{extras}]" if extras else str(agent_wheel)
        report = wheelhouse.pip_report(
            [requirement, defn.agent.pip],
            defn.target,
            defn.architecture,
            find_links=[agent_dir, compiled_dir, prebuilt_dir],
        )
        for wanted in report:
            if wanted.name == wheelhouse.normalise(agent_name) or wanted.name in compiled:
                continue
            if not wanted.sha256:
                raise LockError(f"wheel {wanted.name}: the package index gave no sha256 for {wanted.url}")
            fetched = self.cache.fetch(wanted.filename, [wanted.url], sha256=wanted.sha256)
            self.inputs.append(
                LockedInput(
                    key=f"wheel/{wanted.name}",
                    name=wanted.name,
                    kind="wheel",
                    version=wanted.version,
                    url=wanted.url,
                    sha256=fetched.sha256,
                    size=fetched.size,
                    role="wheelhouse",
                    filename=wanted.filename,
                    destination=defn.agent.venv,
                    verified_by="package index digest",
                )
            )
