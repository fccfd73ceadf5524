"""The server's EK trust decision (public API; the implementation lives in :mod:`server.ek`).

``EkTrust.load(EkTrustConfig(...))`` -> ``EkTrust``; ``EkTrust.verify(ek, now=None)`` ->
``EkVerdict``; ``EkVerdict.raise_if_denied()`` -> ``server.errors.EkNotTrustedError``.
See :mod:`server.ek.trust` and docs/ek-trust.md.
"""

from __future__ import annotations

from server.ek.config import MODES, TCG_PROFILES, EkTrustConfig
from server.ek.store import SkippedFile
from server.ek.trust import EkTrust, EkVerdict
from server.errors import EkNotTrustedError

__all__ = [
    "MODES",
    "TCG_PROFILES",
    "EkNotTrustedError",
    "EkTrust",
    "EkTrustConfig",
    "EkVerdict",
    "SkippedFile",
]
