"""Which signed digest the imager verifies an image with (``nodeimager.digest=``).

A release signs each image's SHA-256 and, beside it in the same entry, its BLAKE3
(:mod:`protocol.imagedigest`). Both are equally signed; they differ in speed. One SHA-256 stream is
slower than a fast disk writes (docs/bare-metal.md, "Which digest"), BLAKE3 is several times faster.

* ``auto`` (the default): BLAKE3 when the release signs one and this imager has the ``blake3`` module
  (its boot environment does), else SHA-256 (per chunk on several cores when the release has a chunk
  list for the raw path, else one stream).
* ``blake3``: BLAKE3 or a refusal (a release without it, an imager without the module).
* ``sha256``: SHA-256 only, for a site whose policy admits only FIPS-approved hashes.
"""

from __future__ import annotations

from dataclasses import dataclass

from imager.errors import ImagerError, Reason
from protocol import imagedigest
from protocol.release import Image

CHOICES = ("auto", "sha256", "blake3")


@dataclass(frozen=True)
class Check:
    """Verify an image's bytes with ``algorithm`` against ``expected``, the release's signed digest."""

    algorithm: str
    expected: str

    def new(self, threads: int = 1) -> imagedigest.Hash:
        return imagedigest.new(self.algorithm, threads=threads)


def choose(choice: str, image: Image) -> Check:
    """The check for ``image`` under ``nodeimager.digest=choice``; ImagerError when it cannot be made."""
    if choice not in CHOICES:
        raise ImagerError(Reason.usage, f"nodeimager.digest={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "sha256" or (
        choice == "auto" and (image.blake3 is None or not imagedigest.available("blake3"))
    ):
        return Check("sha256", image.sha256)
    if image.blake3 is None:
        raise ImagerError(
            Reason.release_format,
            f"{image.name}: nodeimager.digest=blake3, and the release signs no BLAKE3 for it",
            hint="make the release again with this imagebuilder, or boot with nodeimager.digest=sha256",
        )
    if not imagedigest.available("blake3"):
        raise ImagerError(
            Reason.tool_missing,
            "nodeimager.digest=blake3, and this imager has no blake3 module",
            hint="boot the imager of the release (its boot environment carries it), or nodeimager.digest=sha256",
        )
    return Check("blake3", image.blake3)
