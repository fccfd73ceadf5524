"""Pinning the boot environment: every Debian package with the digest the signed archive gives it, and
every wheel with the digest the package index gives it.

``imagebuilder bootenv lock`` loads Debian's index through the builder's own machinery
(:func:`imagebuilder.aptindex.load_index`: ``InRelease`` checked with gpgv against the Debian archive
keyring, every index file against the digest ``InRelease`` signs), resolves the closure of
:data:`imagebuilder.bootenv.recipe.PACKAGES` (:func:`imagebuilder.aptindex.resolve`) and checks that libc6
and python3.X are those of :data:`imagebuilder.bootenv.recipe.TARGET`. It then asks pip which wheel files
satisfy :data:`imagebuilder.bootenv.recipe.WHEELS` for that Python and glibc
(:func:`imagebuilder.wheelhouse.pip_report`: binary only, no dependencies), requires each to be the pinned
version with an https URL and a SHA-256, and fetches it once through the digest-addressed cache (which
checks that SHA-256 and gives the size). The lock records each package's and wheel's name, version, URL,
SHA-256 and size. The build fetches exactly these, through the cache, and refuses anything else.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from imagebuilder import aptindex, wheelhouse
from imagebuilder.bootenv import recipe
from imagebuilder.buildfolder import dump_json, is_sha256_hex, sha256_file
from imagebuilder.cache import Cache
from imagebuilder.definition import Target
from imagebuilder.errors import LockError
from imagebuilder.fetch import fetch_small

log = logging.getLogger(__name__)

SCHEMA = "https://nodetrust.dev/imager-bootenv-lock/v1"
RELOCK = "run `imagebuilder bootenv lock` again and review the diff"
PACKAGE_FIELDS = ("name", "version", "architecture", "url", "sha256", "size")
WHEEL_FIELDS = ("name", "version", "url", "sha256", "size", "filename")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)")


@dataclass(frozen=True)
class Pinned:
    name: str
    version: str
    architecture: str
    url: str
    sha256: str
    size: int


@dataclass(frozen=True)
class PinnedWheel:
    name: str  # normalised project name
    version: str
    url: str
    sha256: str
    size: int
    filename: str


@dataclass(frozen=True)
class Locked:
    """What a lock pins: the Debian packages and the wheels."""

    packages: tuple[Pinned, ...]
    wheels: tuple[PinnedWheel, ...]


class _Fetcher:
    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def small(self, url: str, *, name: str) -> bytes:
        return fetch_small(url, name=name)

    def blob(self, url: str, *, name: str, sha256: str, size: int) -> bytes:
        return self.cache.fetch(name, [url], sha256=sha256, size=size).path.read_bytes()


def _upstream(version: str) -> str:
    """The upstream part of a Debian version: no epoch, no Debian revision."""
    without_epoch = version.split(":", 1)[1] if ":" in version else version
    return without_epoch.rsplit("-", 1)[0]


def check_target(packages: Iterable[Pinned], target: Target = recipe.TARGET) -> None:
    """Refuse packages whose libc6 or python3.X is not the target's glibc or Python (the wheels are
    resolved for the target, so a Debian that disagrees would load them into the wrong interpreter)."""
    versions = {p.name: p.version for p in packages}
    python = f"python{target.python}"
    problems = []
    for package, want in (("libc6", target.glibc), (python, target.python)):
        have = versions.get(package)
        if have is None:
            problems.append(f"{package} is not among the locked packages")
            continue
        upstream = _upstream(have)
        if upstream != want and not upstream.startswith(want + "."):
            problems.append(f"{package} is {have}, not {want}")
    if problems:
        raise LockError(
            f"the boot environment's packages disagree with its target (Python {target.python}, glibc "
            f"{target.glibc}): " + "; ".join(problems),
            hint="recipe.TARGET must name the Python and glibc of recipe.SUITE: correct one or the other",
        )


def _pins(requirements: Sequence[str]) -> dict[str, str]:
    """``name==version`` requirements as normalised name -> version; anything looser is refused."""
    pins = {}
    for requirement in requirements:
        match = _PIN.fullmatch(requirement.strip())
        if match is None:
            raise LockError(
                f"boot environment wheel {requirement!r} is not pinned to one version",
                hint="recipe.WHEELS takes name==version only",
            )
        pins[wheelhouse.normalise(match.group(1))] = match.group(2)
    return pins


def check_wheels(
    requirements: Sequence[str],
    items: Sequence[wheelhouse.ReportItem | PinnedWheel],
    *,
    where: str,
    hint: str = RELOCK,
) -> None:
    """Each item is a ``.whl`` with an https URL and a SHA-256, and the items are exactly the pinned
    name and version of each requirement (``where`` says whose items they are, ``hint`` what to do)."""
    for item in items:
        if not item.url.startswith("https://") or not is_sha256_hex(item.sha256):
            raise LockError(
                f"{where}: wheel {item.name} {item.version} has no https URL or no SHA-256 ({item.url!r})",
                hint="the boot environment takes wheels only from an index that serves them over https "
                "with their SHA-256 (PyPI does)",
            )
        if not item.filename.endswith(".whl") or "/" in item.filename:
            raise LockError(f"{where}: {item.filename!r} is not a wheel file name", hint=hint)
    wanted = _pins(requirements)
    got = {item.name: item.version for item in items}
    if got != wanted or len(items) != len(got):
        raise LockError(
            f"{where}: the wheels {sorted(got.items())} are not the recipe's pins {sorted(wanted.items())}",
            hint=hint,
        )


def _lock_wheels(cache: Cache) -> list[PinnedWheel]:
    report = wheelhouse.pip_report(
        list(recipe.WHEELS), recipe.TARGET, recipe.ARCHITECTURE, find_links=[], no_deps=True
    )
    check_wheels(recipe.WHEELS, report, where="pip's report",
                 hint="pip resolved other wheels than recipe.WHEELS pins: check the pins and the index")  # fmt: skip
    wheels = []
    for item in sorted(report, key=lambda i: i.name):
        size = cache.fetch(item.filename, [item.url], sha256=item.sha256).size
        wheels.append(PinnedWheel(item.name, item.version, item.url, item.sha256, size, item.filename))
    return wheels


def lock(cache: Cache, path: Path) -> Locked:
    source = recipe.apt_source()
    index = aptindex.load_index(source, recipe.ARCHITECTURE, _Fetcher(cache))
    resolution = aptindex.resolve([(name, None) for name in recipe.PACKAGES], index, {})
    pinned = [
        Pinned(e.name, e.version, e.architecture, e.url, e.sha256, e.size)
        for _, e in sorted(resolution.selected.items())
    ]
    check_target(pinned)
    wheels = _lock_wheels(cache)
    document = {
        "schema": SCHEMA,
        "source": {
            "url": source.url,
            "suite": source.suite,
            "components": list(source.components),
            "keyring": str(source.keyring),
            "keyring_sha256": sha256_file(source.keyring),
        },
        "target": _target_json(recipe.TARGET),
        "requested": list(recipe.PACKAGES),
        "packages": [asdict(p) for p in pinned],
        "requested_wheels": list(recipe.WHEELS),
        "wheels": [asdict(w) for w in wheels],
    }
    path.write_bytes(dump_json(document))
    log.info(
        "locked %d packages (%d bytes) and %d wheels (%d bytes) into %s",
        len(pinned),
        sum(p.size for p in pinned),
        len(wheels),
        sum(w.size for w in wheels),
        path,
    )
    return Locked(tuple(pinned), tuple(wheels))


def _target_json(target: Target) -> dict[str, str]:
    return {"python": target.python, "glibc": target.glibc}


def _entries(path: Path, document: dict[str, Any], key: str, fields: Sequence[str]) -> list[dict[str, Any]]:
    """``document[key]``: a list of objects, each cut down to ``fields`` (all required)."""
    items = document.get(key)
    if not isinstance(items, list) or not all(isinstance(i, dict) and set(fields) <= set(i) for i in items):
        raise LockError(f"{path}: {key} must be a list of objects with {', '.join(fields)}", hint=RELOCK)
    return [{k: item[k] for k in fields} for item in items]


def load(path: Path) -> Locked:
    """The lock at ``path``, refused when it was made for another recipe or names anything unpinned."""
    try:
        document: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LockError(f"{path}: cannot read the boot environment lock: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise LockError(f"{path}: not a boot environment lock ({SCHEMA})")
    if (
        document.get("requested") != list(recipe.PACKAGES)
        or document.get("requested_wheels") != list(recipe.WHEELS)
        or document.get("target") != _target_json(recipe.TARGET)
    ):
        raise LockError(f"{path}: made for other packages, wheels or target than the recipe asks for",
                        hint=RELOCK)  # fmt: skip
    packages = []
    for item in _entries(path, document, "packages", PACKAGE_FIELDS):
        pinned = Pinned(**item)
        if not is_sha256_hex(pinned.sha256) or not pinned.url.startswith(("http://", "https://")):
            raise LockError(f"{path}: package {pinned.name} has no http(s) URL or SHA-256")
        packages.append(pinned)
    check_target(packages)
    wheels = [PinnedWheel(**item) for item in _entries(path, document, "wheels", WHEEL_FIELDS)]
    check_wheels(recipe.WHEELS, wheels, where=str(path))
    for wheel in wheels:
        if not isinstance(wheel.size, int) or wheel.size <= 0:
            raise LockError(f"{path}: wheel {wheel.name} has no size", hint=RELOCK)
    return Locked(tuple(packages), tuple(wheels))
