"""Signed apt repository indexes, Debian version order, and dependency closure for the lock.

:func:`load_index` fetches ``InRelease`` (``dists/<suite>/InRelease``, or ``InRelease`` at
the URL of a flat repository such as pkgs.k8s.io), verifies it with ``gpgv`` against the
repository's keyring, and fetches each ``Packages`` index through the cache by the digest
InRelease lists. Every package entry so carries a digest vouched for by the signature.

:func:`resolve` picks the packages to stage: the requested ones (pinned version or the
highest) plus their ``Depends``/``Pre-Depends`` closure, minus what the installed base
already has (the installer ISO's package manifest).
"""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from imagebuilder.definition import AptRepository
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.openpgp import verify_clearsigned

log = logging.getLogger(__name__)

INDEX_VARIANTS = (
    ("Packages.xz", lzma.decompress),
    ("Packages.gz", gzip.decompress),
    ("Packages.bz2", bz2.decompress),
)
_DEP = re.compile(
    r"^\s*([a-z0-9][a-z0-9+.-]+)(?::[a-z0-9-]+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?"
)


# -- Debian version order --------------------------------------------------------------


def _order(c: str) -> int:
    if not c or c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    if c == "~":
        return -1
    return ord(c) + 256


def _verrevcmp(a: str, b: str) -> int:
    ia = ib = 0
    while ia < len(a) or ib < len(b):
        first_diff = 0
        while (ia < len(a) and not a[ia].isdigit()) or (ib < len(b) and not b[ib].isdigit()):
            ac = _order(a[ia] if ia < len(a) else "")
            bc = _order(b[ib] if ib < len(b) else "")
            if ac != bc:
                return ac - bc
            ia += 1
            ib += 1
        while ia < len(a) and a[ia] == "0":
            ia += 1
        while ib < len(b) and b[ib] == "0":
            ib += 1
        while ia < len(a) and a[ia].isdigit() and ib < len(b) and b[ib].isdigit():
            if not first_diff:
                first_diff = ord(a[ia]) - ord(b[ib])
            ia += 1
            ib += 1
        if ia < len(a) and a[ia].isdigit():
            return 1
        if ib < len(b) and b[ib].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


def _split(version: str) -> tuple[int, str, str]:
    epoch, _, rest = version.partition(":") if ":" in version else ("0", "", version)
    upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
    return int(epoch or 0), upstream, revision


def compare_versions(a: str, b: str) -> int:
    """dpkg's order: negative if a < b, 0 if equal, positive if a > b."""
    ea, ua, ra = _split(a)
    eb, ub, rb = _split(b)
    if ea != eb:
        return ea - eb
    return _verrevcmp(ua, ub) or _verrevcmp(ra, rb)


def satisfies(version: str, op: str | None, wanted: str | None) -> bool:
    if op is None or wanted is None:
        return True
    cmp = compare_versions(version, wanted)
    return {
        "<<": cmp < 0,
        "<": cmp <= 0,
        "<=": cmp <= 0,
        "=": cmp == 0,
        ">=": cmp >= 0,
        ">": cmp >= 0,
        ">>": cmp > 0,
    }[op]


# -- index parsing -----------------------------------------------------------------------


def parse_stanzas(text: str) -> list[dict[str, str]]:
    """deb822 paragraphs (Packages, Release) as dicts; continuation lines are kept with newlines."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
                current, key = {}, ""
            continue
        if line[0] in " \t" and key:
            current[key] += "\n" + line.strip()
            continue
        key, _, value = line.partition(":")
        current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


@dataclass(frozen=True)
class Relation:
    name: str
    op: str | None = None
    version: str | None = None


def parse_relations(value: str) -> list[list[Relation]]:
    groups = []
    for group in value.split(","):
        alternatives = []
        for alt in group.split("|"):
            match = _DEP.match(alt)
            if match:
                alternatives.append(Relation(match.group(1), match.group(2), match.group(3)))
        if alternatives:
            groups.append(alternatives)
    return groups


@dataclass(frozen=True)
class PackageEntry:
    name: str
    version: str
    architecture: str
    url: str
    size: int
    sha256: str
    repository: str
    depends: tuple[tuple[Relation, ...], ...] = ()
    provides: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.split(':')[-1]}_{self.architecture}.deb"


class Fetcher(Protocol):
    """What :func:`load_index` needs: small uncached reads and digest-checked cached fetches."""

    def small(self, url: str, *, name: str) -> bytes: ...

    def blob(self, url: str, *, name: str, sha256: str, size: int) -> bytes: ...


def _base_url(repo: AptRepository) -> str:
    return repo.url if repo.url.endswith("/") else repo.url + "/"


def _release_digests(text: str) -> dict[str, tuple[str, int]]:
    stanzas = parse_stanzas(text)
    if not stanzas or "SHA256" not in stanzas[0]:
        raise VerificationError("InRelease has no SHA256 section")
    digests: dict[str, tuple[str, int]] = {}
    for line in stanzas[0]["SHA256"].splitlines():
        parts = line.split()
        if len(parts) == 3:
            digests[parts[2]] = (parts[0].lower(), int(parts[1]))
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
            entries.extend(_entries(text, base, repo.name, arch))
            break
        else:
            raise LockError(f"{what}: lists no Packages index under {prefix or '/'}")
    log.info("%s: %d packages", repo.name, len(entries))
    return entries


def _entries(text: str, base: str, repo_name: str, arch: str) -> Iterable[PackageEntry]:
    for stanza in parse_stanzas(text):
        if stanza.get("Architecture") not in (arch, "all") or "SHA256" not in stanza:
            continue
        depends = parse_relations(", ".join(v for k in ("Pre-Depends", "Depends") if (v := stanza.get(k))))
        filename = stanza["Filename"].removeprefix("./")
        yield PackageEntry(
            name=stanza["Package"],
            version=stanza["Version"],
            architecture=stanza["Architecture"],
            url=base + filename,
            size=int(stanza["Size"]),
            sha256=stanza["SHA256"].lower(),
            repository=repo_name,
            depends=tuple(tuple(group) for group in depends),
            provides=tuple(r.name for group in parse_relations(stanza.get("Provides", "")) for r in group),
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


def _candidates(index: Sequence[PackageEntry], name: str) -> list[PackageEntry]:
    return [p for p in index if p.name == name]


def _best(candidates: Sequence[PackageEntry], relation: Relation) -> PackageEntry | None:
    fitting = [p for p in candidates if satisfies(p.version, relation.op, relation.version)]
    best: PackageEntry | None = None
    for p in fitting:
        if best is None or compare_versions(p.version, best.version) > 0:
            best = p
    return best


def resolve(
    requests: Sequence[tuple[str, str | None]],
    index: Sequence[PackageEntry],
    base: Mapping[str, str],
    *,
    install_requested_even_if_present: bool = False,
) -> Resolution:
    """The requested packages and their dependency closure that the base does not already satisfy."""
    result = Resolution()
    provided: dict[str, str] = {}
    by_name: dict[str, list[PackageEntry]] = {}
    for entry in index:
        by_name.setdefault(entry.name, []).append(entry)

    def satisfied(relation: Relation) -> bool:
        if relation.name in result.selected:
            return satisfies(result.selected[relation.name].version, relation.op, relation.version)
        if relation.name in base:
            return satisfies(base[relation.name], relation.op, relation.version)
        return relation.op is None and relation.name in provided

    def add(entry: PackageEntry) -> None:
        result.selected[entry.name] = entry
        for name in entry.provides:
            provided.setdefault(name, entry.name)
        for group in entry.depends:
            if any(satisfied(alt) for alt in group):
                continue
            for alt in group:
                chosen = _best(by_name.get(alt.name, []), alt)
                if chosen is not None:
                    add(chosen)
                    break
            else:
                wanted = " | ".join(f"{a.name} ({a.op} {a.version})" if a.op else a.name for a in group)
                raise LockError(
                    f"{entry.name} {entry.version} depends on {wanted}, which neither the installed base "
                    "nor any configured apt source provides",
                    hint="add the apt source that has it (apt_sources) or list the package explicitly",
                )

    for name, version in requests:
        if not install_requested_even_if_present and version is None and name in base:
            result.already_installed.append(name)
            continue
        relation = Relation(name, "=" if version else None, version)
        chosen = _best(by_name.get(name, []), relation)
        if chosen is None:
            known = sorted({p.version for p in by_name.get(name, [])}, key=_VersionKey)
            raise LockError(
                f"package {name}{'=' + version if version else ''} is in no configured apt source"
                + (f" (available: {', '.join(known[-5:])})" if known else ""),
                hint="fix the name or version, or add the apt source that has it",
            )
        if name in result.selected and result.selected[name] != chosen:
            raise LockError(f"package {name}: two different versions requested")
        add(chosen)
    return result


class _VersionKey:
    def __init__(self, version: str) -> None:
        self.version = version

    def __lt__(self, other: _VersionKey) -> bool:
        return compare_versions(self.version, other.version) < 0
