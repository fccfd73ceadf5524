"""A software stand-in for a TPM with a DevID key, for the ``tpm_devid`` bad-input tests: not a TPM.

It holds the EK, the AK and the DevID key as ordinary private keys and produces exactly the
structures spire-agent sends (TPMT_PUBLIC with SPIRE's templates, TPMS_ATTEST of TPM2_Certify,
TPMT_SIGNATURE) and answers the challenge like TPM2_ActivateCredential and TPM2_Sign. Each field can
be replaced, so the tests can send one malformed or dishonest field at a time. :class:`DevidPki`
is a small DevID CA (root, optionally an intermediate) issuing the DevID certificate.
"""

from __future__ import annotations

import datetime as dt
import os
import struct
from dataclasses import dataclass, replace
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from protocol import tpm2
from protocol.credential import Credential, activate_credential
from protocol.tpm_devid import AttestationRequest, ChallengeRequest, ChallengeResponse
from tests.support.simtpm import SimCa

EK_ATTRS = 0x000300B2
AK_ATTRS = 0x00050072
DEVID_ATTRS = 0x00040072
_EK_POLICY = bytes.fromhex("837197674484B3F81A90CC8D46A5D724FD52D76E06520B64F2A1DA1B331469AA")
_NOW = dt.datetime.now(dt.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ku(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(not ca, False, False, False, False, ca, ca, False, False)


@dataclass
class DevidPki:
    """A DevID root (and an intermediate unless ``flat``) that issues DevID leaf certificates."""

    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    issuer_key: ec.EllipticCurvePrivateKey
    issuer: x509.Certificate

    @classmethod
    def create(cls, name: str = "Test DevID", *, flat: bool = False) -> DevidPki:
        rk = ec.generate_private_key(ec.SECP256R1())
        root = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} Root CA"))
            .issuer_name(_name(f"{name} Root CA"))
            .public_key(rk.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - dt.timedelta(days=1))
            .not_valid_after(_NOW + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_ku(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(rk.public_key()), critical=False)
            .sign(rk, hashes.SHA256())
        )
        if flat:
            return cls(rk, root, rk, root)
        ik = ec.generate_private_key(ec.SECP256R1())
        issuer = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} Intermediate CA"))
            .issuer_name(root.subject)
            .public_key(ik.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - dt.timedelta(days=1))
            .not_valid_after(_NOW + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_ku(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ik.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(rk.public_key()), critical=False
            )
            .sign(rk, hashes.SHA256())
        )
        return cls(rk, root, ik, issuer)

    def root_pem(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.PEM)

    def chain(
        self, public_key: Any, cn: str = "devid-node-1", *, expired: bool = False
    ) -> tuple[bytes, ...]:
        start = _NOW - dt.timedelta(days=20 if expired else 1)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.issuer.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + dt.timedelta(days=10 if expired else 365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_ku(ca=False), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.issuer_key.public_key()),
                critical=False,
            )
            .sign(self.issuer_key, hashes.SHA256())
        )
        der = [leaf.public_bytes(serialization.Encoding.DER)]
        if self.issuer is not self.root:
            der.append(self.issuer.public_bytes(serialization.Encoding.DER))
        return tuple(der)


def _rsa_public(
    key: rsa.RSAPublicKey, attrs: int, scheme: tpm2.Scheme, sym: tpm2.SymDef, policy: bytes = b""
) -> bytes:
    n = key.public_numbers().n.to_bytes(key.key_size // 8, "big")
    return tpm2.encode_rsa_public(
        modulus=n, attributes=attrs, scheme=scheme, symmetric=sym, auth_policy=policy
    )


def certify_attest(
    *,
    signer_name: bytes,
    object_name: bytes,
    extra_data: bytes = b"",
    magic: int = tpm2.TPM_GENERATED_VALUE,
    att_type: int = tpm2.TPM_ST_ATTEST_CERTIFY,
) -> bytes:
    """A TPMS_ATTEST holding a TPMS_CERTIFY_INFO (what TPM2_Certify signs)."""
    qualified = b"\x00\x0b" + os.urandom(32)
    return (
        struct.pack(">IH", magic, att_type)
        + tpm2.tpm2b(signer_name)
        + tpm2.tpm2b(extra_data)
        + struct.pack(">QIIBQ", int.from_bytes(os.urandom(4), "big"), 1, 0, 1, 0x2019_1023)
        + tpm2.tpm2b(object_name)
        + tpm2.tpm2b(qualified)
    )


@dataclass
class SimDevidTpm:
    ek: rsa.RSAPrivateKey
    ek_cert: bytes
    ak: rsa.RSAPrivateKey
    devid: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    chain: tuple[bytes, ...]
    ak_attrs: int = AK_ATTRS
    devid_attrs: int = DEVID_ATTRS

    @classmethod
    def create(cls, ek_ca: SimCa, pki: DevidPki, *, alg: str = "rsa") -> SimDevidTpm:
        ek = rsa.generate_private_key(65537, 2048)
        devid: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey = (
            rsa.generate_private_key(65537, 2048)
            if alg == "rsa"
            else ec.generate_private_key(ec.SECP256R1())
        )
        return cls(
            ek=ek,
            ek_cert=ek_ca.issue_ek_cert(ek.public_key()),
            ak=rsa.generate_private_key(65537, 2048),
            devid=devid,
            chain=pki.chain(devid.public_key()),
        )

    def ek_public(self) -> bytes:
        return _rsa_public(
            self.ek.public_key(),
            EK_ATTRS,
            tpm2.Scheme(tpm2.Alg.NULL),
            tpm2.SymDef(tpm2.Alg.AES, 128, tpm2.Alg.CFB),
            _EK_POLICY,
        )

    def ak_public(self) -> bytes:
        return _rsa_public(
            self.ak.public_key(),
            self.ak_attrs,
            tpm2.Scheme(tpm2.Alg.RSASSA, tpm2.Alg.SHA256),
            tpm2.SymDef(tpm2.Alg.NULL),
        )

    def devid_public(self) -> bytes:
        if isinstance(self.devid, rsa.RSAPrivateKey):
            return _rsa_public(
                self.devid.public_key(),
                self.devid_attrs,
                tpm2.Scheme(tpm2.Alg.RSASSA, tpm2.Alg.SHA256),
                tpm2.SymDef(tpm2.Alg.NULL),
            )
        nums = self.devid.public_key().public_numbers()
        return tpm2.encode_ecc_public(
            x=nums.x.to_bytes(32, "big"),
            y=nums.y.to_bytes(32, "big"),
            attributes=self.devid_attrs,
            scheme=tpm2.Scheme(tpm2.Alg.ECDSA, tpm2.Alg.SHA256),
        )

    def name(self, public: bytes) -> bytes:
        return tpm2.parse_public(public).name()

    def certification(
        self, *, sign_with: rsa.RSAPrivateKey | None = None, **attest: Any
    ) -> tuple[bytes, bytes]:
        fields: dict[str, Any] = {
            "signer_name": self.name(self.ak_public()),
            "object_name": self.name(self.devid_public()),
        }
        fields.update(attest)
        att = certify_attest(**fields)
        sig = (sign_with or self.ak).sign(att, padding.PKCS1v15(), hashes.SHA256())
        return att, tpm2.encode_rsa_signature(sig)

    def request(self, **changes: Any) -> AttestationRequest:
        att, sig = self.certification()
        req = AttestationRequest(
            devid_cert=self.chain,
            devid_pub=self.devid_public(),
            ek_cert=self.ek_cert,
            ek_pub=self.ek_public(),
            ak_pub=self.ak_public(),
            certified_devid=att,
            certification_signature=sig,
        )
        return replace(req, **changes)

    def sign(self, data: bytes) -> bytes:
        if isinstance(self.devid, rsa.RSAPrivateKey):
            return self.devid.sign(data, padding.PKCS1v15(), hashes.SHA256())
        return self.devid.sign(data, ec.ECDSA(hashes.SHA256()))

    def answer(self, ch: ChallengeRequest) -> ChallengeResponse:
        cred = Credential(tpm2.tpm2b(ch.credential), tpm2.tpm2b(ch.secret))
        return ChallengeResponse(
            signature=self.sign(ch.nonce),
            cert_info=activate_credential(self.ek, self.name(self.ak_public()), cred),
        )

    def ek_hash(self) -> str:
        import hashlib

        spki = self.ek.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return hashlib.sha256(spki).hexdigest()
