"""The EK trust decision: hash allowlist and manufacturer-CA chain validation.

Public API (also importable from :mod:`server.ek_trust`): :class:`EkTrust`,
:class:`EkTrustConfig`, :class:`EkVerdict`, :class:`SkippedFile`.

Modules: (the DER reader is :mod:`protocol.der`), ``keys`` (public keys, signatures), ``certificate``
(lenient X.509 parser), ``store`` (CA directory snapshot, chain building),
``cadir`` (reloading it), ``hashes`` (hash allowlist), ``profile`` (EK certificate
profile), ``config`` (configuration), ``trust`` (the decision). Importing has no side effects.
"""

from __future__ import annotations

from server.ek.config import EkTrustConfig
from server.ek.store import SkippedFile
from server.ek.trust import EkTrust, EkVerdict

__all__ = ["EkTrust", "EkTrustConfig", "EkVerdict", "SkippedFile"]
