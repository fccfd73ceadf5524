"""Signed apt repository indexes, Debian version order, and dependency closure for the lock.

:func:`load_index` fetches ``InRelease`` (``dists/<suite>/InRelease``, or ``InRelease`` at
the URL of a flat repository such as pkgs.k8s.io), verifies it with ``gpgv`` against the
repository's keyring, and fetches each ``Packages`` index through the cache by the digest
InRelease lists. Every package entry so carries a digest vouched for by the signature.

:func:`resolve` picks the packages to stage: the requested ones (pinned version or the
highest) plus their ``Depends``/``Pre-Depends`` closure, minus what the installed base
already has (the installer ISO's package manifest). It honours versioned ``Provides`` (a
provider satisfies a versioned dependency only with a versioned ``Provides: name (= version)``,
Debian policy 7.5), ``Conflicts`` and ``Breaks`` (against the selection and against the base's
versions; a package's conflict with a name it provides itself does not count), and checks the
final set as a whole. What the base's own packages conflict with is not known from the manifest.

Debian's formats are read with python-debian, the ecosystem's own implementation: version order
(``debian.debian_support``, dpkg's algorithm), deb822 paragraphs and package relations
(``debian.deb822``).
"""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cmp_to_key
from typing import Protocol

from debian import deb822, debian_support

from imagebuilder.definition import AptRepository
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.openpgp import verify_clearsigned

log = logging.getLogger(__name__)

INDEX_VARIANTS = (
    ("Packages.xz", lzma.decompress),
    ("Packages.gz", gzip.decompress),
    ("Packages.bz2", bz2.decompress),
)
# The fields of a Packages stanza the lock reads (the others are skipped while parsing).
_INDEX_FIELDS = (
    "Package",
    "Version",
    "Architecture",
    "Filename",
    "Size",
    "SHA256",
    "Pre-Depends",
    "Depends",
    "Provides",
    "Breaks",
    "Conflicts",
)


# -- Debian version order --------------------------------------------------------------


def compare_versions(a: str, b: str) -> int:
    """dpkg's order (python-debian): negative if a < b, 0 if equal, positive if a > b.

    Raises ValueError for a string that is not a Debian version.
    """
    return debian_support.version_compare(a, b)


def valid_version(version: str) -> bool:
    try:
        debian_support.Version(version)
    except ValueError:
        return False
    return True


def satisfies(version: str, op: str | None, wanted: str | None) -> bool:
    if op is None or wanted is None:
        return True
    cmp = compare_versions(version, wanted)
    return {
        "<<": cmp < 0,
        "<": cmp <= 0,  # obsolete spelling of <=
        "<=": cmp <= 0,
        "=": cmp == 0,
        ">=": cmp >= 0,
        ">": cmp >= 0,  # obsolete spelling of >=
        ">>": cmp > 0,
    }[op]


# -- index parsing -----------------------------------------------------------------------


def parse_stanzas(text: str, fields: Sequence[str] | None = None) -> list[dict[str, str]]:
    """deb822 paragraphs (Packages, Release, ``dpkg-deb --field``) as dicts (python-debian).

    A multi-line value keeps its continuation lines as deb822 folds them (newline, leading space).
    ``fields`` keeps only those fields (faster on large indexes).
    """
    paragraphs = deb822.Deb822.iter_paragraphs(
        text.splitlines(keepends=True), fields=list(fields) if fields else None, use_apt_pkg=False
    )
    return [dict(paragraph) for paragraph in paragraphs if len(paragraph)]


@dataclass(frozen=True)
class Relation:
    name: str
    op: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.op} {self.version})" if self.op else self.name


def parse_relations(value: str) -> list[list[Relation]]:
    """A relation field (``Depends``, ``Provides``, ``Breaks``...): groups of alternatives (python-debian).

    Architecture qualifiers (``:any``) are dropped; the lock resolves one architecture.
    """
    groups: list[list[Relation]] = []
    if not value.strip():
        return groups
    for group in deb822.PkgRelation.parse_relations(value):
        alternatives = []
        for rel in group:
            name = rel["name"]
            if not name:
                continue
            constraint = rel.get("version")
            op, version = constraint if constraint else (None, None)
            alternatives.append(Relation(name, op, version))
        if alternatives:
            groups.append(alternatives)
    return groups


def _flat(value: str) -> tuple[Relation, ...]:
    """``Provides``, ``Breaks`` and ``Conflicts`` have no alternatives: one relation per entry."""
    return tuple(rel for group in parse_relations(value) for rel in group)


@dataclass(frozen=True)
class PackageEntry:
    """One binary package of an index. ``provides`` accepts plain names too (``Relation(name)``)."""

    name: str
    version: str
    architecture: str
    url: str
    size: int
    sha256: str
    repository: str
    depends: tuple[tuple[Relation, ...], ...] = ()
    provides: tuple[Relation | str, ...] = ()
    breaks: tuple[Relation, ...] = ()
    conflicts: tuple[Relation, ...] = ()

    def __post_init__(self) -> None:
        provided = tuple(Relation(p) if isinstance(p, str) else p for p in self.provides)
        object.__setattr__(self, "provides", provided)

    @property
    def provided(self) -> tuple[Relation, ...]:
        return tuple(p for p in self.provides if isinstance(p, Relation))

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.split(':')[-1]}_{self.architecture}.deb"

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


def entry_from_control(
    control: Mapping[str, str], *, url: str, size: int, sha256: str, repository: str
) -> PackageEntry:
    """A :class:`PackageEntry` from a Packages stanza or a ``.deb``'s control fields."""
    try:
        name, version, architecture = control["Package"], control["Version"], control["Architecture"]
    except KeyError as exc:
        raise LockError(f"{repository}: a package entry has no {exc.args[0]} field") from None
    if not valid_version(version):
        raise LockError(
            f"{repository}: package {name} has version {version!r}, which is not a Debian version",
            hint="the repository's index is broken; report it to its maintainers",
        )
    relations = ", ".join(v for k in ("Pre-Depends", "Depends") if (v := control.get(k, "").strip()))
    return PackageEntry(
        name=name,
        version=version,
        architecture=architecture,
        url=url,
        size=size,
        sha256=sha256,
        repository=repository,
        depends=tuple(tuple(group) for group in parse_relations(relations)),
        provides=_flat(control.get("Provides", "")),
        breaks=_flat(control.get("Breaks", "")),
        conflicts=_flat(control.get("Conflicts", "")),
    )


class Fetcher(Protocol):
    """What :func:`load_index` needs: small uncached reads and digest-checked cached fetches."""

    def small(self, url: str, *, name: str) -> bytes: ...

    def blob(self, url: str, *, name: str, sha256: str, size: int) -> bytes: ...


def _base_url(repo: AptRepository) -> str:
    return repo.url if repo.url.endswith("/") else repo.url + "/"


def _release_digests(text: str) -> dict[str, tuple[str, int]]:
    release = deb822.Release(text)
    entries = release.get("SHA256")
    if not entries:
        raise VerificationError("InRelease has no SHA256 section")
    digests: dict[str, tuple[str, int]] = {}
    for entry in entries:
        try:
            digests[entry["name"]] = (entry["sha256"].lower(), int(entry["size"]))
        except (KeyError, ValueError):
            raise VerificationError(f"InRelease has a malformed SHA256 line {entry!r}") from None
    return digests


def load_index(repo: AptRepository, arch: str, fetcher: Fetcher) -> list[PackageEntry]:
    """Every package of ``repo`` for ``arch`` (and ``all``), each with a signature-vouched digest."""
    base = _base_url(repo)
    dist = base if repo.flat else f"{base}dists/{repo.suite}/"
    what = f"apt repository {repo.name} ({dist}InRelease)"
    signed = verify_clearsigned(
        fetcher.small(dist + "InRelease", name=f"{repo.name} InRelease"), repo.keyring, what=what
    )
    digests = _release_digests(signed.decode("utf-8", errors="replace"))
    entries: list[PackageEntry] = []
    prefixes = [""] if repo.flat else [f"{c}/binary-{arch}/" for c in repo.components]
    for prefix in prefixes:
        for variant, decompress in (*INDEX_VARIANTS, ("Packages", None)):
            path = prefix + variant
            if path not in digests:
                continue
            sha, size = digests[path]
            data = fetcher.blob(dist + path, name=f"{repo.name} {path}", sha256=sha, size=size)
            text = (decompress(data) if decompress is not None else data).decode("utf-8", errors="replace")
            entries.extend(parse_index(text, base, repo.name, arch))
            break
        else:
            raise LockError(f"{what}: lists no Packages index under {prefix or '/'}")
    log.info("%s: %d packages", repo.name, len(entries))
    return entries


def parse_index(text: str, base: str, repo_name: str, arch: str) -> Iterable[PackageEntry]:
    """The entries of one Packages index for ``arch`` (and ``all``); URLs are ``base`` + Filename."""
    for stanza in parse_stanzas(text, _INDEX_FIELDS):
        if stanza.get("Architecture") not in (arch, "all") or "SHA256" not in stanza:
            continue
        try:
            size = int(stanza["Size"])
            filename = stanza["Filename"].removeprefix("./")
        except (KeyError, ValueError):
            raise LockError(
                f"apt repository {repo_name}: package {stanza.get('Package')} has no valid Size or Filename"
            ) from None
        yield entry_from_control(
            stanza, url=base + filename, size=size, sha256=stanza["SHA256"].lower(), repository=repo_name
        )


def parse_manifest(text: str) -> dict[str, str]:
    """An installer package manifest (``casper/*.manifest``): ``name[:arch]<whitespace>version`` lines."""
    installed: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            installed[parts[0].split(":")[0]] = parts[1]
    return installed


# -- resolution --------------------------------------------------------------------------


@dataclass
class Resolution:
    selected: dict[str, PackageEntry] = field(default_factory=dict)
    already_installed: list[str] = field(default_factory=list)

    def packages(self) -> list[PackageEntry]:
        return sorted(self.selected.values(), key=lambda p: p.name)


def _by_version(a: PackageEntry, b: PackageEntry) -> int:
    return compare_versions(a.version, b.version)


def _newest_first(entries: Iterable[PackageEntry]) -> list[PackageEntry]:
    return sorted(entries, key=cmp_to_key(_by_version), reverse=True)


class _Resolver:
    """The greedy closure with Debian's relations; every choice skips candidates that would clash."""

    def __init__(self, index: Sequence[PackageEntry], base: Mapping[str, str]) -> None:
        self.base = base
        self.selected: dict[str, PackageEntry] = {}
        self.by_name: dict[str, list[PackageEntry]] = {}
        self.providers: dict[str, list[tuple[PackageEntry, Relation]]] = {}
        for entry in index:
            self.by_name.setdefault(entry.name, []).append(entry)
            for provided in entry.provided:
                self.providers.setdefault(provided.name, []).append((entry, provided))

    # -- what the final system would hold ----------------------------------------------------

    def installed_version(self, name: str) -> str | None:
        if name in self.selected:
            return self.selected[name].version
        return self.base.get(name)

    def satisfied(self, relation: Relation, among: Iterable[PackageEntry] | None = None) -> bool:
        version = self.installed_version(relation.name)
        if version is not None and satisfies(version, relation.op, relation.version):
            return True
        for entry in self.selected.values() if among is None else among:
            for provided in entry.provided:
                if provided.name == relation.name and _provision_satisfies(provided, relation):
                    return True
        return False

    def clash(self, entry: PackageEntry) -> str | None:
        """Why ``entry`` cannot join the selection (a Conflicts or Breaks either way), or None."""
        others = [p for n, p in self.selected.items() if n != entry.name]
        for kind, relations in (("conflicts with", entry.conflicts), ("breaks", entry.breaks)):
            for relation in relations:
                hit = self._hit(relation, entry, others)
                if hit:
                    return f"{entry} {kind} {relation}, and {hit}"
        for other in others:
            for kind, relations in (("conflicts with", other.conflicts), ("breaks", other.breaks)):
                for relation in relations:
                    if relation.name == entry.name and satisfies(
                        entry.version, relation.op, relation.version
                    ):
                        return f"{other} (already chosen) {kind} {relation}"
                    for provided in entry.provided:
                        if provided.name == relation.name and _provision_hit(provided, relation):
                            return f"{other} (already chosen) {kind} {relation}, which {entry} provides"
        return None

    def _hit(self, relation: Relation, owner: PackageEntry, others: list[PackageEntry]) -> str:
        if relation.name != owner.name:
            chosen = self.selected.get(relation.name)
            if chosen is not None and satisfies(chosen.version, relation.op, relation.version):
                return f"{chosen} is already chosen"
            if chosen is None and relation.name in self.base:
                version = self.base[relation.name]
                if satisfies(version, relation.op, relation.version):
                    return (
                        f"the installed base has {relation.name} {version} (pin a version of "
                        f"{relation.name} that does not clash in packages to upgrade it)"
                    )
        for other in others:
            for provided in other.provided:
                if provided.name == relation.name and _provision_hit(provided, relation):
                    return f"{other} (already chosen) provides {provided}"
        return ""

    # -- choosing ----------------------------------------------------------------------------

    def candidates(self, relation: Relation) -> list[PackageEntry]:
        """Real packages of that name that fit (newest first); else the packages that provide it."""
        real = [
            p
            for p in self.by_name.get(relation.name, [])
            if satisfies(p.version, relation.op, relation.version)
        ]
        if real:
            return _newest_first(real)
        providing = [
            e for e, p in self.providers.get(relation.name, []) if _provision_satisfies(p, relation)
        ]
        names = sorted({e.name for e in providing})
        if len(names) > 1:
            raise LockError(
                f"{relation} is a virtual package that several packages provide ({', '.join(names)})",
                hint=f"list the one you want in packages (for example {names[0]})",
            )
        return _newest_first(providing)

    def choose(self, relation: Relation) -> tuple[PackageEntry | None, list[str]]:
        """The best candidate that clashes with nothing chosen, and why the better ones were skipped."""
        clashes: list[str] = []
        for candidate in self.candidates(relation):
            problem = self.clash(candidate)
            if problem is None:
                return candidate, clashes
            clashes.append(problem)
        return None, clashes

    def add(self, entry: PackageEntry) -> None:
        self.selected[entry.name] = entry
        for group in entry.depends:
            if any(self.satisfied(alt) for alt in group):
                continue
            clashes: list[str] = []
            for alt in group:
                chosen, skipped = self.choose(alt)
                clashes += skipped
                if chosen is not None:
                    self.add(chosen)
                    break
            else:
                wanted = " | ".join(map(str, group))
                if clashes:
                    raise _clash_error(f"{entry} depends on {wanted}", clashes)
                raise LockError(
                    f"{entry.name} {entry.version} depends on {wanted}, which neither the installed base "
                    "nor any configured apt source provides",
                    hint="add the apt source that has it (apt_sources) or list the package explicitly",
                )

    def check(self) -> None:
        """The final set as a whole: every dependency met, no Conflicts or Breaks left."""
        chosen = list(self.selected.values())
        for entry in chosen:
            for group in entry.depends:
                if not any(self.satisfied(alt, chosen) for alt in group):
                    wanted = " | ".join(map(str, group))
                    raise LockError(
                        f"{entry} depends on {wanted}, which the final selection no longer meets "
                        "(another package needed a different version)",
                        hint="pin compatible versions in the definition",
                    )
            problem = self.clash(entry)
            if problem is not None:
                raise LockError(f"the selected packages clash: {problem}", hint="pin compatible versions")


def _clash_error(what: str, clashes: list[str]) -> LockError:
    return LockError(
        f"{what}, but every candidate clashes: {'; '.join(clashes[:3])}",
        hint="pin other versions, or remove one of the conflicting packages from the definition",
    )


def _provision_satisfies(provided: Relation, relation: Relation) -> bool:
    """Debian policy 7.5: an unversioned Provides satisfies only an unversioned relation."""
    if relation.op is None:
        return True
    if provided.op != "=" or provided.version is None:
        return False
    return satisfies(provided.version, relation.op, relation.version)


def _provision_hit(provided: Relation, relation: Relation) -> bool:
    """Whether a Conflicts/Breaks on a virtual name reaches this provider (versioned only if it says so)."""
    return _provision_satisfies(provided, relation)


def resolve(
    requests: Sequence[tuple[str, str | None]],
    index: Sequence[PackageEntry],
    base: Mapping[str, str],
    *,
    install_requested_even_if_present: bool = False,
) -> Resolution:
    """The requested packages and their dependency closure that the base does not already satisfy."""
    result = Resolution()
    resolver = _Resolver(index, base)
    # Pinned requests first: a pinned upgrade of a base package is in place before anything that
    # Breaks the base's older version is chosen.
    ordered = [r for r in requests if r[1] is not None] + [r for r in requests if r[1] is None]
    for name, version in ordered:
        if not install_requested_even_if_present and version is None and name in base:
            result.already_installed.append(name)
            continue
        relation = Relation(name, "=" if version else None, version)
        if name in resolver.selected:
            if version is not None and resolver.selected[name].version != version:
                raise LockError(f"package {name}: two different versions requested")
            continue
        chosen, clashes = resolver.choose(relation)
        if chosen is None and clashes:
            raise _clash_error(f"package {relation} was requested", clashes)
        if chosen is None:
            known = _newest_first(resolver.by_name.get(name, []))
            versions = sorted({p.version for p in known}, key=cmp_to_key(compare_versions))
            raise LockError(
                f"package {name}{'=' + version if version else ''} is in no configured apt source"
                + (f" (available: {', '.join(versions[-5:])})" if versions else ""),
                hint="fix the name or version, or add the apt source that has it",
            )
        resolver.add(chosen)
    resolver.check()
    result.selected = resolver.selected
    return result
