"""The lock file: every input of a build resolved to URL, SHA-256 and size, and how it was verified.

``imagebuilder lock`` (:func:`create_lock`) resolves the definition:

* the installer ISO and each artifact: against the upstream checksum file when the
  definition names one (its OpenPGP signature checked with the named keyring), else the
  definition's own pin, else (said loudly) the first download;
* OS packages and Kubernetes debs: from apt indexes whose ``InRelease`` signature is
  checked (:mod:`imagebuilder.aptindex`), with their dependency closure minus what the
  installer's base system already has (the ISO's package manifests);
* the agent's Python dependencies: wheels for the target's Python and glibc with the
  index's digests (:mod:`imagebuilder.wheelhouse`); source-only requirements as the sdist
  plus the wheel compiled from it here.

Everything is downloaded through the cache, so a lock is only written when every input
was fetched and matched. ``imagebuilder build`` (:func:`check_lock`) refuses a lock made
for another definition (the digest of the definition after ``${VAR}`` substitution) and
any input the lock does not cover.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder import aptindex, media, wheelhouse
from imagebuilder.cache import Cache
from imagebuilder.definition import AptRepository, Checksums, Definition
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.fetch import fetch_small
from imagebuilder.openpgp import checksum_for, verify_detached

log = logging.getLogger(__name__)

LOCK_SCHEMA = "https://nodetrust.dev/imagebuilder-lock/v1"
FIRST_USE = "first use: no published checksum and no pin"


@dataclass(frozen=True)
class LockedInput:
    key: str  # iso | artifact/<name> | deb/<name> | kubernetes/<version>/<name> | wheel/<name> | sdist/<name> | compiled/<name>
    name: str
    kind: str  # iso, deb, tarball, binary, oci-archive, wheel, sdist
    version: str
    url: str
    sha256: str
    size: int
    role: str  # installer | apt | stage | wheelhouse | sdist | compiled
    destination: str = ""
    filename: str = ""
    mirrors: tuple[str, ...] = ()
    verified_by: str = ""
    strip_components: int = 0
    mode: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mirrors"] = list(self.mirrors)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LockedInput:
        values = dict(data)
        values["mirrors"] = tuple(values.get("mirrors", ()))
        return cls(**values)


@dataclass(frozen=True)
class Lock:
    path: Path
    file_sha256: str
    definition_sha256: str
    architecture: str
    created_at: str
    inputs: tuple[LockedInput, ...]
    agent_requires: tuple[str, ...] = ()
    base_packages: dict[str, str] = field(default_factory=dict)

    def get(self, key: str) -> LockedInput:
        for item in self.inputs:
            if item.key == key:
                return item
        raise LockError(
            f"{self.path}: no entry for {key}: the input is not locked",
            hint="run `imagebuilder lock` for this definition",
        )

    def by_role(self, role: str) -> list[LockedInput]:
        return [i for i in self.inputs if i.role == role]


def default_lock_path(definition: Path) -> Path:
    name = definition.name
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return definition.with_name(name + ".lock.json")


# -- reading and checking -----------------------------------------------------------------


def load_lock(path: Path) -> Lock:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise LockError(f"no lock file at {path}", hint="run `imagebuilder lock DEFINITION` first") from None
    try:
        data = json.loads(raw)
        if data.get("schema") != LOCK_SCHEMA:
            raise ValueError(f"schema is {data.get('schema')!r}, expected {LOCK_SCHEMA}")
        return Lock(
            path=path,
            file_sha256=hashlib.sha256(raw).hexdigest(),
            definition_sha256=data["definition_sha256"],
            architecture=data["architecture"],
            created_at=data["created_at"],
            inputs=tuple(LockedInput.from_json(i) for i in data["inputs"]),
            agent_requires=tuple(data.get("agent", {}).get("requires", ())),
            base_packages=dict(data.get("base_packages", {})),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise LockError(
            f"{path} is not a valid lock file: {exc}", hint="run `imagebuilder lock` again"
        ) from exc


def check_lock(defn: Definition, lock: Lock) -> None:
    """Refuse a lock that was not made for exactly this definition, or that misses an input."""
    if lock.definition_sha256 != defn.resolved_sha256:
        raise LockError(
            f"{lock.path} was made for another version of {defn.path} (or other ${{VAR}} values): "
            "the definition's inputs are not locked",
            hint=f"run `imagebuilder lock {defn.path}` and review the lock's diff",
        )
    if lock.architecture != defn.architecture:
        raise LockError(f"{lock.path} is for {lock.architecture}, the definition for {defn.architecture}")
    lock.get("iso")
    for artifact in defn.artifacts:
        locked = lock.get(f"artifact/{artifact.name}")
        if locked.url != artifact.url or (artifact.sha256 and locked.sha256 != artifact.sha256):
            raise LockError(
                f"artifact {artifact.name}: the lock has another URL or digest than the definition"
            )
    if defn.kubernetes is not None:
        for version in defn.kubernetes.versions:
            for package in defn.kubernetes.packages:
                lock.get(f"kubernetes/{version}/{package}")


def write_lock(
    lock_path: Path,
    defn: Definition,
    inputs: list[LockedInput],
    *,
    agent_requires: list[str],
    base_packages: dict[str, str],
) -> Lock:
    data = {
        "schema": LOCK_SCHEMA,
        "definition": os.path.relpath(defn.path.resolve(), lock_path.resolve().parent),
        "definition_sha256": defn.resolved_sha256,
        "architecture": defn.architecture,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "agent": {"requires": agent_requires},
        "base_packages": dict(sorted(base_packages.items())),
        "inputs": [i.to_json() for i in sorted(inputs, key=lambda i: i.key)],
    }
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    tmp = lock_path.with_name(f".{lock_path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, lock_path)
    return load_lock(lock_path)


# -- resolving ---------------------------------------------------------------------------------


def _basename(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


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
        agent_wheel = wheelhouse.build_agent_wheel(defn.agent.source, agent_dir)
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
                (prebuilt_dir / item.filename).write_bytes(self.cache.entry(item.sha256).read_bytes())
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


def create_lock(defn: Definition, cache: Cache, lock_path: Path) -> Lock:
    """Resolve and fetch every input of ``defn``, then write the lock file."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-lock-") as tmp:
        resolver = Resolver(defn, cache)
        inputs = resolver.resolve(Path(tmp))
    keys = [i.key for i in inputs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise LockError(f"two inputs resolve to the same key: {', '.join(duplicates)}")
    lock = write_lock(
        lock_path, defn, inputs, agent_requires=resolver.agent_requires, base_packages=resolver.base
    )
    first_use = [i.name for i in inputs if i.verified_by == FIRST_USE]
    if first_use:
        log.warning("recorded on first use (nothing upstream vouches for them): %s", ", ".join(first_use))
    return lock
