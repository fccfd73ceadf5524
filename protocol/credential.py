"""TPM 2.0 credential activation maths (MakeCredential), in pure Python.

The server builds the challenge with :func:`make_credential` from the EK public
key it validated and the AK Name it checked; only the TPM that holds that EK
and has that AK loaded can recover the secret with TPM2_ActivateCredential.

Layout (TPM 2.0 Part 1 §24; go-tpm ``credactivation``), with ``H`` the AK
name algorithm:

* RSA EK: ``seed`` = 16 random bytes, ``encSeed = RSA-OAEP(H, "IDENTITY\\0")(seed)``.
* ECC EK: ephemeral ECDH on the EK curve, ``seed = KDFe(H, Z, "IDENTITY", ephX, ekX)``,
  ``encSeed`` = the ephemeral point as a TPMS_ECC_POINT.
* ``symKey = KDFa(H, seed, "STORAGE", name, "", 128)``;
  ``encIdentity = AES-128-CFB(symKey, IV=0)(TPM2B(secret))``.
* ``hmacKey = KDFa(H, seed, "INTEGRITY", "", "", |H|)``; ``integrity = HMAC(hmacKey, encIdentity || name)``.
* ``Credential = TPM2B(TPM2B(integrity) || encIdentity)`` (TPM2B_ID_OBJECT),
  ``Secret = TPM2B(encSeed)`` (TPM2B_ENCRYPTED_SECRET); both include their size prefix.

:func:`activate_credential` is the inverse for an EK private key held in
software; the benchmark's simulated agents and the tests use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

try:  # cryptography >= 47 keeps CFB under "decrepit"; TPM credential blobs require it.
    from cryptography.hazmat.decrepit.ciphers.modes import CFB
except ImportError:  # pragma: no cover - older cryptography
    from cryptography.hazmat.primitives.ciphers.modes import CFB

from protocol.errors import CredentialError, TpmStructureError
from protocol.tpm2 import HASH_SIZES, Alg, Reader, tpm2b

_HASH_NAMES: dict[int, str] = {
    Alg.SHA1: "sha1",
    Alg.SHA256: "sha256",
    Alg.SHA384: "sha384",
    Alg.SHA512: "sha512",
}
_CRYPTO_HASHES: dict[int, type[hashes.HashAlgorithm]] = {
    Alg.SHA1: hashes.SHA1,
    Alg.SHA256: hashes.SHA256,
    Alg.SHA384: hashes.SHA384,
    Alg.SHA512: hashes.SHA512,
}
_CURVE_SIZES = {"secp256r1": 32, "secp384r1": 48, "secp521r1": 66}
SYM_KEY_BITS = 128
RSA_SEED_BYTES = 16


def _hash_name(alg: int) -> str:
    try:
        return _HASH_NAMES[alg]
    except KeyError:
        raise CredentialError(f"unsupported name algorithm 0x{alg:04x}") from None


def kdfa(hash_alg: int, key: bytes, label: bytes, context_u: bytes, context_v: bytes, bits: int) -> bytes:  # noqa: PLR0917
    """SP 800-108 counter-mode KDF with HMAC, as TPM2 KDFa."""
    name = _hash_name(hash_alg)
    out = b""
    counter = 0
    need = (bits + 7) // 8
    while len(out) < need:
        counter += 1
        block = (
            struct.pack(">I", counter) + label + b"\x00" + context_u + context_v + struct.pack(">I", bits)
        )
        out += hmac.new(key, block, name).digest()
    out = out[:need]
    if bits % 8:
        out = bytes([out[0] & ((1 << (bits % 8)) - 1)]) + out[1:]
    return out


def kdfe(hash_alg: int, z: bytes, label: bytes, party_u: bytes, party_v: bytes, bits: int) -> bytes:  # noqa: PLR0917
    """SP 800-56A concatenation KDF, as TPM2 KDFe."""
    name = _hash_name(hash_alg)
    out = b""
    counter = 0
    need = (bits + 7) // 8
    while len(out) < need:
        counter += 1
        out += hashlib.new(
            name, struct.pack(">I", counter) + z + label + b"\x00" + party_u + party_v
        ).digest()
    return out[:need]


@dataclass(frozen=True)
class Credential:
    """The challenge halves, each with its TPM2B size prefix."""

    credential_blob: bytes  # TPM2B_ID_OBJECT
    encrypted_secret: bytes  # TPM2B_ENCRYPTED_SECRET


def _name_alg(name: bytes) -> int:
    if len(name) < 2:
        raise CredentialError("object name too short")
    alg = struct.unpack(">H", name[:2])[0]
    if alg not in HASH_SIZES or len(name) != 2 + HASH_SIZES[alg]:
        raise CredentialError(f"object name with algorithm 0x{alg:04x} has the wrong length {len(name)}")
    return int(alg)


def _aes_cfb(key: bytes, data: bytes, *, decrypt: bool) -> bytes:
    cipher = Cipher(algorithms.AES(key), CFB(b"\x00" * 16))
    ctx = cipher.decryptor() if decrypt else cipher.encryptor()
    return ctx.update(data) + ctx.finalize()


def _wrap(hash_alg: int, seed: bytes, name: bytes, secret: bytes) -> bytes:
    sym_key = kdfa(hash_alg, seed, b"STORAGE", name, b"", SYM_KEY_BITS)
    enc_identity = _aes_cfb(sym_key, tpm2b(secret), decrypt=False)
    hmac_key = kdfa(hash_alg, seed, b"INTEGRITY", b"", b"", HASH_SIZES[hash_alg] * 8)
    integrity = hmac.new(hmac_key, enc_identity + name, _hash_name(hash_alg)).digest()
    return tpm2b(tpm2b(integrity) + enc_identity)


def _ecc_coord(value: int, size: int) -> bytes:
    return value.to_bytes(size, "big")


def make_credential(
    ek_public: rsa.RSAPublicKey | ec.EllipticCurvePublicKey, name: bytes, secret: bytes
) -> Credential:
    """Build (credential blob, encrypted secret) binding ``secret`` to the AK ``name`` and the EK."""
    if not 1 <= len(secret) <= HASH_SIZES[Alg.SHA256] * 2:
        raise CredentialError(f"secret of {len(secret)} bytes; expected 1..64")
    hash_alg = _name_alg(name)
    if isinstance(ek_public, rsa.RSAPublicKey):
        seed = os.urandom(RSA_SEED_BYTES)
        enc_seed = ek_public.encrypt(
            seed,
            padding.OAEP(
                mgf=padding.MGF1(_CRYPTO_HASHES[hash_alg]()),
                algorithm=_CRYPTO_HASHES[hash_alg](),
                label=b"IDENTITY\x00",
            ),
        )
    elif isinstance(ek_public, ec.EllipticCurvePublicKey):
        size = _CURVE_SIZES.get(ek_public.curve.name)
        if size is None:
            raise CredentialError(f"unsupported EK curve {ek_public.curve.name}")
        ephemeral = ec.generate_private_key(ek_public.curve)
        z = ephemeral.exchange(ec.ECDH(), ek_public)
        eph = ephemeral.public_key().public_numbers()
        ek_x = _ecc_coord(ek_public.public_numbers().x, size)
        eph_x, eph_y = _ecc_coord(eph.x, size), _ecc_coord(eph.y, size)
        seed = kdfe(hash_alg, z, b"IDENTITY", eph_x, ek_x, HASH_SIZES[hash_alg] * 8)
        enc_seed = tpm2b(eph_x) + tpm2b(eph_y)
    else:
        raise CredentialError(f"unsupported EK key type {type(ek_public).__name__}")
    return Credential(credential_blob=_wrap(hash_alg, seed, name, secret), encrypted_secret=tpm2b(enc_seed))


def activate_credential(
    ek_private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, name: bytes, credential: Credential
) -> bytes:
    """Recover the secret with an EK private key held in software (simulated TPMs only)."""
    hash_alg = _name_alg(name)
    try:
        reader = Reader(credential.encrypted_secret, "TPM2B_ENCRYPTED_SECRET")
        enc_seed = reader.tpm2b("secret", 1024)
        reader.done()
        reader = Reader(credential.credential_blob, "TPM2B_ID_OBJECT")
        id_object = reader.tpm2b("credential", 1024)
        reader.done()
        inner = Reader(id_object, "TPM2B_ID_OBJECT contents")
        integrity = inner.tpm2b("integrityHMAC", 64)
        enc_identity = id_object[inner.offset :]
    except TpmStructureError as exc:
        raise CredentialError(str(exc)) from exc
    if isinstance(ek_private, rsa.RSAPrivateKey):
        try:
            seed = ek_private.decrypt(
                enc_seed,
                padding.OAEP(
                    mgf=padding.MGF1(_CRYPTO_HASHES[hash_alg]()),
                    algorithm=_CRYPTO_HASHES[hash_alg](),
                    label=b"IDENTITY\x00",
                ),
            )
        except ValueError as exc:
            raise CredentialError("the encrypted seed does not decrypt with this EK") from exc
    else:
        size = _CURVE_SIZES[ek_private.curve.name]
        point = Reader(enc_seed, "TPMS_ECC_POINT")
        eph_x, eph_y = point.tpm2b("x", 128), point.tpm2b("y", 128)
        point.done()
        eph = ec.EllipticCurvePublicNumbers(
            int.from_bytes(eph_x, "big"), int.from_bytes(eph_y, "big"), ek_private.curve
        ).public_key()
        z = ek_private.exchange(ec.ECDH(), eph)
        ek_x = _ecc_coord(ek_private.public_key().public_numbers().x, size)
        seed = kdfe(hash_alg, z, b"IDENTITY", eph_x, ek_x, HASH_SIZES[hash_alg] * 8)
    hmac_key = kdfa(hash_alg, seed, b"INTEGRITY", b"", b"", HASH_SIZES[hash_alg] * 8)
    expected = hmac.new(hmac_key, enc_identity + name, _hash_name(hash_alg)).digest()
    if not hmac.compare_digest(expected, integrity):
        raise CredentialError("credential integrity check failed (wrong AK name or EK)")
    sym_key = kdfa(hash_alg, seed, b"STORAGE", name, b"", SYM_KEY_BITS)
    plain = _aes_cfb(sym_key, enc_identity, decrypt=True)
    inner_secret = Reader(plain, "encIdentity")
    secret = inner_secret.tpm2b("secret", 64)
    inner_secret.done()
    return secret
