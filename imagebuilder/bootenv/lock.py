"""Pinning the boot environment: every Debian package with the digest the signed archive gives it.

``imagebuilder bootenv lock`` loads Debian's index through the builder's own machinery
(:func:`imagebuilder.aptindex.load_index`: ``InRelease`` checked with gpgv against the Debian archive
keyring, every index file against the digest ``InRelease`` signs), resolves the closure of
:data:`imagebuilder.bootenv.recipe.PACKAGES` (:func:`imagebuilder.aptindex.resolve`) and writes the
lock: each package's name, version, URL, SHA-256 and size. The build fetches exactly these, through
the digest-addressed cache, and refuses anything else.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuilder import aptindex
from imagebuilder.bootenv import recipe
from imagebuilder.buildfolder import dump_json, is_sha256_hex, sha256_file
from imagebuilder.cache import Cache
from imagebuilder.errors import LockError
from imagebuilder.fetch import fetch_small

log = logging.getLogger(__name__)

SCHEMA = "https://nodetrust.dev/imager-bootenv-lock/v1"


@dataclass(frozen=True)
class Pinned:
    name: str
    version: str
    architecture: str
    url: str
    sha256: str
    size: int


class _Fetcher:
    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def small(self, url: str, *, name: str) -> bytes:
        return fetch_small(url, name=name)

    def blob(self, url: str, *, name: str, sha256: str, size: int) -> bytes:
        return self.cache.fetch(name, [url], sha256=sha256, size=size).path.read_bytes()


def lock(cache: Cache, path: Path) -> list[Pinned]:
    source = recipe.apt_source()
    index = aptindex.load_index(source, recipe.ARCHITECTURE, _Fetcher(cache))
    resolution = aptindex.resolve([(name, None) for name in recipe.PACKAGES], index, {})
    pinned = [
        Pinned(e.name, e.version, e.architecture, e.url, e.sha256, e.size)
        for _, e in sorted(resolution.selected.items())
    ]
    document = {
        "schema": SCHEMA,
        "source": {
            "url": source.url,
            "suite": source.suite,
            "components": list(source.components),
            "keyring": str(source.keyring),
            "keyring_sha256": sha256_file(source.keyring),
        },
        "requested": list(recipe.PACKAGES),
        "packages": [p.__dict__ for p in pinned],
    }
    path.write_bytes(dump_json(document))
    log.info("locked %d packages (%d bytes) into %s", len(pinned), sum(p.size for p in pinned), path)
    return pinned


def load(path: Path) -> list[Pinned]:
    try:
        document: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LockError(f"{path}: cannot read the boot environment lock: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise LockError(f"{path}: not a boot environment lock ({SCHEMA})")
    if document.get("requested") != list(recipe.PACKAGES):
        raise LockError(
            f"{path}: made for other packages than the recipe asks for",
            hint="run `imagebuilder bootenv lock` again and review the diff",
        )
    out = []
    for item in document.get("packages", []):
        pinned = Pinned(**{k: item[k] for k in ("name", "version", "architecture", "url", "sha256", "size")})
        if not is_sha256_hex(pinned.sha256) or not pinned.url.startswith(("http://", "https://")):
            raise LockError(f"{path}: package {pinned.name} has no http(s) URL or SHA-256")
        out.append(pinned)
    return out
