"""Errors raised by the protocol codecs.

Every decoder in this package raises a subclass of :class:`ProtocolError` and
nothing else for bad input, so callers (and the fuzz tests) can tell malformed
data from bugs.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """Input that does not follow the wire contract."""


class PayloadError(ProtocolError):
    """The ``tpm`` attestor JSON (payload, challenge or response) is malformed."""


class TpmStructureError(ProtocolError):
    """A marshalled TPM 2.0 structure is truncated, has trailing bytes or bad fields."""


class CredentialError(ProtocolError):
    """A credential blob cannot be built or opened (wrong key type, bad integrity)."""


class SpiffeIdError(ProtocolError):
    """A string is not a valid SPIFFE ID or trust domain."""


class ReportError(ProtocolError):
    """A GPU and node verification report is malformed or has an unknown schema version."""


class PolicyError(ProtocolError):
    """A pool policy (profile mapping or preset name) is invalid: unknown keys, wrong types, bad values."""


class SignatureError(ProtocolError):
    """A DSSE envelope is malformed, or none of its signatures verifies with a trusted key.

    ``reason`` is a stable token (``malformed``, ``untrusted-key``, ``bad-signature``) that callers
    decide on; the message is for people.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ReleaseFormatError(ProtocolError):
    """A signed build or release statement, a build manifest or a release manifest breaks its contract.

    ``file`` names the file at fault (``signature.dsse.json``, ``manifest.json``, ``release.json``);
    ``reason`` is ``format`` (the contract is broken) or ``digest`` (a file does not hash to the
    digest the signature covers).
    """

    def __init__(self, file: str, message: str, *, reason: str = "format") -> None:
        super().__init__(f"{file}: {message}")
        self.file = file
        self.reason = reason
