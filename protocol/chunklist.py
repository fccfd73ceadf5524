"""Signed per-chunk digests of an image: a whole-image SHA-256 verified on several cores at once.

One SHA-256 stream runs on one core (about 1.3 GB/s with SHA-NI), slower than a fast NVMe drive
writes. A release therefore signs, beside each image's whole digest, a *chunk list*: the SHA-256 of
every ``chunk_size`` bytes of the image, in order (the last chunk may be shorter), one lower-case hex
digest and a newline per chunk. The list is a file of the release folder like any other, its own
digest signed by the statement, and the image's entry in ``release.json`` names it::

    "chunks": {"name": "node.raw.sha256-chunks", "sha256": "...", "size": 6240, "chunk_size": 67108864}

A consumer that has checked the signature, then the list's digest, and then every chunk against
the list, has checked every byte of the image: the chunks are independent, so they can be hashed in
parallel (the imager gives each core its own chunks). The whole-image digest stays for every other
consumer.

Public API: :data:`CHUNK_SIZE` (the builder's choice, 64 MiB), :data:`LINE` (bytes per chunk in a
list), :func:`check_chunk_size`, :func:`chunk_count`, :func:`line` (one chunk's line), :func:`render`
(``path -> bytes``), :func:`parse` (the list's bytes, checked against the image).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from protocol.errors import ReleaseFormatError

__all__ = [
    "CHUNK_SIZE",
    "LINE",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "SUFFIX",
    "check_chunk_size",
    "chunk_count",
    "line",
    "parse",
    "render",
]

CHUNK_SIZE = 64 << 20
MIN_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = 1 << 30
SUFFIX = ".sha256-chunks"
LINE = 65  # 64 hex digits and a newline
_LINE = re.compile(rb"[0-9a-f]{64}\n")


def check_chunk_size(chunk_size: object, file: str, where: str) -> int:
    """``chunk_size`` if it is a power of two between 1 MiB and 1 GiB; ReleaseFormatError otherwise."""
    if (
        not isinstance(chunk_size, int)
        or isinstance(chunk_size, bool)
        or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
        or chunk_size & (chunk_size - 1)
    ):
        raise ReleaseFormatError(file, f"{where}.chunk_size must be a power of two from 1 MiB to 1 GiB")
    return chunk_size


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks an image of ``size`` bytes has (an empty image has none)."""
    return -(-size // chunk_size)


def line(chunk: bytes) -> bytes:
    """One chunk's line of a list."""
    return hashlib.sha256(chunk).hexdigest().encode() + b"\n"


def render(path: Path, chunk_size: int = CHUNK_SIZE) -> bytes:
    """The chunk list of the file at ``path``."""
    lines = []
    with path.open("rb") as fh:
        while chunk := fh.read(chunk_size):
            lines.append(line(chunk))
    return b"".join(lines)


def parse(data: bytes, *, size: int, chunk_size: int, name: str) -> tuple[bytes, ...]:
    """The digests of a chunk list whose own digest was already checked: one per chunk of an image of
    ``size`` bytes, each well formed; ReleaseFormatError names what is wrong."""
    expected = chunk_count(size, chunk_size)
    if len(data) != expected * LINE:
        raise ReleaseFormatError(
            name, f"{len(data)} bytes; {expected} chunks of {chunk_size} bytes need {expected * LINE}"
        )
    digests = []
    for i in range(expected):
        line = data[i * LINE : (i + 1) * LINE]
        if _LINE.fullmatch(line) is None:
            raise ReleaseFormatError(name, f"line {i + 1} is not a lower-case hex SHA-256")
        digests.append(bytes.fromhex(line[:64].decode()))
    return tuple(digests)
