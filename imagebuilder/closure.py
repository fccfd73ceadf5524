"""Which locked debs a definition needs: the lock's apt resolution, done again among the locked debs.

``imagebuilder lock`` resolves the definition's ``packages`` and each Kubernetes version against
signed apt indexes (:mod:`imagebuilder.resolve`). A build has no index, but it has every locked
``.deb``, fetched and checked against its digest, and their control fields (``dpkg-deb --field``)
are enough to resolve the same closures again, the same way:

* the **base**: the definition's ``packages`` and what they need that the installer's base lacks
  (``deb/*``): what the installer installs, see :func:`imagebuilder.staging.base_tree`;
* the **installed Kubernetes version**: its packages and what they need beyond the installer's base
  (``kubernetes/<installed>/*`` and ``deb/*``);
* each **staged version**: its packages and what they need beyond the base and the installed set
  (``kubernetes/<version>/*``).

A locked deb that none of these closures needs was never asked for by the definition: the build
refuses it by name before any VM starts, instead of fetching it onto the media and into the SBOM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from imagebuilder import aptindex
from imagebuilder.definition import Definition
from imagebuilder.errors import LockError
from imagebuilder.lock import LockedInput
from imagebuilder.run import run
from imagebuilder.staging import StagedFile

log = logging.getLogger(__name__)


def _entry(staged: StagedFile) -> aptindex.PackageEntry:
    """The package index entry of a locked deb, from its own control fields."""
    control = aptindex.parse_stanzas(run(["dpkg-deb", "--field", str(staged.path)]).text)[0]
    if control.get("Package") != staged.item.name:
        raise LockError(
            f"{staged.item.key}: the deb is package {control.get('Package')!r}, the lock says {staged.item.name!r}",
            hint="run `imagebuilder lock` again and review the diff",
        )
    return aptindex.entry_from_control(
        control,
        url=staged.path.as_uri(),
        size=staged.item.size,
        sha256=staged.item.sha256,
        repository="lock",
    )


def _is_closure_deb(item: LockedInput) -> bool:
    return item.kind == "deb" and item.key.startswith(("deb/", "kubernetes/"))


def _resolve(
    requests: list[tuple[str, str | None]],
    scope: Mapping[str, aptindex.PackageEntry],
    base: Mapping[str, str],
    *,
    what: str,
    even_if_present: bool = False,
) -> set[str]:
    """The keys (of ``scope``: key -> entry) that ``requests`` need beyond ``base``."""
    try:
        resolution = aptindex.resolve(
            requests, list(scope.values()), base, install_requested_even_if_present=even_if_present
        )
    except LockError as exc:
        raise LockError(
            f"the locked debs do not resolve {what}: {exc.message}",
            hint="the lock misses a package its definition needs: run `imagebuilder lock` again",
        ) from exc
    by_name = {entry.name: key for key, entry in scope.items()}
    return {by_name[name] for name in resolution.selected if name in by_name}


def apt_closures(
    defn: Definition, files: Sequence[StagedFile], base_packages: Mapping[str, str]
) -> set[str]:
    """Check that every locked deb is needed by one of the definition's closures (else
    :class:`LockError` naming the others); return the keys of the base's closure."""
    debs = [f for f in files if _is_closure_deb(f.item)]
    if not debs:
        return set()
    entries = {f.item.key: _entry(f) for f in debs}
    os_scope = {k: e for k, e in entries.items() if k.startswith("deb/")}
    base_keys: set[str] = set()
    if defn.packages:
        base_keys = _resolve(
            [(p.name, p.version) for p in defn.packages], os_scope, base_packages, what="the packages"
        )
    needed = set(base_keys)
    kube = defn.kubernetes
    if kube is not None:
        installed_scope = {**os_scope, **_versioned(entries, kube.installed)}
        installed = _resolve(
            [(p, kube.deb_version(kube.installed)) for p in kube.packages],
            installed_scope,
            base_packages,
            what=f"Kubernetes {kube.installed}",
            even_if_present=True,
        )
        needed |= installed
        present = {**base_packages, **{entries[k].name: entries[k].version for k in needed}}
        for version in kube.staged:
            needed |= _resolve(
                [(p, kube.deb_version(version)) for p in kube.packages],
                _versioned(entries, version),
                present,
                what=f"Kubernetes {version} (staged)",
                even_if_present=True,
            )
    unneeded = sorted(set(entries) - needed)
    if unneeded:
        raise LockError(
            "the lock holds debs that nothing in the definition needs: " + ", ".join(unneeded),
            hint="a lock holds exactly the inputs its definition implies: run `imagebuilder lock` again and "
            "review the diff (a hand-edited or foreign lock is refused)",
        )
    log.info("locked debs: %d, every one needed (%d in the installed base)", len(entries), len(base_keys))
    return base_keys


def _versioned(
    entries: Mapping[str, aptindex.PackageEntry], version: str
) -> dict[str, aptindex.PackageEntry]:
    prefix = f"kubernetes/{version}/"
    return {k: e for k, e in entries.items() if k.startswith(prefix)}
