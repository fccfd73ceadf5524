"""MakeCredential maths: software round trips, tamper detection, KDF vectors."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from protocol.credential import Credential, activate_credential, kdfa, make_credential
from protocol.errors import CredentialError

NAME = b"\x00\x0b" + bytes(range(32))


@pytest.mark.parametrize("alg", ["rsa", "ecc"])
def test_round_trip(alg: str) -> None:
    key = rsa.generate_private_key(65537, 2048) if alg == "rsa" else ec.generate_private_key(ec.SECP256R1())
    secret = os.urandom(32)
    cred = make_credential(key.public_key(), NAME, secret)
    assert activate_credential(key, NAME, cred) == secret
    if alg == "rsa":
        assert len(cred.encrypted_secret) == 258  # u16 + 256-byte OAEP ciphertext
    assert len(cred.credential_blob) == 2 + 2 + 32 + 34


def test_wrong_name_or_key_fails() -> None:
    key = rsa.generate_private_key(65537, 2048)
    other = rsa.generate_private_key(65537, 2048)
    cred = make_credential(key.public_key(), NAME, b"s" * 32)
    with pytest.raises(CredentialError, match="integrity"):
        activate_credential(key, b"\x00\x0b" + bytes(32), cred)
    with pytest.raises(CredentialError):
        activate_credential(other, NAME, cred)
    tampered = Credential(
        cred.credential_blob[:-1] + bytes([cred.credential_blob[-1] ^ 1]), cred.encrypted_secret
    )
    with pytest.raises(CredentialError, match="integrity"):
        activate_credential(key, NAME, tampered)


def test_bad_name_refused() -> None:
    key = rsa.generate_private_key(65537, 2048)
    with pytest.raises(CredentialError, match="wrong length"):
        make_credential(key.public_key(), b"\x00\x0b\x01", b"s")


def test_kdfa_matches_sp800_108_definition() -> None:
    import hashlib
    import hmac

    key, label, u, v = b"k" * 32, b"STORAGE", b"ctx-u", b"ctx-v"
    block1 = hmac.new(
        key, b"\x00\x00\x00\x01" + label + b"\x00" + u + v + (384).to_bytes(4, "big"), hashlib.sha256
    ).digest()
    block2 = hmac.new(
        key, b"\x00\x00\x00\x02" + label + b"\x00" + u + v + (384).to_bytes(4, "big"), hashlib.sha256
    ).digest()
    assert kdfa(0x000B, key, label, u, v, 384) == (block1 + block2)[:48]
