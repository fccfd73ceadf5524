"""Which signed digest the imager verifies an image with (``nodeimager.digest=``).

A release signs each image's SHA-256 and, beside it in the same entry, its BLAKE3
(:mod:`protocol.imagedigest`); :func:`new` makes a hasher of either. Both are equally signed; they
differ in speed. One SHA-256 stream is slower than a fast disk writes (docs/bare-metal.md, "Which
digest"), BLAKE3 is several times faster.

* ``auto`` (the default): BLAKE3 when the release signs one and this imager has the ``blake3`` module
  (its boot environment does), else SHA-256 (per chunk on several cores when the release has a chunk
  list for the raw path, else one stream).
* ``blake3``: BLAKE3 or a refusal (a release without it, an imager without the module).
* ``sha256``: SHA-256 only, for a site whose policy admits only FIPS-approved hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from imager.errors import ImagerError, Reason
from protocol.release import Image

CHOICES = ("auto", "sha256", "blake3")


class UnavailableError(RuntimeError):
    """The algorithm's implementation is not installed here (``blake3``: the PyPI wheel)."""


class Hash(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def new(algorithm: str, *, threads: int = 1) -> Hash:
    """A fresh hasher. ``threads``: BLAKE3 may hash one large update on that many cores (SHA-256 cannot).

    Both release the GIL while they hash a large buffer, so a hasher thread runs beside the others."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3  # the boot environment carries its wheel (imagebuilder/bootenv/recipe.py)
        except ImportError:
            raise UnavailableError("the blake3 module is not installed") from None
        return blake3.blake3(max_threads=max(1, threads))
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(CHOICES[1:])})")


def available(algorithm: str) -> bool:
    """Whether :func:`new` can make a hasher of ``algorithm`` in this Python."""
    try:
        new(algorithm)
    except UnavailableError:
        return False
    return True


@dataclass(frozen=True)
class Check:
    """Verify an image's bytes with ``algorithm`` against ``expected``, the release's signed digest."""

    algorithm: str
    expected: str

    def new(self, threads: int = 1) -> Hash:
        return new(self.algorithm, threads=threads)


def choose(choice: str, image: Image) -> Check:
    """The check for ``image`` under ``nodeimager.digest=choice``; ImagerError when it cannot be made."""
    if choice not in CHOICES:
        raise ImagerError(Reason.usage, f"nodeimager.digest={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "sha256" or (choice == "auto" and (image.blake3 is None or not available("blake3"))):
        return Check("sha256", image.sha256)
    if image.blake3 is None:
        raise ImagerError(
            Reason.release_format,
            f"{image.name}: nodeimager.digest=blake3, and the release signs no BLAKE3 for it",
            hint="make the release again with this imagebuilder, or boot with nodeimager.digest=sha256",
        )
    if not available("blake3"):
        raise ImagerError(
            Reason.tool_missing,
            "nodeimager.digest=blake3, and this imager has no blake3 module",
            hint="boot the imager of the release (its boot environment carries it), or nodeimager.digest=sha256",
        )
    return Check("blake3", image.blake3)
