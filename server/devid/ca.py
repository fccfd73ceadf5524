"""nodeserver's DevID CA: it issues LDevID certificates after an EK proof (server.devid.enrol_service).

The CA is an ECDSA P-256 key and a self-signed certificate in ``data_dir`` (``devid-ca.key`` 0600,
``devid-ca.pem``), created at first start and loaded afterwards; it is a different key from the
trust domain's CA, so a DevID can never pass for an SVID and the other way round. Export
``devid-ca.pem`` as spire-server's ``devid_ca_path`` (``nodeserver devid-ca``).

Issuance policy (docs/attestation.md, "DevID enrolment"): one certificate per enrolment, for a
TPM-resident key the server has just seen certified by an AK proven to share a TPM with a trusted EK;
subject ``CN=<EK hash>, OU=ldevid, O=nodetrust``; ``CA:FALSE``, ``digitalSignature`` only; no
SPIFFE ID or DNS name; ``certificate_ttl`` long, capped by the CA's own validity.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from protocol.files import write_atomic
from server.ca import prepare_data_dir
from server.errors import ConfigError

log = logging.getLogger(__name__)

CA_KEY = "devid-ca.key"
CA_CERT = "devid-ca.pem"
_OU = "ldevid"


@dataclass(frozen=True)
class IssuedDevid:
    cert: x509.Certificate
    chain_der: tuple[bytes, ...]  # the leaf (the CA is a root: no intermediates)
    serial: int
    not_after: dt.datetime


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_usage(*, sign: bool, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


class DevidCa:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())

    @classmethod
    def load_or_create(cls, data_dir: Path, trust_domain: str, *, ttl: dt.timedelta) -> DevidCa:
        prepare_data_dir(data_dir)
        key_path, cert_path = data_dir / CA_KEY, data_dir / CA_CERT
        if key_path.exists() and cert_path.exists():
            mode = key_path.stat().st_mode & 0o777
            if mode & 0o077:
                raise ConfigError(
                    f"{key_path} is readable by others (mode {mode:o}); run: chmod 600 {key_path}"
                )
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.public_key() != key.public_key():
                raise ConfigError(
                    f"{cert_path} does not match {key_path}; restore both from the same backup"
                )
            if cert.not_valid_after_utc <= _now():
                raise ConfigError(f"the DevID CA {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
            return cls(key, cert)
        if key_path.exists() or cert_path.exists():
            raise ConfigError(
                f"{data_dir} holds only one of {CA_KEY} and {CA_CERT}; restore both or remove both"
            )
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodetrust"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"{trust_domain} DevID CA"),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + ttl)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(sign=False, ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomic(key_path, pem)  # 0600
        write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        log.warning("created a new DevID CA for %s in %s", trust_domain, data_dir)
        return cls(key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey, ek_hash: str, ttl: dt.timedelta
    ) -> IssuedDevid:
        """An LDevID for ``public_key`` (checked by the caller to be TPM-resident), named by the EK hash."""
        now = _now()
        not_after = min(now + ttl, self.cert.not_valid_after_utc)
        serial = x509.random_serial_number()
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodetrust"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, _OU),
                x509.NameAttribute(NameOID.COMMON_NAME, ek_hash),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(serial)
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(sign=True, ca=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        leaf = cert.public_bytes(serialization.Encoding.DER)
        return IssuedDevid(cert=cert, chain_der=(leaf,), serial=serial, not_after=not_after)
