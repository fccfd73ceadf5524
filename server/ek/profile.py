"""EK certificate profile checks.

Two tiers:

* :func:`security_problem`: always enforced. The EK certificate must not be a
  CA, its keyUsage (when present) must allow the EK's real use (keyEncipherment
  for RSA; keyAgreement or keyEncipherment for ECC, as real Intel PTT ECC EK
  certificates say keyEncipherment only), and it must not carry a critical extension we
  do not understand. The critical TCG DirectoryName SAN is understood.
* :func:`tcg_profile_issues`: the rest of the TCG EK Credential Profile as
  go-attestation's ``ToEKCertificate`` (spire-tpm-plugin v1.10) enforces it.
  Real certificates deviate (Google's CAS-issued EK certificates have no SAN),
  so the server only warns by default (``tcg_profile: warn``).
"""

from __future__ import annotations

from protocol import der
from protocol.der import DerError
from server.ek.certificate import (
    EXT_AIA,
    EXT_AKI,
    EXT_BASIC_CONSTRAINTS,
    EXT_CERT_POLICIES,
    EXT_CRL_DP,
    EXT_EKU,
    EXT_KEY_USAGE,
    EXT_SAN,
    EXT_SKI,
    KU_KEY_AGREEMENT,
    KU_KEY_ENCIPHERMENT,
    Q_NEGATIVE_SERIAL,
    Certificate,
)
from server.ek.store import ChainPolicy, critical_unknown

# An ECC EK decrypts credentials by key agreement (ECDH). The TCG EK profile asks for keyAgreement;
# Intel PTT (and other firmware TPMs) mark their ECC EK certificates keyEncipherment only. Both say
# "this key receives secrets"; a signing-only keyUsage (digitalSignature, keyCertSign) is refused.
ECC_EK_KEY_USAGES = frozenset({KU_KEY_AGREEMENT, KU_KEY_ENCIPHERMENT})

_MUST_NOT_BE_CRITICAL = {
    EXT_AKI: "authorityKeyIdentifier",
    EXT_AIA: "authorityInfoAccess",
    EXT_CRL_DP: "cRLDistributionPoints",
    EXT_EKU: "extendedKeyUsage",
    EXT_SKI: "subjectKeyIdentifier",
}


def security_problem(cert: Certificate, policy: ChainPolicy) -> str | None:
    """Why this certificate can never be an EK certificate, or None."""
    if cert.is_ca:
        return "the EK certificate is a CA certificate (basicConstraints cA is true)"
    if cert.key_usage is not None:
        if cert.public_key.kind == "rsa" and KU_KEY_ENCIPHERMENT not in cert.key_usage:
            return "the EK certificate's keyUsage does not allow keyEncipherment, which an RSA EK needs"
        if cert.public_key.kind == "ec" and not cert.key_usage & ECC_EK_KEY_USAGES:
            return (
                "the EK certificate's keyUsage allows neither keyAgreement nor keyEncipherment, "
                "one of which an ECC EK needs"
            )
    unknown = critical_unknown(cert, policy)
    if unknown:
        return (
            f"the EK certificate has unsupported critical extensions {', '.join(unknown)} "
            "(list them in ignore_critical_extensions to accept them)"
        )
    return None


def tcg_profile_issues(cert: Certificate) -> tuple[str, ...]:
    """Deviations from the TCG EK certificate profile (go-attestation ``ToEKCertificate`` rules)."""
    issues: list[str] = []
    ext = cert.extensions
    if cert.version != 3:
        issues.append(f"version is {cert.version}, not 3")
    if cert.serial <= 0:
        issues.append(
            "serial number is negative" if Q_NEGATIVE_SERIAL in cert.quirks else "serial number is zero"
        )
    if cert.issuer.empty:
        issues.append("issuer is empty")
    if cert.basic_constraints is None:
        issues.append("basicConstraints is missing")
    elif not ext[EXT_BASIC_CONSTRAINTS].critical:
        issues.append("basicConstraints is not critical")
    if cert.key_usage is None:
        issues.append("keyUsage is missing")
    elif not ext[EXT_KEY_USAGE].critical:
        issues.append("keyUsage is not critical")
    if cert.san is None:
        issues.append("subjectAltName (TPM manufacturer/model/version) is missing")
    else:
        if not cert.san.tcg_only:
            issues.append("subjectAltName is not exactly one TCG DirectoryName")
        if cert.subject.empty and not ext[EXT_SAN].critical:
            issues.append("subjectAltName is not critical although the subject is empty")
    if cert.authority_key_id is None:
        issues.append("authorityKeyIdentifier (with a key identifier) is missing")
    for oid, name in _MUST_NOT_BE_CRITICAL.items():
        if oid in ext and ext[oid].critical:
            issues.append(f"{name} is critical")
    if EXT_CERT_POLICIES in ext and _empty_sequence(ext[EXT_CERT_POLICIES].value):
        issues.append("certificatePolicies is empty")
    return tuple(issues)


def _empty_sequence(value: bytes) -> bool:
    try:
        tlv = der.read_tlv(value, 0, len(value), set())
    except DerError:
        return True
    return tlv.tag != der.SEQUENCE or tlv.end == tlv.vstart
