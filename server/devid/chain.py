"""DevID certificate chains: verification against the DevID trust anchors, and SPIRE's selectors.

spire-server verifies ``DevIDCert[0]`` with Go's ``x509.Verify`` against ``devid_ca_path`` (roots),
the rest of ``DevIDCert`` as intermediates, any extended key usage. Here the same is done with
``cryptography``'s path builder: CA certificates are held to the Web PKI CA profile (basic
constraints, key usage), the leaf only to being valid, signed and unexpired (a DevID carries no
DNS name or TLS usage). One verified path is used for the selectors; Go lists every path, which
differs only for cross-signed CAs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification
from cryptography.x509.oid import NameOID


class ChainError(Exception):
    """The chain does not verify; ``malformed`` when a certificate cannot even be parsed."""

    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


@dataclass(frozen=True)
class VerifiedChain:
    leaf: x509.Certificate
    leaf_der: bytes
    chain: tuple[x509.Certificate, ...]  # leaf first, trust anchor last


def fingerprint(der: bytes) -> str:
    """SPIRE's certificate fingerprint: hex SHA-1 of the DER (``openssl x509 -outform der | sha1sum``)."""
    return hashlib.sha1(der, usedforsecurity=False).hexdigest()


def load_roots(pems: Sequence[bytes]) -> list[x509.Certificate]:
    roots: list[x509.Certificate] = []
    for pem in pems:
        roots.extend(x509.load_pem_x509_certificates(pem))
    return roots


def parse_chain(ders: Sequence[bytes]) -> list[x509.Certificate]:
    certs = []
    for i, der in enumerate(ders):
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except ValueError as exc:
            what = "the DevID certificate" if i == 0 else f"DevID intermediate certificate {i}"
            raise ChainError(f"unable to parse {what}: {exc}", malformed=True) from exc
    return certs


def verify_chain(
    ders: Sequence[bytes], roots: Sequence[x509.Certificate], now: dt.datetime | None = None
) -> VerifiedChain:
    """Verify ``ders`` (leaf first) to one of ``roots``; :class:`ChainError` says why not."""
    certs = parse_chain(ders)
    if not roots:
        raise ChainError("this server trusts no DevID CA")
    when = now or dt.datetime.now(dt.UTC)
    builder = (
        verification.PolicyBuilder()
        .store(verification.Store(list(roots)))
        .time(when)
        .max_chain_depth(8)
        .extension_policies(
            ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
            ee_policy=verification.ExtensionPolicy.permit_all(),
        )
    )
    try:
        verified = builder.build_client_verifier().verify(certs[0], certs[1:])
    except verification.VerificationError as exc:
        raise ChainError(f"unable to verify DevID signature: {exc}") from exc
    except ValueError as exc:  # an unsupported key or signature algorithm somewhere in the chain
        raise ChainError(f"unable to verify DevID signature: {exc}") from exc
    chain = tuple(verified.chain)
    return VerifiedChain(certs[0], ders[0], chain)


def _common_name(name: x509.Name) -> str:
    """Go's ``pkix.Name.CommonName``: the last CN attribute (empty when there is none)."""
    values = [a.value for a in name.get_attributes_for_oid(NameOID.COMMON_NAME)]
    last = values[-1] if values else ""
    return last if isinstance(last, str) else last.decode("utf-8", "replace")


def selector_values(chain: VerifiedChain) -> tuple[str, ...]:
    """spire-server's tpm_devid selector values, in its order (``buildSelectorValues``)."""
    values = []
    subject, issuer = _common_name(chain.leaf.subject), _common_name(chain.leaf.issuer)
    if subject:
        values.append(f"subject:cn:{subject}")
    if issuer:
        values.append(f"issuer:cn:{issuer}")
    seen: set[str] = set()
    for cert in chain.chain[1:]:
        fp = fingerprint(cert.public_bytes(serialization.Encoding.DER))
        if fp not in seen:
            seen.add(fp)
            values.append(f"ca:fingerprint:{fp}")
    return tuple(values)
