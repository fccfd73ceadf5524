"""A small test PKI for EK trust: CA hierarchies and EK certificates made with python-cryptography.

Everything is deterministic except key material; keys come from the session
``keys`` fixture (RSA key generation is slow, so each label is made once).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from protocol import der

UTC = dt.UTC
NOW = dt.datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
CA_FROM = dt.datetime(2020, 1, 1, tzinfo=UTC)
CA_UNTIL = dt.datetime(2040, 1, 1, tzinfo=UTC)
EK_FROM = dt.datetime(2021, 1, 1, tzinfo=UTC)
EK_UNTIL = dt.datetime(2035, 1, 1, tzinfo=UTC)

TCG_MANUFACTURER = x509.ObjectIdentifier("2.23.133.2.1")
TCG_MODEL = x509.ObjectIdentifier("2.23.133.2.2")
TCG_VERSION = x509.ObjectIdentifier("2.23.133.2.3")
TCG_EK_CERTIFICATE = x509.ObjectIdentifier("2.23.133.8.1")

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
SignHash = hashes.SHA256 | hashes.SHA384 | hashes.SHA512


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: PrivateKey

    @property
    def der(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.DER)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def spki(key: PrivateKey | rsa.RSAPublicKey | ec.EllipticCurvePublicKey) -> bytes:
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _sign(
    builder: x509.CertificateBuilder, key: PrivateKey, hash_alg: SignHash, pss: bool
) -> x509.Certificate:
    if pss:
        pss_padding = padding.PSS(mgf=padding.MGF1(hash_alg), salt_length=hash_alg.digest_size)
        return builder.sign(key, hash_alg, rsa_padding=pss_padding)
    return builder.sign(key, hash_alg)


def make_ca(
    name: str,
    key: PrivateKey,
    issuer: Issued | None = None,
    *,
    not_before: dt.datetime = CA_FROM,
    not_after: dt.datetime = CA_UNTIL,
    ca: bool = True,
    basic_constraints: bool = True,
    path_length: int | None = None,
    key_cert_sign: bool = True,
    hash_alg: SignHash | None = None,
    pss: bool = False,
    serial: int = 0x1000,
    extra: tuple[x509.ExtensionType, bool] | None = None,
) -> Issued:
    """A CA certificate: self-signed when ``issuer`` is None."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Test TPM Vendor"),
        ]
    )
    signer_key = key if issuer is None else issuer.key
    issuer_name = subject if issuer is None else issuer.cert.subject
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), critical=False
        )
    )
    if basic_constraints:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=path_length), critical=True)
    builder = builder.add_extension(
        x509.KeyUsage(
            digital_signature=False,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=key_cert_sign,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        ),
        critical=True,
    )
    if extra is not None:
        builder = builder.add_extension(extra[0], critical=extra[1])
    return Issued(_sign(builder, signer_key, hash_alg or hashes.SHA256(), pss), key)


def make_ek(
    issuer: Issued,
    key: PrivateKey,
    *,
    not_before: dt.datetime = EK_FROM,
    not_after: dt.datetime = EK_UNTIL,
    ca: bool = False,
    key_usage: str | None = "auto",  # "auto": keyEncipherment (RSA) / keyAgreement (ECC); None: absent
    hash_alg: SignHash | None = None,
    pss: bool = False,
    serial: int = 0x4E4B,
    extra: tuple[x509.ExtensionType, bool] | None = None,
    san: bool = True,
) -> Issued:
    """An EK certificate in the TCG profile: empty subject, critical TCG DirectoryName SAN, EK EKU."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(issuer.cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([TCG_EK_CERTIFICATE]), critical=False)
    )
    if san:
        tpm = x509.Name(
            [
                x509.RelativeDistinguishedName(
                    [
                        x509.NameAttribute(TCG_MANUFACTURER, "id:54455354"),
                        x509.NameAttribute(TCG_MODEL, "TESTTPM"),
                        x509.NameAttribute(TCG_VERSION, "id:00010002"),
                    ]
                )
            ]
        )
        san_ext = x509.SubjectAlternativeName([x509.DirectoryName(tpm)])
        builder = builder.add_extension(san_ext, critical=True)
    if key_usage is not None:
        rsa_key = isinstance(key, rsa.RSAPrivateKey)
        encipher = key_usage == "encipherment" or (key_usage == "auto" and rsa_key)
        agree = key_usage == "agreement" or (key_usage == "auto" and not rsa_key)
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=key_usage == "signature",
                content_commitment=False,
                key_encipherment=encipher,
                data_encipherment=False,
                key_agreement=agree,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if extra is not None:
        builder = builder.add_extension(extra[0], critical=extra[1])
    return Issued(_sign(builder, issuer.key, hash_alg or hashes.SHA256(), pss), key)


def tlv(tag: int, content: bytes) -> bytes:
    """DER encoding of one element."""
    n = len(content)
    if n < 0x80:
        return bytes([tag, n]) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + content


def resign_with_tbs_edit(cert: Issued, old: bytes, new: bytes, issuer_key: PrivateKey) -> bytes:
    """The certificate with ``old`` replaced by ``new`` (same length) inside the TBS, validly re-signed."""
    tbs = cert.cert.tbs_certificate_bytes
    assert len(old) == len(new) and tbs.count(old) == 1
    new_tbs = tbs.replace(old, new)
    return assemble(new_tbs, cert.der, issuer_key)


def assemble(tbs: bytes, template_der: bytes, issuer_key: PrivateKey) -> bytes:
    """A certificate from ``tbs``, signed by ``issuer_key``, with ``template_der``'s signature algorithm."""
    quirks: set[str] = set()
    outer = der.read_tlv(template_der, 0, len(template_der), quirks)
    parts = der.children(outer, quirks)
    sigalg = parts[1].raw
    if isinstance(issuer_key, rsa.RSAPrivateKey):
        signature = issuer_key.sign(tbs, padding.PKCS1v15(), hashes.SHA256())
    else:
        signature = issuer_key.sign(tbs, ec.ECDSA(hashes.SHA256()))
    return tlv(0x30, tbs + sigalg + tlv(0x03, b"\x00" + signature))
