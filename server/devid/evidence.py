"""The TPM checks behind a DevID: shared by the ``tpm_devid`` attestor and the DevID enrolment.

Both prove the same three things about a TPM-resident signing key (TCG "TPM 2.0 Keys for Device
Identity and Attestation"): the key is a fixedTPM signing key certified (TPM2_Certify) by an AK;
the AK is a restricted, fixedTPM signing key; the AK lives in the same TPM as an EK the server
trusts (credential activation with the EK, answered later). spire-server checks the signature and
the certified name only; these checks are stricter where that does not break the real spire-agent
(its AK is restricted, its qualifyingData empty): AK and DevID attributes, the attestation's type,
magic and extraData. Every refusal names a reason of :mod:`protocol.reasons`.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from protocol import tpm2
from protocol.credential import make_credential
from protocol.errors import ProtocolError
from protocol.quote import SignatureError, verify_tpm_signature
from server.errors import AttestationDeniedError, InvalidRequestError

NONCE_BYTES = 32
_A = tpm2.ObjectAttr
AK_REQUIRED = _A.FIXED_TPM | _A.FIXED_PARENT | _A.SENSITIVE_DATA_ORIGIN | _A.RESTRICTED | _A.SIGN_ENCRYPT
DEVID_REQUIRED = _A.FIXED_TPM | _A.FIXED_PARENT | _A.SENSITIVE_DATA_ORIGIN | _A.SIGN_ENCRYPT
_DEVID_SCHEMES = {tpm2.Alg.RSA: tpm2.Alg.RSASSA, tpm2.Alg.ECC: tpm2.Alg.ECDSA}
_DEVID_CURVES = {tpm2.EccCurve.NIST_P256, tpm2.EccCurve.NIST_P384}

DevidKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


@dataclass(frozen=True)
class Residency:
    """A credential-activation challenge and the nonce it wraps (kept in memory only)."""

    credential: bytes  # TPM2B_ID_OBJECT contents
    secret: bytes  # TPM2B_ENCRYPTED_SECRET contents
    nonce: bytes

    def __repr__(self) -> str:  # never print the nonce
        return "Residency(...)"


def _missing(pub: tpm2.Public, required: tpm2.ObjectAttr) -> list[str]:
    bits = int(required) & ~int(pub.attributes)
    if not bits:  # the usual case, without iterating the flag type (slow in Python)
        return []
    return [str(a.name).lower() for a in tpm2.ObjectAttr if a & bits]


def parse_ek_public(raw: bytes) -> tpm2.Public:
    """EKPub: an RSA TPMT_PUBLIC with AES-128 (what credential activation here supports)."""
    try:
        pub = tpm2.parse_public(raw)
        tpm2.public_key(pub)
    except ProtocolError as exc:
        raise InvalidRequestError(
            f"cannot decode endorsement key public blob: {exc}", reason="ek_public_malformed"
        ) from exc
    if pub.type != tpm2.Alg.RSA:
        raise AttestationDeniedError(
            f"the EK is {pub.type.name}; credential activation needs an RSA EK", reason="ek_unsupported"
        )
    if pub.symmetric.algorithm != tpm2.Alg.AES or pub.symmetric.key_bits != 128:
        raise AttestationDeniedError("the EK's symmetric algorithm is not AES-128", reason="ek_unsupported")
    return pub


def ek_spki(pub: tpm2.Public) -> bytes:
    return tpm2.spki_der(pub)


def parse_ak(raw: bytes) -> tpm2.Public:
    try:
        pub = tpm2.parse_public(raw)
        tpm2.public_key(pub)
    except ProtocolError as exc:
        raise InvalidRequestError(
            f"cannot decode attestation key public blob: {exc}", reason="ak_malformed"
        ) from exc
    return pub


def check_ak(pub: tpm2.Public) -> None:
    """A restricted, fixedTPM, TPM-generated RSA-2048+ signing key (spire-server checks none of this)."""
    if pub.type != tpm2.Alg.RSA:
        raise AttestationDeniedError(
            f"the AK is {pub.type.name}; an RSA AK is required", reason="ak_weak_key"
        )
    if pub.rsa_key_bits < 2048:
        raise AttestationDeniedError(
            f"the AK is RSA-{pub.rsa_key_bits}; at least 2048 bits", reason="ak_weak_key"
        )
    missing = _missing(pub, AK_REQUIRED)
    if missing or pub.has(_A.DECRYPT):
        why = f"lacks {', '.join(missing)}" if missing else "can also decrypt"
        raise AttestationDeniedError(
            f"the AK {why}: it must be a restricted signing key", reason="ak_attributes"
        )
    if pub.scheme.scheme != tpm2.Alg.RSASSA:
        raise AttestationDeniedError(
            f"the AK's scheme is {pub.scheme.scheme.name}, not RSASSA", reason="ak_attributes"
        )


def parse_devid_key(raw: bytes) -> tpm2.Public:
    try:
        pub = tpm2.parse_public(raw)
        tpm2.public_key(pub)
    except ProtocolError as exc:
        raise InvalidRequestError(
            f"cannot decode DevID key public blob: {exc}", reason="devid_key_malformed"
        ) from exc
    if pub.type not in _DEVID_SCHEMES:
        raise InvalidRequestError(
            f"the DevID key is {pub.type.name}, not RSA or ECC", reason="devid_key_malformed"
        )
    return pub


def check_devid_key(pub: tpm2.Public) -> None:
    """A fixedTPM, TPM-generated signing key whose scheme signs SHA-256 (what SPIRE verifies)."""
    missing = _missing(pub, DEVID_REQUIRED)
    if missing:
        raise AttestationDeniedError(
            f"the DevID key lacks {', '.join(missing)}: it could exist outside a TPM",
            reason="devid_key_attributes",
        )
    if pub.has(_A.DECRYPT):
        raise AttestationDeniedError("the DevID key can also decrypt", reason="devid_key_attributes")
    if pub.scheme.scheme != _DEVID_SCHEMES[pub.type] or pub.scheme.hash_alg != tpm2.Alg.SHA256:
        raise AttestationDeniedError(
            f"the DevID key's scheme is {pub.scheme.scheme.name} with hash 0x{pub.scheme.hash_alg:04x}; "
            f"{_DEVID_SCHEMES[pub.type].name} with SHA-256 is required",
            reason="devid_key_attributes",
        )
    if pub.type == tpm2.Alg.RSA and pub.rsa_key_bits < 2048:
        raise AttestationDeniedError(
            f"the DevID key is RSA-{pub.rsa_key_bits}", reason="devid_key_attributes"
        )
    if pub.type == tpm2.Alg.ECC and pub.ecc_curve not in _DEVID_CURVES:
        raise AttestationDeniedError(
            "the DevID key's curve is not P-256 or P-384", reason="devid_key_attributes"
        )


def devid_public_key(pub: tpm2.Public) -> DevidKey:
    key = tpm2.public_key(pub)
    if not isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey):  # pragma: no cover - types above
        raise InvalidRequestError("the DevID key is not RSA or ECC", reason="devid_key_malformed")
    return key


def spki_of(key: DevidKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def cert_spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@dataclass(frozen=True)
class Certification:
    attest: tpm2.Attest
    signature: tpm2.Signature


def parse_certification(attest_raw: bytes, signature_raw: bytes) -> Certification:
    try:
        return Certification(tpm2.parse_attest(attest_raw), tpm2.parse_signature(signature_raw))
    except ProtocolError as exc:
        raise InvalidRequestError(
            f"the DevID certification is malformed: {exc}", reason="certify_malformed"
        ) from exc


def check_certification(ak: tpm2.Public, devid: tpm2.Public, cert: Certification) -> None:
    """TPM2_Certify(object = DevID, signHandle = AK): TPM-generated, unqualified, signed by the AK, about the DevID."""
    att = cert.attest
    if att.magic != tpm2.TPM_GENERATED_VALUE:
        raise AttestationDeniedError(
            "the DevID certification was not generated by a TPM (bad magic)", reason="certify_invalid"
        )
    if att.type != tpm2.TPM_ST_ATTEST_CERTIFY:
        raise AttestationDeniedError(
            f"the DevID certification is of type 0x{att.type:04x}, not TPM2_Certify",
            reason="certify_invalid",
        )
    if att.extra_data:
        raise AttestationDeniedError(
            "the DevID certification carries qualifying data; spire-agent certifies with none",
            reason="certify_invalid",
        )
    try:
        verify_tpm_signature(ak, cert.signature, att.raw)
    except SignatureError as exc:
        raise AttestationDeniedError(f"the DevID certification: {exc}", reason="certify_signature") from exc
    if not hmac.compare_digest(att.object_name, devid.name()):
        raise AttestationDeniedError(
            "the certification names another object than the DevID key", reason="certify_name_mismatch"
        )


def residency_challenge(ak: tpm2.Public, ek: tpm2.Public) -> Residency:
    """The credential that only the TPM holding both the EK and the AK (by Name) can open."""
    nonce = os.urandom(NONCE_BYTES)
    try:
        cred = make_credential(tpm2.public_key(ek), ak.name(), nonce)
        return Residency(
            credential=tpm2.strip_tpm2b(cred.credential_blob, "TPM2B_ID_OBJECT"),
            secret=tpm2.strip_tpm2b(cred.encrypted_secret, "TPM2B_ENCRYPTED_SECRET"),
            nonce=nonce,
        )
    except ProtocolError as exc:
        raise AttestationDeniedError(
            f"cannot build a credential for this EK: {exc}", reason="ek_unsupported"
        ) from exc


def check_activation(residency: Residency, answer: bytes) -> None:
    if not hmac.compare_digest(answer, residency.nonce):
        raise AttestationDeniedError(
            "credential activation failed: the AK is not in the TPM of the EK", reason="wrong_secret"
        )


def verify_possession(key: DevidKey, nonce: bytes, signature: bytes) -> None:
    """The DevID key's signature over ``nonce``: PKCS#1 v1.5 or DER ECDSA, SHA-256 (SPIRE's check)."""
    try:
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, nonce, padding.PKCS1v15(), hashes.SHA256())
        else:
            key.verify(signature, nonce, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError) as exc:
        raise AttestationDeniedError(
            "the DevID key's signature over the server's nonce does not verify", reason="devid_signature"
        ) from exc
