"""Parsers and encoders for the TPM 2.0 structures the ``tpm`` attestor carries.

Pure Python, no libtss2: the server must not need native TPM libraries. The
parsers are strict: a truncated structure, a size field that overruns, an
unknown algorithm or trailing bytes raise :class:`TpmStructureError`.

Structures (TPM 2.0 Library, Part 2): TPMT_PUBLIC, TPMS_CREATION_DATA,
TPMS_ATTEST, TPMT_SIGNATURE.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any

from protocol.errors import TpmStructureError


class Alg(IntEnum):
    """TPM_ALG_ID values used here."""

    RSA = 0x0001
    SHA1 = 0x0004
    HMAC = 0x0005
    AES = 0x0006
    KEYEDHASH = 0x0008
    XOR = 0x000A
    SHA256 = 0x000B
    SHA384 = 0x000C
    SHA512 = 0x000D
    NULL = 0x0010
    SM3_256 = 0x0012
    SM4 = 0x0013
    RSASSA = 0x0014
    RSAES = 0x0015
    RSAPSS = 0x0016
    OAEP = 0x0017
    ECDSA = 0x0018
    ECDH = 0x0019
    ECDAA = 0x001A
    SM2 = 0x001B
    ECSCHNORR = 0x001C
    ECMQV = 0x001D
    KDF1_SP800_56A = 0x0020
    KDF2 = 0x0021
    KDF1_SP800_108 = 0x0022
    ECC = 0x0023
    SYMCIPHER = 0x0025
    CAMELLIA = 0x0026
    CTR = 0x0040
    OFB = 0x0041
    CBC = 0x0042
    CFB = 0x0043
    ECB = 0x0044


class EccCurve(IntEnum):
    NIST_P192 = 0x0001
    NIST_P224 = 0x0002
    NIST_P256 = 0x0003
    NIST_P384 = 0x0004
    NIST_P521 = 0x0005
    BN_P256 = 0x0010
    BN_P638 = 0x0011
    SM2_P256 = 0x0020


class ObjectAttr(IntFlag):
    """TPMA_OBJECT bits."""

    FIXED_TPM = 0x00000002
    ST_CLEAR = 0x00000004
    FIXED_PARENT = 0x00000010
    SENSITIVE_DATA_ORIGIN = 0x00000020
    USER_WITH_AUTH = 0x00000040
    ADMIN_WITH_POLICY = 0x00000080
    NO_DA = 0x00000400
    ENCRYPTED_DUPLICATION = 0x00000800
    RESTRICTED = 0x00010000
    DECRYPT = 0x00020000
    SIGN_ENCRYPT = 0x00040000


TPM_GENERATED_VALUE = 0xFF544347
TPM_ST_ATTEST_CERTIFY = 0x8017
TPM_ST_ATTEST_QUOTE = 0x8018
TPM_ST_ATTEST_CREATION = 0x801A

HASH_SIZES: dict[int, int] = {
    Alg.SHA1: 20,
    Alg.SHA256: 32,
    Alg.SHA384: 48,
    Alg.SHA512: 64,
    Alg.SM3_256: 32,
}
_HASHLIB_NAMES: dict[int, str] = {
    Alg.SHA1: "sha1",
    Alg.SHA256: "sha256",
    Alg.SHA384: "sha384",
    Alg.SHA512: "sha512",
}
# Schemes whose details are a single TPMS_SCHEME_HASH; ECDAA adds a u16 count.
_HASH_SCHEMES = {
    Alg.RSASSA,
    Alg.RSAPSS,
    Alg.OAEP,
    Alg.ECDSA,
    Alg.ECDH,
    Alg.SM2,
    Alg.ECSCHNORR,
    Alg.ECMQV,
    Alg.HMAC,
    Alg.KDF1_SP800_56A,
    Alg.KDF2,
    Alg.KDF1_SP800_108,
}


def hash_digest(alg: int, data: bytes) -> bytes:
    """Digest ``data`` with TPM hash algorithm ``alg``."""
    name = _HASHLIB_NAMES.get(alg)
    if name is None:
        raise TpmStructureError(f"unsupported hash algorithm 0x{alg:04x}")
    return hashlib.new(name, data).digest()


class Reader:
    """A bounds-checked big-endian reader over a marshalled TPM structure."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data = bytes(data)
        self._pos = 0
        self._what = what

    def _take(self, n: int, field: str) -> bytes:
        end = self._pos + n
        if n < 0 or end > len(self._data):
            raise TpmStructureError(
                f"{self._what}: truncated at {field} (need {n} bytes at offset {self._pos}, "
                f"have {len(self._data) - self._pos})"
            )
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def u8(self, field: str) -> int:
        return self._take(1, field)[0]

    def u16(self, field: str) -> int:
        value: int = struct.unpack(">H", self._take(2, field))[0]
        return value

    def u32(self, field: str) -> int:
        value: int = struct.unpack(">I", self._take(4, field))[0]
        return value

    def u64(self, field: str) -> int:
        value: int = struct.unpack(">Q", self._take(8, field))[0]
        return value

    def tpm2b(self, field: str, max_size: int = 4096) -> bytes:
        size = self.u16(field + ".size")
        if size > max_size:
            raise TpmStructureError(f"{self._what}: {field} size {size} exceeds {max_size}")
        return self._take(size, field)

    def raw(self, n: int, field: str) -> bytes:
        return self._take(n, field)

    @property
    def offset(self) -> int:
        return self._pos

    def done(self) -> None:
        if self._pos != len(self._data):
            raise TpmStructureError(
                f"{self._what}: {len(self._data) - self._pos} trailing bytes after the structure"
            )


def tpm2b(data: bytes) -> bytes:
    """Marshal ``data`` as a TPM2B (u16 size prefix)."""
    if len(data) > 0xFFFF:
        raise TpmStructureError("TPM2B payload over 65535 bytes")
    return struct.pack(">H", len(data)) + data


def strip_tpm2b(data: bytes, what: str) -> bytes:
    """Remove a TPM2B size prefix, checking that it covers exactly the rest."""
    reader = Reader(data, what)
    body = reader.tpm2b(what, max_size=0xFFFF)
    reader.done()
    return body


def _alg(value: int, field: str, what: str) -> Alg:
    try:
        return Alg(value)
    except ValueError:
        raise TpmStructureError(f"{what}: unknown algorithm 0x{value:04x} in {field}") from None


@dataclass(frozen=True)
class SymDef:
    algorithm: Alg
    key_bits: int = 0
    mode: int = 0


@dataclass(frozen=True)
class Scheme:
    scheme: Alg
    hash_alg: int = 0
    count: int = 0


@dataclass(frozen=True)
class Public:
    """A decoded TPMT_PUBLIC, with the exact bytes it came from."""

    raw: bytes
    type: Alg
    name_alg: int
    attributes: ObjectAttr
    auth_policy: bytes
    symmetric: SymDef
    scheme: Scheme
    rsa_key_bits: int = 0
    rsa_exponent: int = 0
    rsa_modulus: bytes = b""
    ecc_curve: int = 0
    ecc_kdf: Scheme | None = None
    ecc_x: bytes = b""
    ecc_y: bytes = b""
    unique_digest: bytes = b""

    def name(self) -> bytes:
        """The TPM Name: nameAlg (u16) followed by H_nameAlg(TPMT_PUBLIC)."""
        return struct.pack(">H", self.name_alg) + hash_digest(self.name_alg, self.raw)

    def has(self, attr: ObjectAttr) -> bool:
        return bool(self.attributes & attr)


def _read_symdef(r: Reader, what: str) -> SymDef:
    alg = _alg(r.u16("symmetric.algorithm"), "symmetric.algorithm", what)
    if alg == Alg.NULL:
        return SymDef(alg)
    if alg == Alg.XOR:
        return SymDef(alg, key_bits=r.u16("symmetric.hash"))
    return SymDef(alg, key_bits=r.u16("symmetric.keyBits"), mode=r.u16("symmetric.mode"))


def _read_scheme(r: Reader, field: str, what: str) -> Scheme:
    alg = _alg(r.u16(field + ".scheme"), field, what)
    if alg in (Alg.NULL, Alg.RSAES):
        return Scheme(alg)
    if alg == Alg.ECDAA:
        return Scheme(alg, hash_alg=r.u16(field + ".hashAlg"), count=r.u16(field + ".count"))
    if alg == Alg.XOR:
        return Scheme(alg, hash_alg=r.u16(field + ".hashAlg"), count=r.u16(field + ".kdf"))
    if alg in _HASH_SCHEMES:
        return Scheme(alg, hash_alg=r.u16(field + ".hashAlg"))
    raise TpmStructureError(f"{what}: algorithm {alg.name} is not a scheme in {field}")


def parse_public(data: bytes) -> Public:
    """Decode a TPMT_PUBLIC (no TPM2B size prefix)."""
    what = "TPMT_PUBLIC"
    r = Reader(data, what)
    obj_type = _alg(r.u16("type"), "type", what)
    name_alg = r.u16("nameAlg")
    if name_alg not in HASH_SIZES:
        raise TpmStructureError(f"{what}: unsupported nameAlg 0x{name_alg:04x}")
    attributes = ObjectAttr(r.u32("objectAttributes"))
    auth_policy = r.tpm2b("authPolicy", 64)
    if obj_type == Alg.RSA:
        sym = _read_symdef(r, what)
        scheme = _read_scheme(r, "scheme", what)
        key_bits = r.u16("keyBits")
        exponent = r.u32("exponent")
        modulus = r.tpm2b("unique.rsa", 512)
        r.done()
        if key_bits == 0 or len(modulus) not in (0, key_bits // 8):
            raise TpmStructureError(f"{what}: RSA modulus of {len(modulus)} bytes for keyBits {key_bits}")
        return Public(
            raw=bytes(data),
            type=obj_type,
            name_alg=name_alg,
            attributes=attributes,
            auth_policy=auth_policy,
            symmetric=sym,
            scheme=scheme,
            rsa_key_bits=key_bits,
            rsa_exponent=exponent or 65537,
            rsa_modulus=modulus,
        )
    if obj_type == Alg.ECC:
        sym = _read_symdef(r, what)
        scheme = _read_scheme(r, "scheme", what)
        curve = r.u16("curveID")
        kdf = _read_scheme(r, "kdf", what)
        x = r.tpm2b("unique.ecc.x", 128)
        y = r.tpm2b("unique.ecc.y", 128)
        r.done()
        return Public(
            raw=bytes(data),
            type=obj_type,
            name_alg=name_alg,
            attributes=attributes,
            auth_policy=auth_policy,
            symmetric=sym,
            scheme=scheme,
            ecc_curve=curve,
            ecc_kdf=kdf,
            ecc_x=x,
            ecc_y=y,
        )
    if obj_type == Alg.KEYEDHASH:
        scheme = _read_scheme(r, "scheme", what)
        unique = r.tpm2b("unique.keyedHash", 64)
        r.done()
        return Public(
            raw=bytes(data),
            type=obj_type,
            name_alg=name_alg,
            attributes=attributes,
            auth_policy=auth_policy,
            symmetric=SymDef(Alg.NULL),
            scheme=scheme,
            unique_digest=unique,
        )
    if obj_type == Alg.SYMCIPHER:
        sym = _read_symdef(r, what)
        unique = r.tpm2b("unique.sym", 64)
        r.done()
        return Public(
            raw=bytes(data),
            type=obj_type,
            name_alg=name_alg,
            attributes=attributes,
            auth_policy=auth_policy,
            symmetric=sym,
            scheme=Scheme(Alg.NULL),
            unique_digest=unique,
        )
    raise TpmStructureError(f"{what}: object type {obj_type.name} is not a key type")


@dataclass(frozen=True)
class PcrSelection:
    hash_alg: int
    select: bytes


def _read_pcr_selection(r: Reader) -> tuple[PcrSelection, ...]:
    count = r.u32("pcrSelect.count")
    if count > 16:
        raise TpmStructureError(f"pcrSelect.count {count} exceeds 16")
    out = []
    for i in range(count):
        alg = r.u16(f"pcrSelect[{i}].hash")
        size = r.u8(f"pcrSelect[{i}].sizeofSelect")
        if size > 32:
            raise TpmStructureError(f"pcrSelect[{i}].sizeofSelect {size} exceeds 32")
        out.append(PcrSelection(alg, r.raw(size, f"pcrSelect[{i}].pcrSelect")))
    return tuple(out)


@dataclass(frozen=True)
class CreationData:
    """A decoded TPMS_CREATION_DATA."""

    raw: bytes
    pcr_select: tuple[PcrSelection, ...]
    pcr_digest: bytes
    locality: int
    parent_name_alg: int
    parent_name: bytes
    parent_qualified_name: bytes
    outside_info: bytes


def parse_creation_data(data: bytes) -> CreationData:
    """Decode a TPMS_CREATION_DATA (no TPM2B size prefix)."""
    r = Reader(data, "TPMS_CREATION_DATA")
    pcr_select = _read_pcr_selection(r)
    pcr_digest = r.tpm2b("pcrDigest", 64)
    locality = r.u8("locality")
    parent_name_alg = r.u16("parentNameAlg")
    parent_name = r.tpm2b("parentName", 68)
    parent_qualified_name = r.tpm2b("parentQualifiedName", 68)
    outside_info = r.tpm2b("outsideInfo", 1024)
    r.done()
    return CreationData(
        raw=bytes(data),
        pcr_select=pcr_select,
        pcr_digest=pcr_digest,
        locality=locality,
        parent_name_alg=parent_name_alg,
        parent_name=parent_name,
        parent_qualified_name=parent_qualified_name,
        outside_info=outside_info,
    )


@dataclass(frozen=True)
class Attest:
    """A decoded TPMS_ATTEST. ``object_name``/``creation_hash`` are set for creation attestations."""

    raw: bytes
    magic: int
    type: int
    qualified_signer: bytes
    extra_data: bytes
    clock: int
    reset_count: int
    restart_count: int
    safe: int
    firmware_version: int
    object_name: bytes = b""
    creation_hash: bytes = b""
    qualified_name: bytes = b""
    pcr_select: tuple[PcrSelection, ...] = ()  # QUOTE
    pcr_digest: bytes = b""  # QUOTE


def parse_attest(data: bytes) -> Attest:
    """Decode a TPMS_ATTEST of type CREATION, CERTIFY or QUOTE (no TPM2B size prefix)."""
    what = "TPMS_ATTEST"
    r = Reader(data, what)
    magic = r.u32("magic")
    att_type = r.u16("type")
    qualified_signer = r.tpm2b("qualifiedSigner", 68)
    extra_data = r.tpm2b("extraData", 64)
    clock = r.u64("clockInfo.clock")
    reset_count = r.u32("clockInfo.resetCount")
    restart_count = r.u32("clockInfo.restartCount")
    safe = r.u8("clockInfo.safe")
    firmware = r.u64("firmwareVersion")
    object_name = creation_hash = qualified_name = pcr_digest = b""
    pcr_select: tuple[PcrSelection, ...] = ()
    if att_type == TPM_ST_ATTEST_QUOTE:
        pcr_select = _read_pcr_selection(r)
        pcr_digest = r.tpm2b("attested.quote.pcrDigest", 64)
    elif att_type == TPM_ST_ATTEST_CREATION:
        object_name = r.tpm2b("attested.creation.objectName", 68)
        creation_hash = r.tpm2b("attested.creation.creationHash", 64)
    elif att_type == TPM_ST_ATTEST_CERTIFY:
        object_name = r.tpm2b("attested.certify.name", 68)
        qualified_name = r.tpm2b("attested.certify.qualifiedName", 68)
    else:
        raise TpmStructureError(f"{what}: unsupported attestation type 0x{att_type:04x}")
    r.done()
    return Attest(
        raw=bytes(data),
        magic=magic,
        type=att_type,
        qualified_signer=qualified_signer,
        extra_data=extra_data,
        clock=clock,
        reset_count=reset_count,
        restart_count=restart_count,
        safe=safe,
        firmware_version=firmware,
        object_name=object_name,
        creation_hash=creation_hash,
        qualified_name=qualified_name,
        pcr_select=pcr_select,
        pcr_digest=pcr_digest,
    )


@dataclass(frozen=True)
class Signature:
    """A decoded TPMT_SIGNATURE."""

    sig_alg: Alg
    hash_alg: int
    rsa_signature: bytes = b""
    ecc_r: bytes = b""
    ecc_s: bytes = b""


def parse_signature(data: bytes) -> Signature:
    """Decode a TPMT_SIGNATURE (RSASSA, RSAPSS or ECDSA)."""
    what = "TPMT_SIGNATURE"
    r = Reader(data, what)
    alg = _alg(r.u16("sigAlg"), "sigAlg", what)
    if alg in (Alg.RSASSA, Alg.RSAPSS):
        hash_alg = r.u16("hash")
        sig = r.tpm2b("sig", 512)
        r.done()
        return Signature(alg, hash_alg, rsa_signature=sig)
    if alg in (Alg.ECDSA, Alg.SM2, Alg.ECSCHNORR):
        hash_alg = r.u16("hash")
        sig_r = r.tpm2b("signatureR", 128)
        sig_s = r.tpm2b("signatureS", 128)
        r.done()
        return Signature(alg, hash_alg, ecc_r=sig_r, ecc_s=sig_s)
    raise TpmStructureError(f"{what}: unsupported signature algorithm {alg.name}")


def encode_rsa_public(
    *,
    modulus: bytes,
    attributes: int,
    name_alg: int = Alg.SHA256,
    auth_policy: bytes = b"",
    symmetric: SymDef = SymDef(Alg.NULL),
    scheme: Scheme = Scheme(Alg.NULL),
    exponent: int = 0,
) -> bytes:
    """Marshal an RSA TPMT_PUBLIC (used by software TPM simulations and tests)."""
    out = struct.pack(">HHI", Alg.RSA, name_alg, attributes) + tpm2b(auth_policy)
    out += _encode_symdef(symmetric) + _encode_scheme(scheme)
    out += struct.pack(">HI", len(modulus) * 8, 0 if exponent == 65537 else exponent)
    return out + tpm2b(modulus)


def encode_ecc_public(
    *,
    x: bytes,
    y: bytes,
    attributes: int,
    curve: int = EccCurve.NIST_P256,
    name_alg: int = Alg.SHA256,
    auth_policy: bytes = b"",
    symmetric: SymDef = SymDef(Alg.NULL),
    scheme: Scheme = Scheme(Alg.NULL),
    kdf: Scheme = Scheme(Alg.NULL),
) -> bytes:
    """Marshal an ECC TPMT_PUBLIC."""
    out = struct.pack(">HHI", Alg.ECC, name_alg, attributes) + tpm2b(auth_policy)
    out += _encode_symdef(symmetric) + _encode_scheme(scheme) + struct.pack(">H", curve)
    out += _encode_scheme(kdf)
    return out + tpm2b(x) + tpm2b(y)


def _encode_symdef(sym: SymDef) -> bytes:
    if sym.algorithm == Alg.NULL:
        return struct.pack(">H", Alg.NULL)
    return struct.pack(">HHH", sym.algorithm, sym.key_bits, sym.mode)


def _encode_scheme(scheme: Scheme) -> bytes:
    if scheme.scheme in (Alg.NULL, Alg.RSAES):
        return struct.pack(">H", scheme.scheme)
    if scheme.scheme == Alg.ECDAA:
        return struct.pack(">HHH", scheme.scheme, scheme.hash_alg, scheme.count)
    return struct.pack(">HH", scheme.scheme, scheme.hash_alg)


def encode_creation_data(
    *,
    parent_name: bytes,
    parent_qualified_name: bytes,
    parent_name_alg: int = Alg.SHA256,
    pcr_digest: bytes = b"",
    locality: int = 0,
    outside_info: bytes = b"",
) -> bytes:
    """Marshal a TPMS_CREATION_DATA with an empty PCR selection."""
    return (
        struct.pack(">I", 0)
        + tpm2b(pcr_digest)
        + struct.pack(">BH", locality, parent_name_alg)
        + tpm2b(parent_name)
        + tpm2b(parent_qualified_name)
        + tpm2b(outside_info)
    )


def encode_creation_attest(
    *,
    qualified_signer: bytes,
    object_name: bytes,
    creation_hash: bytes,
    extra_data: bytes = b"",
    clock: int = 0,
    reset_count: int = 0,
    restart_count: int = 0,
    safe: int = 1,
    firmware_version: int = 0,
    magic: int = TPM_GENERATED_VALUE,
    att_type: int = TPM_ST_ATTEST_CREATION,
) -> bytes:
    """Marshal a TPMS_ATTEST holding a TPMS_CREATION_INFO."""
    return (
        struct.pack(">IH", magic, att_type)
        + tpm2b(qualified_signer)
        + tpm2b(extra_data)
        + struct.pack(">QIIBQ", clock, reset_count, restart_count, safe, firmware_version)
        + tpm2b(object_name)
        + tpm2b(creation_hash)
    )


def encode_quote_attest(
    *,
    qualified_signer: bytes,
    extra_data: bytes,
    bank: int,
    select: bytes,
    pcr_digest: bytes,
    clock: int = 0,
    reset_count: int = 0,
    restart_count: int = 0,
    magic: int = TPM_GENERATED_VALUE,
) -> bytes:
    """Marshal a TPMS_ATTEST holding a TPMS_QUOTE_INFO (what TPM2_Quote signs; tests and tools)."""
    return (
        struct.pack(">IH", magic, TPM_ST_ATTEST_QUOTE)
        + tpm2b(qualified_signer)
        + tpm2b(extra_data)
        + struct.pack(">QIIBQ", clock, reset_count, restart_count, 1, 0)
        + struct.pack(">IHB", 1, bank, len(select))
        + select
        + tpm2b(pcr_digest)
    )


def encode_rsa_signature(signature: bytes, *, hash_alg: int = Alg.SHA256, alg: int = Alg.RSASSA) -> bytes:
    """Marshal an RSASSA/RSAPSS TPMT_SIGNATURE."""
    return struct.pack(">HH", alg, hash_alg) + tpm2b(signature)


def encode_ecdsa_signature(r_value: bytes, s_value: bytes, *, hash_alg: int = Alg.SHA256) -> bytes:
    """Marshal an ECDSA TPMT_SIGNATURE."""
    return struct.pack(">HH", Alg.ECDSA, hash_alg) + tpm2b(r_value) + tpm2b(s_value)


def public_key(pub: Public) -> Any:
    """The ``cryptography`` public key of an RSA or ECC TPMT_PUBLIC."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if pub.type == Alg.RSA:
        if not pub.rsa_modulus:
            raise TpmStructureError("TPMT_PUBLIC: empty RSA modulus")
        return rsa.RSAPublicNumbers(pub.rsa_exponent, int.from_bytes(pub.rsa_modulus, "big")).public_key()
    if pub.type == Alg.ECC:
        curves: dict[int, ec.EllipticCurve] = {
            EccCurve.NIST_P256: ec.SECP256R1(),
            EccCurve.NIST_P384: ec.SECP384R1(),
            EccCurve.NIST_P521: ec.SECP521R1(),
        }
        curve = curves.get(pub.ecc_curve)
        if curve is None:
            raise TpmStructureError(f"TPMT_PUBLIC: unsupported ECC curve 0x{pub.ecc_curve:04x}")
        try:
            return ec.EllipticCurvePublicNumbers(
                int.from_bytes(pub.ecc_x, "big"), int.from_bytes(pub.ecc_y, "big"), curve
            ).public_key()
        except ValueError as exc:
            raise TpmStructureError(f"TPMT_PUBLIC: ECC point is not on the curve: {exc}") from exc
    raise TpmStructureError(f"TPMT_PUBLIC: {pub.type.name} is not an asymmetric key")


def spki_der(pub: Public) -> bytes:
    """The DER SubjectPublicKeyInfo of an RSA or ECC TPMT_PUBLIC."""
    from cryptography.hazmat.primitives import serialization

    key = public_key(pub)
    der: bytes = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return der
