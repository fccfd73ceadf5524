"""A software stand-in for a TPM's attestation keys: a test and benchmark double, not a TPM.

It holds an EK and an AK as ordinary private keys and produces exactly the
structures a TPM would (TPMT_PUBLIC, TPMS_CREATION_DATA, TPMS_ATTEST,
TPMT_SIGNATURE), and answers the credential challenge with the same maths as
TPM2_ActivateCredential. The server cannot tell it from a TPM by its messages,
so it does its full work; it is what the bad-input tests mutate and what the
benchmark's boot storm runs thousands of.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from dataclasses import dataclass, replace

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from protocol import tpm2
from protocol.credential import Credential, activate_credential
from protocol.tpm_payload import AttestationData, AttestationParameters, EkData

AK_ATTRS = 0x00050472
EK_ATTRS = 0x000300B2


@dataclass
class SimCa:
    """A small EK CA (root only) for issuing EK certificates to simulated TPMs."""

    key: rsa.RSAPrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "Simulated TPM EK CA") -> SimCa:
        key = rsa.generate_private_key(65537, 2048)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_ek_cert(self, public_key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey) -> bytes:
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
                    data_encipherment=False,
                    key_agreement=isinstance(public_key, ec.EllipticCurvePublicKey),
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DirectoryName(
                            x509.Name(
                                [
                                    x509.NameAttribute(x509.ObjectIdentifier("2.23.133.2.1"), "id:4E544300"),
                                    x509.NameAttribute(x509.ObjectIdentifier("2.23.133.2.2"), "SIM"),
                                    x509.NameAttribute(x509.ObjectIdentifier("2.23.133.2.3"), "id:00010000"),
                                ]
                            )
                        )
                    ]
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.DER)


def _rsa_public_area(key: rsa.RSAPublicKey, attrs: int, scheme: tpm2.Scheme, sym: tpm2.SymDef) -> bytes:
    n = key.public_numbers().n.to_bytes(key.key_size // 8, "big")
    return tpm2.encode_rsa_public(modulus=n, attributes=attrs, scheme=scheme, symmetric=sym)


@dataclass
class SimulatedTpm:
    """EK and AK in software. ``ek_alg`` is ``rsa`` or ``ecc``."""

    ek: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    ek_cert_der: bytes | None
    ak: rsa.RSAPrivateKey
    ak_attrs: int = AK_ATTRS

    @classmethod
    def create(
        cls,
        ca: SimCa | None,
        *,
        ek_alg: str = "rsa",
        ek_key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | None = None,
        ak_key: rsa.RSAPrivateKey | None = None,
    ) -> SimulatedTpm:
        ek = ek_key or (
            rsa.generate_private_key(65537, 2048)
            if ek_alg == "rsa"
            else ec.generate_private_key(ec.SECP256R1())
        )
        cert = ca.issue_ek_cert(ek.public_key()) if ca is not None else None
        ak = ak_key or rsa.generate_private_key(65537, 2048)
        return cls(ek, cert, ak)

    @property
    def ek_spki(self) -> bytes:
        return self.ek.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    @property
    def ek_hash(self) -> str:
        return hashlib.sha256(self.ek_spki).hexdigest()

    def ak_public(self) -> bytes:
        return _rsa_public_area(
            self.ak.public_key(),
            self.ak_attrs,
            tpm2.Scheme(tpm2.Alg.RSASSA, tpm2.Alg.SHA256),
            tpm2.SymDef(tpm2.Alg.NULL),
        )

    def ak_name(self) -> bytes:
        return tpm2.parse_public(self.ak_public()).name()

    def ak_parameters(
        self, *, sign_with: rsa.RSAPrivateKey | None = None, name: bytes | None = None
    ) -> AttestationParameters:
        public = self.ak_public()
        parent = b"\x00\x0b" + hashlib.sha256(b"simulated SRK").digest()
        create_data = tpm2.encode_creation_data(parent_name=parent, parent_qualified_name=parent)
        attest = tpm2.encode_creation_attest(
            qualified_signer=name or tpm2.parse_public(public).name(),
            object_name=name or tpm2.parse_public(public).name(),
            creation_hash=hashlib.sha256(create_data).digest(),
            clock=int.from_bytes(os.urandom(4), "big"),
        )
        signer = sign_with or self.ak
        sig = signer.sign(attest, padding.PKCS1v15(), hashes.SHA256())
        return AttestationParameters(
            public=public,
            create_data=create_data,
            create_attestation=attest,
            create_signature=tpm2.encode_rsa_signature(sig),
        )

    def attestation_data(self) -> AttestationData:
        return AttestationData(
            ek=EkData(public_key_der=self.ek_spki, certificate_der=self.ek_cert_der), ak=self.ak_parameters()
        )

    def activate(self, credential: Credential) -> bytes:
        return activate_credential(self.ek, self.ak_name(), credential)

    def quote(
        self,
        nonce: bytes,
        pcr_values: dict[int, bytes],
        *,
        bank: str = "sha256",
        sign_with: rsa.RSAPrivateKey | None = None,
        select: list[int] | None = None,
        pcr_digest: bytes | None = None,
    ) -> tuple[bytes, bytes]:
        """TPM2_Quote's (TPMS_ATTEST, TPMT_SIGNATURE) over ``pcr_values`` with this TPM's AK."""
        from protocol.quote import BANK_ALGS, selection_bitmap

        pcrs = sorted(pcr_values) if select is None else select
        digest = pcr_digest or hashlib.sha256(b"".join(pcr_values[i] for i in pcrs)).digest()
        attest = tpm2.encode_quote_attest(
            qualified_signer=self.ak_name(),
            extra_data=nonce,
            bank=BANK_ALGS[bank],
            select=selection_bitmap(pcrs),
            pcr_digest=digest,
            clock=int.from_bytes(os.urandom(4), "big"),
        )
        signer = sign_with or self.ak
        return attest, tpm2.encode_rsa_signature(signer.sign(attest, padding.PKCS1v15(), hashes.SHA256()))

    def with_ak_attrs(self, attrs: int) -> SimulatedTpm:
        return replace(self, ak_attrs=attrs)
