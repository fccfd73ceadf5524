"""DSSE envelopes as the builder signs them, read by every program that must trust a build or release.

The envelope (``signature.dsse.json``) holds ``payloadType``, a base64 ``payload`` and
``signatures``; each signature is over DSSE's pre-authentication encoding (:func:`pae`) of the
payload type and the payload bytes, with ECDSA P-256 (SHA-256, DER) or Ed25519. A signature's
``keyid`` (hex SHA-256 of the signer's SubjectPublicKeyInfo DER) is a hint only: every signature is
tried with every trusted key. docs/building-images.md, "Keys, signatures and verification", is the
contract; ``imagebuilder.sign`` writes it and the tests check that this reader accepts what it writes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from protocol.errors import SignatureError

__all__ = [
    "IN_TOTO_PAYLOAD_TYPE",
    "MAX_ENVELOPE_BYTES",
    "PublicKey",
    "Verified",
    "fingerprint",
    "fingerprints_equal",
    "key_id",
    "load_public_key",
    "pae",
    "parse_envelope",
    "verify_envelope",
]

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
#: An envelope larger than this is refused before it is parsed (ours are a few KiB).
MAX_ENVELOPE_BYTES = 1 << 20
MAX_SIGNATURES = 16
MAX_PUBLIC_KEY_BYTES = 16 << 10


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``."""
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(payload), payload)


def key_id(key: PublicKey) -> str:
    """Hex SHA-256 of the public key's SubjectPublicKeyInfo DER (the builder's keyid)."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def fingerprint(key: PublicKey) -> str:
    """``sha256:<key id>``: how a key is pinned on a kernel command line or in a release."""
    return f"sha256:{key_id(key)}"


def fingerprints_equal(a: str, b: str) -> bool:
    """Compare two fingerprints (``sha256:<hex>`` or bare hex) in constant time."""

    def bare(text: str) -> bytes:
        return text.lower().removeprefix("sha256:").encode("ascii", "replace")

    return hmac.compare_digest(bare(a), bare(b))


def load_public_key(data: bytes, *, source: str = "public key") -> PublicKey:
    """A PEM SubjectPublicKeyInfo public key, ECDSA P-256 or Ed25519; SignatureError otherwise."""
    if len(data) > MAX_PUBLIC_KEY_BYTES:
        raise SignatureError(f"{source}: larger than {MAX_PUBLIC_KEY_BYTES} bytes", reason="malformed")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise SignatureError(
            f"{source}: not a PEM public key (SubjectPublicKeyInfo)", reason="malformed"
        ) from None
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise SignatureError(f"{source}: unsupported key type; use ECDSA P-256 or Ed25519", reason="malformed")


@dataclass(frozen=True)
class Verified:
    """A payload whose signature verified, and the key that verified it."""

    payload_type: str
    payload: bytes
    key: PublicKey

    @property
    def key_id(self) -> str:
        return key_id(self.key)


def _b64decode(text: str, what: str) -> bytes:
    """DSSE allows standard and URL-safe base64; padding may be left out."""
    padded = text + "=" * (-len(text) % 4)
    alphabet = b"-_" if ("-" in text or "_" in text) else None
    try:
        return base64.b64decode(padded, altchars=alphabet, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"the {what} is not valid base64", reason="malformed") from None


def _verifies(key: PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
        else:
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def parse_envelope(data: bytes) -> Mapping[str, Any]:
    """The envelope as a JSON object, bounded in size before it is parsed."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise SignatureError(
            f"the envelope is {len(data)} bytes, more than {MAX_ENVELOPE_BYTES}", reason="malformed"
        )
    try:
        envelope = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SignatureError(f"the envelope is not UTF-8 JSON ({exc})", reason="malformed") from None
    if not isinstance(envelope, dict):
        raise SignatureError("the envelope is not a JSON object", reason="malformed")
    return envelope


def verify_envelope(
    envelope: Mapping[str, Any], keys: Sequence[PublicKey], *, payload_type: str = IN_TOTO_PAYLOAD_TYPE
) -> Verified:
    """The payload of ``envelope`` if one of its signatures verifies with one of ``keys``.

    Raises SignatureError: ``malformed`` (not a DSSE envelope, wrong payload type, bad base64),
    ``untrusted-key`` (no signature names or verifies with a trusted key), ``bad-signature`` (a
    signature names a trusted key but does not verify: the payload or the signature was changed).
    """
    if not keys:
        raise SignatureError("no trusted key to verify the envelope with", reason="untrusted-key")
    kind, body, signatures = envelope.get("payloadType"), envelope.get("payload"), envelope.get("signatures")
    if not isinstance(kind, str) or not isinstance(body, str) or not isinstance(signatures, list):
        raise SignatureError(
            "not a DSSE envelope (payloadType, payload and signatures are required)", reason="malformed"
        )
    if kind != payload_type:
        raise SignatureError(f"payloadType is {kind!r}, expected {payload_type!r}", reason="malformed")
    if not signatures:
        raise SignatureError("the envelope holds no signature", reason="untrusted-key")
    if len(signatures) > MAX_SIGNATURES:
        raise SignatureError(f"more than {MAX_SIGNATURES} signatures", reason="malformed")
    payload = _b64decode(body, "payload")
    message = pae(kind, payload)
    named: list[str] = []
    for entry in signatures:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sig"), str):
            raise SignatureError("a signature entry has no 'sig' string", reason="malformed")
        keyid = entry.get("keyid")
        named.append(keyid if isinstance(keyid, str) and keyid else "(no keyid)")
        signature = _b64decode(entry["sig"], "sig")
        for key in keys:
            if _verifies(key, signature, message):
                return Verified(kind, payload, key)
    trusted = [key_id(key) for key in keys]
    if any(fingerprints_equal(name, wanted) for name in named for wanted in trusted):
        raise SignatureError(
            "the signature by a trusted key does not verify (the payload or the signature was changed)",
            reason="bad-signature",
        )
    raise SignatureError(
        f"not signed by a trusted key (trusted: {', '.join(trusted)}; the envelope names {', '.join(named)})",
        reason="untrusted-key",
    )
