"""The digests a release signs for each image: SHA-256 always, BLAKE3 beside it.

SHA-256 names an image everywhere (the build's checksums, SBOM and provenance, the iPXE script's
``nodeimager.image=sha256:…`` pin). One SHA-256 stream runs on one core at about 1.2 to 1.3 GB/s with
SHA-NI, slower than the disks a server boots from, so a verified write would be bounded by the hash.
BLAKE3 (a cryptographic hash, 256-bit output, 128-bit security like SHA-256) runs at about 6 GB/s on
one core here. ``imagebuilder release`` computes both from the same read of the image and signs them
in the same ``release.json`` entry; the imager verifies one of them (``nodeimager.digest=``), both being
equally signed.

Public API: :data:`ALGORITHMS`, :class:`Hash` (the hashlib-like interface), :func:`new`,
:func:`available`, :func:`is_hex`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

__all__ = ["ALGORITHMS", "Hash", "UnavailableError", "available", "is_hex", "new"]

ALGORITHMS = ("sha256", "blake3")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class UnavailableError(RuntimeError):
    """The algorithm's implementation is not installed here (``blake3``: the PyPI wheel)."""


class Hash(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def available(algorithm: str) -> bool:
    """Whether :func:`new` can make a hasher of ``algorithm`` in this Python."""
    try:
        new(algorithm)
    except UnavailableError:
        return False
    return True


def new(algorithm: str, *, threads: int = 1) -> Hash:
    """A fresh hasher. ``threads``: BLAKE3 may hash one large update on that many cores (SHA-256 cannot).

    Both release the GIL while they hash a large buffer, so a hasher thread runs beside the others."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3  # optional: the release side and the boot environment have it
        except ImportError:
            raise UnavailableError("the blake3 module is not installed") from None
        return blake3.blake3(max_threads=max(1, threads))
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def is_hex(value: object) -> bool:
    """A 256-bit digest as 64 lower-case hex digits (both algorithms print that)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None
