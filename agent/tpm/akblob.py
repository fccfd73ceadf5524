"""The attestation key kept between attestation and the quotes that follow it.

The AK lives in the TPM only while a command runs (the agent flushes every transient object),
so the agent keeps what it needs to load it again under the persistent SRK: its
``TPM2B_PUBLIC`` and its ``TPM2B_PRIVATE``. The private part is the key's sensitive area
wrapped (encrypted and integrity-protected) by the SRK: useless outside this TPM, but still
written 0600 beside the SVID key, never logged.

The file is ``ak.json`` in the state folder: ``{"schema": 1, "public": <hex TPM2B_PUBLIC>,
"private": <hex TPM2B_PRIVATE>}``. A successful attestation replaces it together with the SVID
(:class:`agent.svid.SvidStore`), so a later quote is always signed by the AK the server
credential-activated last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agent.errors import StateError
from protocol import tpm2
from protocol.errors import ProtocolError

AK_FILE = "ak.json"
MAX_AK_FILE_BYTES = 16 * 1024  # a TPM2B_PUBLIC and a TPM2B_PRIVATE are well under 2 KiB together
MAX_BLOB_BYTES = 4096
_HEX_RE = re.compile(r"(?:[0-9a-f]{2})+")
SCHEMA = 1


@dataclass(frozen=True)
class AkBlob:
    """An AK as TPM2_Load takes it: ``public`` (TPM2B_PUBLIC) and ``private`` (TPM2B_PRIVATE), marshalled."""

    public: bytes
    private: bytes

    def __repr__(self) -> str:
        return f"AkBlob(name={self.name().hex()[:20]}..., private=<{len(self.private)} bytes>)"

    @property
    def tpmt_public(self) -> bytes:
        """The TPMT_PUBLIC inside ``public`` (what the server records and verifies quotes with)."""
        return _sized(self.public, "public")

    def name(self) -> bytes:
        """The AK's TPM name (nameAlg || H(TPMT_PUBLIC))."""
        return tpm2.parse_public(self.tpmt_public).name()

    def to_json(self) -> bytes:
        doc = {"schema": SCHEMA, "public": self.public.hex(), "private": self.private.hex()}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> AkBlob:
        """Parse ``ak.json``; :class:`StateError` names what is wrong and how to recover."""
        hint = "remove it and attest again (nodeagent attest), which makes and records a new AK"
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise StateError(f"{where} is not JSON: {str(exc)[:80]}", hint=hint) from exc
        if (
            not isinstance(doc, dict)
            or set(doc) != {"schema", "public", "private"}
            or doc["schema"] != SCHEMA
        ):
            raise StateError(f"{where} is not an AK file of schema {SCHEMA}", hint=hint)
        parts: dict[str, bytes] = {}
        for key in ("public", "private"):
            value = doc[key]
            if not isinstance(value, str) or not _HEX_RE.fullmatch(value) or len(value) > 2 * MAX_BLOB_BYTES:
                raise StateError(f"{where}: {key} is not hex of at most {MAX_BLOB_BYTES} bytes", hint=hint)
            parts[key] = bytes.fromhex(value)
        blob = cls(public=parts["public"], private=parts["private"])
        try:
            _sized(blob.private, "private")
            public = tpm2.parse_public(blob.tpmt_public)
        except (ProtocolError, StateError) as exc:
            raise StateError(f"{where}: the AK's TPM structures are malformed: {exc}", hint=hint) from exc
        if not (public.has(tpm2.ObjectAttr.RESTRICTED) and public.has(tpm2.ObjectAttr.SIGN_ENCRYPT)):
            raise StateError(f"{where}: the key is not a restricted signing key (not an AK)", hint=hint)
        return blob


def _sized(data: bytes, what: str) -> bytes:
    """The body of a TPM2B (u16 size, then that many bytes, nothing after)."""
    if len(data) < 2 or int.from_bytes(data[:2], "big") != len(data) - 2:
        raise StateError(f"the AK's {what} blob is not one TPM2B", hint="remove ak.json and attest again")
    return data[2:]
