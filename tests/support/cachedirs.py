"""Where the test fixtures that take minutes to make are kept: outside the checkout, keyed by their inputs.

Public API::

    root() -> Path                 # $NODETRUST_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/nodetrust
    shared(name) -> Path           # root() / name
    inputs_key(*parts, files=...)  # 16 hex digits of SHA-256 over ``parts`` and the named files' paths and bytes
    prune(folder, keep, current)   # the newest ``keep`` entries of ``folder`` stay, ``current`` always

CI runs ``make test`` on a clean clone: what lived in the checkout's ``.cache/`` (the fixture installer ISO,
about 6 minutes cold; the payload tree with the real Kubernetes binaries; the imager's boot environment;
the builder's content-addressed download cache) was made again on every run. Like the test peers
(``interop/build.sh``), they now live in the machine's cache, each entry named by a digest of everything
that makes it, so a clone on the same machine reuses them and a changed recipe makes a new entry instead of
using a stale one. Nothing here is trusted blindly: the builder re-hashes every download-cache entry on
use, and the VM tier's builds pin every payload by digest in their lock.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


def root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nodetrust"
    return Path(os.environ.get("NODETRUST_CACHE") or default)


def shared(name: str) -> Path:
    return root() / name


def inputs_key(*parts: str, files: Iterable[Path] = (), base: Path | None = None) -> str:
    """16 hex digits naming ``parts`` and the files (their paths relative to ``base``, and their bytes)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in files:
        name = path.relative_to(base) if base is not None else path
        digest.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def prune(folder: Path, *, keep: int, current: Path) -> None:
    """Remove all but the ``keep`` most recently modified entries of ``folder``; ``current`` always stays."""
    if not folder.is_dir():
        return
    entries = sorted(
        (p for p in folder.iterdir() if p.is_dir() and p != current and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[max(keep - 1, 0) :]:
        shutil.rmtree(old, ignore_errors=True)
