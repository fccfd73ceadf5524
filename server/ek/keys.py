"""Public keys and signatures: SubjectPublicKeyInfo parsing and signature checks.

Keys are compared *semantically* (RSA modulus and exponent; EC curve and point),
so an EK certificate whose SPKI is typed ``id-RSAES-OAEP`` (some TPMs) still
matches the ``rsaEncryption`` PUBLIC KEY block the agent sends.

Signature verification uses python-cryptography's primitives only; the signed
bytes are passed in unchanged by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from protocol import der
from protocol.der import DerError, Tlv

RSA_ENCRYPTION = "1.2.840.113549.1.1.1"
RSAES_OAEP = "1.2.840.113549.1.1.7"
RSASSA_PSS = "1.2.840.113549.1.1.10"
EC_PUBLIC_KEY = "1.2.840.10045.2.1"
MGF1 = "1.2.840.113549.1.1.8"

Q_RSA_OAEP_SPKI = "rsa_oaep_spki"
Q_RSA_PSS_SPKI = "rsa_pss_spki"
Q_RSA_SPKI_PARAMS_ABSENT = "rsa_spki_params_absent"
Q_ECDSA_NULL_PARAMS = "ecdsa_sigalg_null_params"
Q_RSA_SIGALG_PARAMS_ABSENT = "rsa_sigalg_params_absent"

_CURVES: dict[str, tuple[str, type[ec.EllipticCurve], int]] = {
    "1.2.840.10045.3.1.7": ("P-256", ec.SECP256R1, 32),
    "1.3.132.0.34": ("P-384", ec.SECP384R1, 48),
    "1.3.132.0.35": ("P-521", ec.SECP521R1, 66),
}

_HASHES: dict[str, str] = {
    "1.3.14.3.2.26": "sha1",
    "2.16.840.1.101.3.4.2.4": "sha224",
    "2.16.840.1.101.3.4.2.1": "sha256",
    "2.16.840.1.101.3.4.2.2": "sha384",
    "2.16.840.1.101.3.4.2.3": "sha512",
}

_HASH_CLASSES: dict[str, type[hashes.HashAlgorithm]] = {
    "sha1": hashes.SHA1,
    "sha224": hashes.SHA224,
    "sha256": hashes.SHA256,
    "sha384": hashes.SHA384,
    "sha512": hashes.SHA512,
}

# signature OID -> (display name, kind, hash)
_SIGNATURES: dict[str, tuple[str, str, str]] = {
    "1.2.840.113549.1.1.5": ("sha1WithRSAEncryption", "rsa-pkcs1", "sha1"),
    "1.2.840.113549.1.1.14": ("sha224WithRSAEncryption", "rsa-pkcs1", "sha224"),
    "1.2.840.113549.1.1.11": ("sha256WithRSAEncryption", "rsa-pkcs1", "sha256"),
    "1.2.840.113549.1.1.12": ("sha384WithRSAEncryption", "rsa-pkcs1", "sha384"),
    "1.2.840.113549.1.1.13": ("sha512WithRSAEncryption", "rsa-pkcs1", "sha512"),
    "1.2.840.10045.4.1": ("ecdsa-with-SHA1", "ecdsa", "sha1"),
    "1.2.840.10045.4.3.1": ("ecdsa-with-SHA224", "ecdsa", "sha224"),
    "1.2.840.10045.4.3.2": ("ecdsa-with-SHA256", "ecdsa", "sha256"),
    "1.2.840.10045.4.3.3": ("ecdsa-with-SHA384", "ecdsa", "sha384"),
    "1.2.840.10045.4.3.4": ("ecdsa-with-SHA512", "ecdsa", "sha512"),
}

MIN_RSA_SIGNING_BITS = 2048


class SignatureCheckError(Exception):
    """A signature could not be accepted; ``unsupported`` tells "cannot check" from "does not verify"."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


class PublicKeyInfo:
    """A parsed SubjectPublicKeyInfo; ``canonical`` identifies the key independently of its encoding."""

    __slots__ = (
        "_key",
        "algorithm_oid",
        "bits",
        "canonical",
        "curve",
        "der",
        "description",
        "kind",
        "point",
        "rsa_numbers",
    )

    def __init__(
        self,
        der_bytes: bytes,
        *,
        algorithm_oid: str,
        kind: str,
        canonical: tuple[object, ...],
        bits: int,
        description: str,
        curve: str = "",
        point: bytes = b"",
        rsa_numbers: tuple[int, int] | None = None,
    ) -> None:
        self.der = der_bytes
        self.algorithm_oid = algorithm_oid
        self.kind = kind  # "rsa" | "ec" | "unsupported"
        self.canonical = canonical
        self.bits = bits
        self.description = description
        self.curve = curve
        self.point = point
        self.rsa_numbers = rsa_numbers  # (n, e)
        self._key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey | None = None

    def same_key(self, other: PublicKeyInfo) -> bool:
        return self.kind != "unsupported" and self.canonical == other.canonical

    def crypto_key(self) -> rsa.RSAPublicKey | ec.EllipticCurvePublicKey:
        """The key as a python-cryptography object (built once); raises SignatureCheckError if impossible."""
        if self._key is not None:
            return self._key
        try:
            if self.rsa_numbers is not None:
                n, e = self.rsa_numbers
                key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey = rsa.RSAPublicNumbers(e, n).public_key()
            elif self.kind == "ec":
                curve_class = next(c for name, c, _ in _CURVES.values() if name == self.curve)
                key = ec.EllipticCurvePublicKey.from_encoded_point(curve_class(), self.point)
            else:
                raise SignatureCheckError(
                    f"unsupported public key algorithm {self.algorithm_oid}", unsupported=True
                )
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise SignatureCheckError(
                f"unusable {self.description} public key: {exc}", unsupported=True
            ) from exc
        self._key = key
        return key


def parse_spki(data: bytes, quirks: set[str]) -> PublicKeyInfo:
    """Parse a SubjectPublicKeyInfo DER (exactly; no trailing bytes)."""
    outer = der.read_tlv(data, 0, len(data), quirks)
    der.expect(outer, der.SEQUENCE, "SubjectPublicKeyInfo")
    if outer.end != len(data):
        raise DerError("SubjectPublicKeyInfo has trailing bytes")
    return parse_spki_tlv(outer, quirks)


def parse_spki_tlv(outer: Tlv, quirks: set[str]) -> PublicKeyInfo:
    items = der.children(outer, quirks)
    if len(items) != 2:
        raise DerError("SubjectPublicKeyInfo must have two elements")
    alg_oid, params = parse_algorithm_identifier(items[0], quirks)
    key_bits, unused = der.parse_bit_string(items[1], "subjectPublicKey")
    if unused:
        raise DerError("subjectPublicKey has unused bits")
    raw = outer.raw
    if alg_oid in (RSA_ENCRYPTION, RSAES_OAEP, RSASSA_PSS):
        if alg_oid == RSAES_OAEP:
            quirks.add(Q_RSA_OAEP_SPKI)
        elif alg_oid == RSASSA_PSS:
            quirks.add(Q_RSA_PSS_SPKI)
        elif params is None:
            quirks.add(Q_RSA_SPKI_PARAMS_ABSENT)
        body = der.read_tlv(key_bits, 0, len(key_bits), quirks)
        if body.end != len(key_bits):
            raise DerError("RSAPublicKey has trailing bytes")
        numbers = der.children(der.expect(body, der.SEQUENCE, "RSAPublicKey"), quirks)
        if len(numbers) != 2:
            raise DerError("RSAPublicKey must have two INTEGERs")
        n = der.parse_integer(numbers[0], quirks, "RSA modulus")
        e = der.parse_integer(numbers[1], quirks, "RSA exponent")
        if n <= 0 or e <= 0:
            raise DerError("RSA modulus and exponent must be positive")
        bits = n.bit_length()
        return PublicKeyInfo(
            raw,
            algorithm_oid=alg_oid,
            kind="rsa",
            canonical=("rsa", n, e),
            bits=bits,
            description=f"RSA-{bits}",
            rsa_numbers=(n, e),
        )
    if alg_oid == EC_PUBLIC_KEY:
        if params is None or params.tag != der.OID:
            raise DerError(
                "EC public key without a named curve (explicit curve parameters are not supported)"
            )
        curve_oid = der.parse_oid(params)
        if curve_oid not in _CURVES:
            return PublicKeyInfo(
                raw,
                algorithm_oid=alg_oid,
                kind="unsupported",
                canonical=("ec", curve_oid, key_bits),
                bits=0,
                description=f"EC {curve_oid}",
            )
        name, curve_class, size = _CURVES[curve_oid]
        if len(key_bits) == 1 + 2 * size and key_bits[0] == 0x04:
            x = int.from_bytes(key_bits[1 : 1 + size], "big")
            y = int.from_bytes(key_bits[1 + size :], "big")
        elif len(key_bits) == 1 + size and key_bits[0] in (0x02, 0x03):
            try:
                point = ec.EllipticCurvePublicKey.from_encoded_point(
                    curve_class(), key_bits
                ).public_numbers()
            except ValueError as exc:
                raise DerError(f"invalid compressed {name} point") from exc
            x, y = point.x, point.y
        else:
            raise DerError(f"malformed {name} point")
        return PublicKeyInfo(
            raw,
            algorithm_oid=alg_oid,
            kind="ec",
            canonical=("ec", name, x, y),
            bits=size * 8,
            description=f"ECC {name}",
            curve=name,
            point=key_bits,
        )
    return PublicKeyInfo(
        raw,
        algorithm_oid=alg_oid,
        kind="unsupported",
        canonical=("unsupported", raw),
        bits=0,
        description=f"key type {alg_oid}",
    )


def parse_algorithm_identifier(tlv: Tlv, quirks: set[str]) -> tuple[str, Tlv | None]:
    """(OID, parameters element or None when absent)."""
    items = der.children(der.expect(tlv, der.SEQUENCE, "AlgorithmIdentifier"), quirks)
    if not 1 <= len(items) <= 2:
        raise DerError("AlgorithmIdentifier must have one or two elements")
    return der.parse_oid(items[0]), items[1] if len(items) == 2 else None


@dataclass(frozen=True, slots=True)
class SignatureAlgorithm:
    oid: str
    name: str
    kind: str  # "rsa-pkcs1" | "rsa-pss" | "ecdsa" | "unsupported"
    hash_name: str = ""
    mgf_hash: str = ""
    salt_length: int = 0


def parse_signature_algorithm(tlv: Tlv, quirks: set[str]) -> SignatureAlgorithm:
    oid, params = parse_algorithm_identifier(tlv, quirks)
    known = _SIGNATURES.get(oid)
    if known is not None:
        name, kind, hash_name = known
        if kind == "rsa-pkcs1":
            if params is None:
                quirks.add(Q_RSA_SIGALG_PARAMS_ABSENT)
            else:
                der.parse_null(params)
        elif params is not None:  # ECDSA: parameters must be absent (RFC 5758); Intel OnDie CAs send NULL
            der.parse_null(params)
            quirks.add(Q_ECDSA_NULL_PARAMS)
        return SignatureAlgorithm(oid, name, kind, hash_name)
    if oid == RSASSA_PSS:
        if params is None:
            raise DerError("RSASSA-PSS signature algorithm without parameters")
        return _parse_pss(params, quirks)
    return SignatureAlgorithm(oid, oid, "unsupported")


def _hash_from(tlv: Tlv, quirks: set[str]) -> str:
    oid, params = parse_algorithm_identifier(tlv, quirks)
    if params is not None:
        der.parse_null(params)
    if oid not in _HASHES:
        raise DerError(f"unsupported hash algorithm {oid}")
    return _HASHES[oid]


def _parse_pss(params: Tlv, quirks: set[str]) -> SignatureAlgorithm:
    hash_name, mgf_hash, salt, trailer = "sha1", "sha1", 20, 1
    for item in der.children(der.expect(params, der.SEQUENCE, "RSASSA-PSS-params"), quirks):
        inner = der.children(item, quirks)
        if len(inner) != 1:
            raise DerError("RSASSA-PSS-params: explicit tag must wrap one element")
        if item.tag == 0xA0:
            hash_name = _hash_from(inner[0], quirks)
        elif item.tag == 0xA1:
            mgf_oid, mgf_params = parse_algorithm_identifier(inner[0], quirks)
            if mgf_oid != MGF1 or mgf_params is None:
                raise DerError(f"unsupported PSS mask generation function {mgf_oid}")
            mgf_hash = _hash_from(mgf_params, quirks)
        elif item.tag == 0xA2:
            salt = der.parse_integer(inner[0], quirks, "PSS saltLength")
        elif item.tag == 0xA3:
            trailer = der.parse_integer(inner[0], quirks, "PSS trailerField")
        else:
            raise DerError(f"unexpected element 0x{item.tag:02x} in RSASSA-PSS-params")
    if trailer != 1 or not 0 <= salt <= 1024:
        raise DerError("unsupported RSASSA-PSS trailerField or saltLength")
    return SignatureAlgorithm(RSASSA_PSS, f"RSASSA-PSS({hash_name})", "rsa-pss", hash_name, mgf_hash, salt)


def verify_signature(
    issuer_key: PublicKeyInfo,
    algorithm: SignatureAlgorithm,
    signature: bytes,
    signed: bytes,
    *,
    allow_sha1: bool,
) -> None:
    """Raise SignatureCheckError unless ``signature`` over ``signed`` verifies with ``issuer_key``."""
    if algorithm.kind == "unsupported":
        raise SignatureCheckError(f"unsupported signature algorithm {algorithm.oid}", unsupported=True)
    if "sha1" in (algorithm.hash_name, algorithm.mgf_hash) and not allow_sha1:
        raise SignatureCheckError(
            f"signature algorithm {algorithm.name} uses SHA-1, which is refused "
            "(allow_sha1: true accepts it)",
            unsupported=True,
        )
    key = issuer_key.crypto_key()
    digest = _HASH_CLASSES[algorithm.hash_name]()
    try:
        if algorithm.kind == "ecdsa":
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise SignatureCheckError(
                    f"{algorithm.name} signature but the issuer key is {issuer_key.description}"
                )
            key.verify(signature, signed, ec.ECDSA(digest))
            return
        if not isinstance(key, rsa.RSAPublicKey):
            raise SignatureCheckError(
                f"{algorithm.name} signature but the issuer key is {issuer_key.description}"
            )
        if issuer_key.bits < MIN_RSA_SIGNING_BITS:
            raise SignatureCheckError(
                f"issuer key {issuer_key.description} is shorter than {MIN_RSA_SIGNING_BITS} bits",
                unsupported=True,
            )
        if algorithm.kind == "rsa-pss":
            pss = padding.PSS(
                mgf=padding.MGF1(_HASH_CLASSES[algorithm.mgf_hash]()), salt_length=algorithm.salt_length
            )
            key.verify(signature, signed, pss, digest)
        else:
            key.verify(signature, signed, padding.PKCS1v15(), digest)
    except InvalidSignature as exc:
        raise SignatureCheckError(f"{algorithm.name} signature does not verify") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise SignatureCheckError(f"{algorithm.name} signature cannot be checked: {exc}") from exc
