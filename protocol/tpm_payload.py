"""The ``tpm`` node attestor's JSON, exactly as spire-tpm-plugin v1.9.0 writes it.

Go's ``encoding/json`` conventions: keys are the Go field names verbatim, in
struct order, compact; ``[]byte`` is standard base64 with padding.

* payload  ``{"EK":b64(PEM),"AK":{"Public","UseTCSDActivationFormat","CreateData",
  "CreateAttestation","CreateSignature"}}``; the EK PEM is an optional CERTIFICATE
  block followed by a mandatory PUBLIC KEY block (SubjectPublicKeyInfo DER);
* challenge ``{"EC":{"Credential","Secret"}}``, both with their TPM2B size prefix;
* response ``{"Secret"}`` (the 32-byte certInfo from TPM2_ActivateCredential).

Decoders raise :class:`PayloadError` for anything malformed and nothing else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from protocol.credential import Credential
from protocol.errors import PayloadError

ATTESTOR_TYPE = "tpm"
_PEM_LABEL_RE = re.compile(rb"[A-Z0-9 ]{1,64}")
# An EK PEM is a certificate (a few KB) and a public key; a challenge and its answer are smaller.
MAX_EK_PEM_BYTES = 32 * 1024
MAX_JSON_BYTES = 256 * 1024
_MAX_PEM_BLOCKS = 2

EkPublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


@dataclass(frozen=True)
class AttestationParameters:
    """The AK half of the payload (go-attestation ``AttestationParameters``)."""

    public: bytes  # TPMT_PUBLIC
    create_data: bytes  # TPMS_CREATION_DATA
    create_attestation: bytes  # TPMS_ATTEST
    create_signature: bytes  # TPMT_SIGNATURE
    use_tcsd_activation_format: bool = False


@dataclass(frozen=True)
class EkData:
    """The decoded EK PEM: the public key (always) and the certificate DER (when sent)."""

    public_key_der: bytes  # SubjectPublicKeyInfo DER
    certificate_der: bytes | None = None

    def public_key(self) -> EkPublicKey:
        try:
            key = serialization.load_der_public_key(self.public_key_der)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise PayloadError(f"EK PUBLIC KEY block is not a valid SubjectPublicKeyInfo: {exc}") from exc
        if not isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey):
            raise PayloadError(f"EK public key type {type(key).__name__} is neither RSA nor ECC")
        return key

    @property
    def pub_hash(self) -> str:
        return pub_hash(self.public_key_der)


@dataclass(frozen=True)
class AttestationData:
    ek: EkData
    ak: AttestationParameters


def pub_hash(spki_der: bytes) -> str:
    """Lowercase hex SHA-256 of the EK SubjectPublicKeyInfo DER (the agent ID suffix)."""
    return hashlib.sha256(spki_der).hexdigest()


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64d(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise PayloadError(f"{field}: expected a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise PayloadError(f"{field}: invalid base64 ({exc})") from exc


def _pem(kind: str, der: bytes) -> bytes:
    body = base64.encodebytes(der).replace(b"\n", b"")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return (
        b"-----BEGIN "
        + kind.encode()
        + b"-----\n"
        + b"\n".join(lines)
        + b"\n-----END "
        + kind.encode()
        + b"-----\n"
    )


def encode_ek(ek: EkData) -> bytes:
    """PEM text: the CERTIFICATE block (if any) followed by the PUBLIC KEY block."""
    out = b""
    if ek.certificate_der is not None:
        out += _pem("CERTIFICATE", ek.certificate_der)
    return out + _pem("PUBLIC KEY", ek.public_key_der)


def _pem_blocks(pem: bytes) -> list[tuple[str, bytes]]:
    """(label, base64 body) of each PEM block, in one pass over the lines (linear time).

    Text outside blocks is ignored, as PEM readers do. A BEGIN line inside a block, an END
    line that does not match its BEGIN, or a block never ended is malformed.
    """
    blocks: list[tuple[str, bytes]] = []
    label: bytes | None = None
    body: list[bytes] = []
    for raw_line in pem.split(b"\n"):
        line = raw_line.rstrip(b"\r").strip(b" \t")
        if line.startswith(b"-----BEGIN ") and line.endswith(b"-----"):
            if label is not None:
                raise PayloadError("EK: a PEM BEGIN line inside another block")
            candidate = line[len(b"-----BEGIN ") : -5]
            if not _PEM_LABEL_RE.fullmatch(candidate):
                raise PayloadError("EK: a PEM block with a malformed label")
            if len(blocks) >= _MAX_PEM_BLOCKS:
                raise PayloadError(
                    f"EK: more than {_MAX_PEM_BLOCKS} PEM blocks; expected a PUBLIC KEY and at most one CERTIFICATE"
                )
            label, body = candidate, []
        elif line.startswith(b"-----END ") and line.endswith(b"-----"):
            end = line[len(b"-----END ") : -5]
            if label is None:
                raise PayloadError("EK: a PEM END line outside a block")
            if end != label:
                raise PayloadError(
                    f"EK: PEM block BEGIN {label.decode()} ends with END {end[:64].decode('ascii', 'replace')}"
                )
            blocks.append((label.decode(), b"".join(body)))
            label = None
        elif label is not None:
            body.append(line)
    if label is not None:
        raise PayloadError(f"EK: PEM block {label.decode()} has no END line")
    return blocks


def decode_ek(pem: bytes) -> EkData:
    """Parse the EK PEM: one PUBLIC KEY block and at most one CERTIFICATE block, in either order."""
    if len(pem) > MAX_EK_PEM_BYTES:
        raise PayloadError(f"EK: {len(pem)} bytes of PEM exceeds the limit of {MAX_EK_PEM_BYTES}")
    blocks = _pem_blocks(pem)
    if not blocks:
        raise PayloadError("EK: no PEM block found")
    found: dict[str, bytes] = {}
    for kind, body in blocks:
        if kind not in ("CERTIFICATE", "PUBLIC KEY"):
            raise PayloadError(f"EK: unexpected PEM block type {kind!r}")
        if kind in found:
            raise PayloadError(f"EK: two {kind} blocks")
        try:
            found[kind] = base64.b64decode(b"".join(body.split()), validate=True)
        except binascii.Error as exc:
            raise PayloadError(f"EK: {kind} block is not valid base64") from exc
    if "PUBLIC KEY" not in found:
        raise PayloadError(
            "EK: the PUBLIC KEY block is missing (spire-tpm-plugin v1.9.0+ agents always send it); "
            "upgrade the agent"
        )
    ek = EkData(public_key_der=found["PUBLIC KEY"], certificate_der=found.get("CERTIFICATE"))
    ek.public_key()  # validate now, so later code can rely on it
    # The certificate is parsed (leniently) by the EK validation, not here.
    return ek


def encode_attestation_data(data: AttestationData) -> bytes:
    """Compact Go-style JSON for ``AttestationData.payload``."""
    doc = {
        "EK": _b64e(encode_ek(data.ek)),
        "AK": {
            "Public": _b64e(data.ak.public),
            "UseTCSDActivationFormat": data.ak.use_tcsd_activation_format,
            "CreateData": _b64e(data.ak.create_data),
            "CreateAttestation": _b64e(data.ak.create_attestation),
            "CreateSignature": _b64e(data.ak.create_signature),
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _load_object(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_JSON_BYTES:
        raise PayloadError(f"{what}: {len(raw)} bytes exceeds the limit of {MAX_JSON_BYTES}")
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise PayloadError(f"{what}: not valid JSON ({type(exc).__name__})") from exc
    except ValueError as exc:  # JSONDecodeError, and int() refusing more than 4300 digits
        raise PayloadError(f"{what}: not valid JSON ({str(exc)[:120]})") from exc
    if not isinstance(doc, dict):
        raise PayloadError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _field(doc: dict[str, Any], key: str, what: str) -> Any:
    if key not in doc or doc[key] is None:
        raise PayloadError(f"{what}: missing {key!r}")
    return doc[key]


def decode_attestation_data(raw: bytes) -> AttestationData:
    """Parse ``AttestationData.payload``."""
    doc = _load_object(raw, "payload")
    ek = decode_ek(_b64d(_field(doc, "EK", "payload"), "EK"))
    ak_doc = _field(doc, "AK", "payload")
    if not isinstance(ak_doc, dict):
        raise PayloadError("payload: 'AK' must be an object")
    tcsd = ak_doc.get("UseTCSDActivationFormat", False)
    if not isinstance(tcsd, bool):
        raise PayloadError("AK.UseTCSDActivationFormat must be a boolean")
    if tcsd:
        raise PayloadError("AK.UseTCSDActivationFormat is true: TPM 1.2 activation is not supported")
    ak = AttestationParameters(
        public=_b64d(_field(ak_doc, "Public", "AK"), "AK.Public"),
        create_data=_b64d(_field(ak_doc, "CreateData", "AK"), "AK.CreateData"),
        create_attestation=_b64d(_field(ak_doc, "CreateAttestation", "AK"), "AK.CreateAttestation"),
        create_signature=_b64d(_field(ak_doc, "CreateSignature", "AK"), "AK.CreateSignature"),
        use_tcsd_activation_format=tcsd,
    )
    return AttestationData(ek=ek, ak=ak)


def encode_challenge(credential: Credential) -> bytes:
    doc = {
        "EC": {
            "Credential": _b64e(credential.credential_blob),
            "Secret": _b64e(credential.encrypted_secret),
        }
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_challenge(raw: bytes) -> Credential:
    doc = _load_object(raw, "challenge")
    ec_doc = _field(doc, "EC", "challenge")
    if not isinstance(ec_doc, dict):
        raise PayloadError("challenge: 'EC' must be an object")
    return Credential(
        credential_blob=_b64d(_field(ec_doc, "Credential", "EC"), "EC.Credential"),
        encrypted_secret=_b64d(_field(ec_doc, "Secret", "EC"), "EC.Secret"),
    )


def encode_challenge_response(secret: bytes) -> bytes:
    return json.dumps({"Secret": _b64e(secret)}, separators=(",", ":")).encode()


def decode_challenge_response(raw: bytes) -> bytes:
    doc = _load_object(raw, "challenge response")
    return _b64d(_field(doc, "Secret", "challenge response"), "Secret")
