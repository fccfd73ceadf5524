"""SPIRE's built-in ``tpm_devid`` node attestor on the wire, as spire-agent/spire-server v1.13.3 write it.

The three bodies are Go ``encoding/json`` output of the structs of SPIRE's
``pkg/common/plugin/tpmdevid``: keys are the Go field names verbatim, ``[]byte`` is
standard base64 with padding, ``[][]byte`` a JSON array of such strings.

* payload (agent -> server) ``AttestationRequest``: ``DevIDCert`` (DER chain, leaf
  first), ``DevIDPub`` (DevID TPMT_PUBLIC), ``EKCert`` (EK certificate DER),
  ``EKPub`` (EK TPMT_PUBLIC), ``AKPub`` (AK TPMT_PUBLIC), ``CertifiedDevID``
  (TPMS_ATTEST of TPM2_Certify of the DevID by the AK), ``CertificationSignature``
  (its TPMT_SIGNATURE);
* challenge (server -> agent) ``ChallengeRequest``: ``DevID`` (a nonce for the
  DevID key to sign), ``CredActivation`` ``{Credential, Secret}``: TPM2_ActivateCredential's
  blobs **without** their TPM2B size prefixes;
* response (agent -> server) ``ChallengeResponse``: ``DevID`` (the signature over the
  nonce: PKCS#1 v1.5 bytes, or a DER ECDSA-Sig-Value), ``CredActivation`` (certInfo).

Go's decoder is lax (keys case-insensitive, unknown keys ignored). These decoders are
strict, which the real spire-agent passes: exact keys, none unknown, none missing, every
byte string valid base64. They raise :class:`PayloadError` naming the field, and nothing
else. The TPM structures and certificates inside are parsed by the attestor.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from protocol.errors import PayloadError

ATTESTOR_TYPE = "tpm_devid"
MAX_JSON_BYTES = 256 * 1024
MAX_CHAIN_CERTS = 8
MAX_FIELD_BYTES = 16 * 1024

_REQUEST_KEYS = (
    "DevIDCert",
    "DevIDPub",
    "EKCert",
    "EKPub",
    "AKPub",
    "CertifiedDevID",
    "CertificationSignature",
)


@dataclass(frozen=True)
class AttestationRequest:
    devid_cert: tuple[bytes, ...]  # DER, leaf first
    devid_pub: bytes  # TPMT_PUBLIC
    ek_cert: bytes  # DER
    ek_pub: bytes  # TPMT_PUBLIC
    ak_pub: bytes  # TPMT_PUBLIC
    certified_devid: bytes  # TPMS_ATTEST
    certification_signature: bytes  # TPMT_SIGNATURE


@dataclass(frozen=True)
class ChallengeRequest:
    nonce: bytes  # "DevID": what the DevID key signs
    credential: bytes  # TPM2B_ID_OBJECT contents (no size prefix)
    secret: bytes  # TPM2B_ENCRYPTED_SECRET contents (no size prefix)


@dataclass(frozen=True)
class ChallengeResponse:
    signature: bytes  # "DevID": the DevID key's signature over the nonce
    cert_info: bytes  # "CredActivation": TPM2_ActivateCredential's output


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64d(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise PayloadError(f"{field}: expected a base64 string, got {_kind(value)}")
    if len(value) > MAX_FIELD_BYTES * 4 // 3 + 4:
        raise PayloadError(f"{field}: longer than {MAX_FIELD_BYTES} bytes")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise PayloadError(f"{field}: invalid base64 ({exc})") from exc
    if not raw:
        raise PayloadError(f"{field}: empty")
    return raw


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load(raw: bytes, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if len(raw) > MAX_JSON_BYTES:
        raise PayloadError(f"{what}: {len(raw)} bytes exceeds the limit of {MAX_JSON_BYTES}")
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise PayloadError(f"{what}: not valid JSON ({type(exc).__name__})") from exc
    except ValueError as exc:  # JSONDecodeError, and int() refusing more than 4300 digits
        raise PayloadError(f"{what}: not valid JSON ({str(exc)[:120]})") from exc
    if not isinstance(doc, dict):
        raise PayloadError(f"{what}: expected a JSON object, got {_kind(doc)}")
    unknown = sorted(set(doc) - set(keys))
    if unknown:
        raise PayloadError(f"{what}: unknown key {unknown[0][:64]!r} (expected {', '.join(keys)})")
    for key in keys:
        if doc.get(key) is None:
            raise PayloadError(f"{what}: missing {key!r}")
    return doc


def encode_attestation_request(req: AttestationRequest) -> bytes:
    doc = {
        "DevIDCert": [_b64e(c) for c in req.devid_cert],
        "DevIDPub": _b64e(req.devid_pub),
        "EKCert": _b64e(req.ek_cert),
        "EKPub": _b64e(req.ek_pub),
        "AKPub": _b64e(req.ak_pub),
        "CertifiedDevID": _b64e(req.certified_devid),
        "CertificationSignature": _b64e(req.certification_signature),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_attestation_request(raw: bytes) -> AttestationRequest:
    doc = _load(raw, "payload", _REQUEST_KEYS)
    chain = doc["DevIDCert"]
    if not isinstance(chain, list):
        raise PayloadError(f"DevIDCert: expected a list of base64 strings, got {_kind(chain)}")
    if not chain:
        raise PayloadError("DevIDCert: no DevID certificate to attest")
    if len(chain) > MAX_CHAIN_CERTS:
        raise PayloadError(f"DevIDCert: {len(chain)} certificates; at most {MAX_CHAIN_CERTS}")
    return AttestationRequest(
        devid_cert=tuple(_b64d(c, f"DevIDCert[{i}]") for i, c in enumerate(chain)),
        devid_pub=_b64d(doc["DevIDPub"], "DevIDPub"),
        ek_cert=_b64d(doc["EKCert"], "EKCert"),
        ek_pub=_b64d(doc["EKPub"], "EKPub"),
        ak_pub=_b64d(doc["AKPub"], "AKPub"),
        certified_devid=_b64d(doc["CertifiedDevID"], "CertifiedDevID"),
        certification_signature=_b64d(doc["CertificationSignature"], "CertificationSignature"),
    )


def encode_challenge(ch: ChallengeRequest) -> bytes:
    doc = {
        "DevID": _b64e(ch.nonce),
        "CredActivation": {"Credential": _b64e(ch.credential), "Secret": _b64e(ch.secret)},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_challenge(raw: bytes) -> ChallengeRequest:
    doc = _load(raw, "challenge", ("DevID", "CredActivation"))
    cred = doc["CredActivation"]
    if not isinstance(cred, dict):
        raise PayloadError(f"CredActivation: expected an object, got {_kind(cred)}")
    keys = ("Credential", "Secret")
    unknown = sorted(set(cred) - set(keys))
    if unknown:
        raise PayloadError(f"CredActivation: unknown key {unknown[0][:64]!r}")
    return ChallengeRequest(
        nonce=_b64d(doc["DevID"], "DevID"),
        credential=_b64d(cred.get("Credential"), "CredActivation.Credential"),
        secret=_b64d(cred.get("Secret"), "CredActivation.Secret"),
    )


def encode_challenge_response(resp: ChallengeResponse) -> bytes:
    doc = {"DevID": _b64e(resp.signature), "CredActivation": _b64e(resp.cert_info)}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_challenge_response(raw: bytes) -> ChallengeResponse:
    doc = _load(raw, "challenge response", ("DevID", "CredActivation"))
    return ChallengeResponse(
        signature=_b64d(doc["DevID"], "DevID"),
        cert_info=_b64d(doc["CredActivation"], "CredActivation"),
    )
