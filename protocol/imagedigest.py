"""The digests a release signs for each image: SHA-256 always, BLAKE3 beside it.

SHA-256 names an image everywhere (the build's checksums, SBOM and provenance, the iPXE script's
``nodeimager.image=sha256:...`` pin). One SHA-256 stream runs on one core at about 1.2 to 1.3 GB/s with
SHA-NI, slower than the disks a server boots from, so a verified write would be bounded by the hash.
BLAKE3 (a cryptographic hash, 256-bit output, 128-bit security like SHA-256) runs at about 5 GB/s on
one core here. ``imagebuilder release`` computes both from the same read of the image
(:mod:`imagebuilder.release.digests`) and signs them in the same ``release.json`` entry; the imager
verifies one of them (:mod:`imager.digest`, ``nodeimager.digest=``), both being equally signed.

This module is the format only (no hash implementation: the ``blake3`` module is a dependency of the
builder and of the imager's boot environment, not of every reader of a release).

Public API: :data:`ALGORITHMS`, :func:`is_hex`.
"""

from __future__ import annotations

import re

__all__ = ["ALGORITHMS", "is_hex"]

ALGORITHMS = ("sha256", "blake3")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_hex(value: object) -> bool:
    """A 256-bit digest as 64 lower-case hex digits (both algorithms print that)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None
