"""What a release signs of one image, from one read of it: the whole SHA-256 and BLAKE3
(:mod:`protocol.imagedigest`) and the per-chunk SHA-256 list (:mod:`protocol.chunklist`).

Public API: :class:`FileDigests`, :func:`digest_file`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import blake3

from protocol import chunklist

__all__ = ["FileDigests", "digest_file"]


@dataclass(frozen=True)
class FileDigests:
    sha256: str
    blake3: str
    size: int
    chunk_list: bytes  # protocol.chunklist's lines, one per chunk


def digest_file(path: Path, chunk_size: int = chunklist.CHUNK_SIZE) -> FileDigests:
    """The whole SHA-256 and BLAKE3 of the file at ``path`` and its chunk list, reading it once."""
    whole, fast = hashlib.sha256(), blake3.blake3(max_threads=os.cpu_count() or 1)
    lines = []
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(chunk_size):
            whole.update(chunk)
            fast.update(chunk)
            lines.append(chunklist.line(chunk))
            size += len(chunk)
    return FileDigests(whole.hexdigest(), fast.hexdigest(), size, b"".join(lines))
