"""DSSE: the pre-authentication encoding, signing and verifying with both key kinds, and key handling."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from imagebuilder.errors import KeyFileError, OutputError, VerificationError
from imagebuilder.sign import (
    PASSPHRASE_ENV,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
    pae,
    sign_build,
    sign_envelope,
    verify_envelope,
)
from imagebuilder.trust import write_trust_outputs
from tests.imagetrust.conftest import KeyFiles

# --- the pre-authentication encoding, from the DSSE v1 protocol's definition --------------------------


def test_pae_known_answer_from_the_dsse_spec() -> None:
    # protocol.md: PAE("http://example.com/HelloWorld", "hello world")
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_pae_edge_cases() -> None:
    assert pae("", b"") == b"DSSEv1 0  0 "
    # Lengths count bytes, not characters, and are decimal without leading zeros.
    assert pae("t\u00e9", b"\x00\xff") == b"DSSEv1 3 t\xc3\xa9 2 \x00\xff"
    assert pae("application/vnd.in-toto+json", b"x" * 1000).startswith(
        b"DSSEv1 28 application/vnd.in-toto+json 1000 x"
    )


# --- signing and verifying --------------------------------------------------------------------------


def _keys(kind: str) -> tuple[ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey, bytes]:
    private_pem, public_pem = generate_keypair(kind)
    key = serialization.load_pem_private_key(private_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey)
    return key, public_pem


def test_sign_and_verify_round_trip(key_kind: str) -> None:
    key, _ = _keys(key_kind)
    envelope = sign_envelope("application/example", b'{"a":1}', key)
    assert envelope["payloadType"] == "application/example"
    assert base64.b64decode(envelope["payload"]) == b'{"a":1}'
    [signature] = envelope["signatures"]
    assert signature["keyid"] == key_id(key.public_key())
    raw = base64.b64decode(signature["sig"])
    if key_kind == "ed25519":
        assert len(raw) == 64
    else:
        decode_dss_signature(raw)  # ASN.1 DER, as the DSSE ECDSA convention and openssl expect
    assert verify_envelope(envelope, key.public_key()) == b'{"a":1}'
    assert verify_envelope(envelope, key.public_key(), payload_type="application/example") == b'{"a":1}'


def test_the_signature_is_over_the_pae(key_kind: str) -> None:
    key, _ = _keys(key_kind)
    envelope = sign_envelope("text/plain", b"hello", key)
    raw = base64.b64decode(envelope["signatures"][0]["sig"])
    public = key.public_key()
    if isinstance(public, ed25519.Ed25519PublicKey):
        public.verify(raw, b"DSSEv1 10 text/plain 5 hello")
    else:
        from cryptography.hazmat.primitives import hashes

        public.verify(raw, b"DSSEv1 10 text/plain 5 hello", ec.ECDSA(hashes.SHA256()))


def test_a_changed_payload_or_type_does_not_verify(key_kind: str) -> None:
    key, _ = _keys(key_kind)
    envelope = sign_envelope("text/plain", b"hello", key)
    kid = key_id(key.public_key())
    changed = {**envelope, "payload": base64.b64encode(b"hellO").decode()}
    with pytest.raises(VerificationError, match=f"the signature by key {kid} does not verify"):
        verify_envelope(changed, key.public_key())
    retyped = {**envelope, "payloadType": "text/html"}
    with pytest.raises(VerificationError, match="does not verify"):
        verify_envelope(retyped, key.public_key())
    with pytest.raises(VerificationError, match="payloadType is 'text/plain', expected 'text/html'"):
        verify_envelope(envelope, key.public_key(), payload_type="text/html")


def test_another_key_does_not_verify(key_kind: str) -> None:
    key, _ = _keys(key_kind)
    other, _ = _keys("ed25519" if key_kind == "ecdsa-p256" else "ecdsa-p256")
    envelope = sign_envelope("text/plain", b"hello", key)
    with pytest.raises(VerificationError) as info:
        verify_envelope(envelope, other.public_key())
    assert info.value.message == (
        f"not signed by key {key_id(other.public_key())} (the envelope names {key_id(key.public_key())})"
    )


def test_the_keyid_is_only_a_hint(key_kind: str) -> None:
    key, _ = _keys(key_kind)
    envelope = sign_envelope("text/plain", b"hello", key)
    envelope["signatures"] = [
        {"keyid": "not-this-one", "sig": base64.b64encode(b"\x00" * 64).decode()},
        {"keyid": "", "sig": envelope["signatures"][0]["sig"]},
    ]
    assert verify_envelope(envelope, key.public_key()) == b"hello"


def test_url_safe_unpadded_base64_is_accepted() -> None:
    key, _ = _keys("ed25519")
    payload = b"\xfb\xff\xfe" * 5  # encodes to '+' and '/' in standard base64
    envelope = sign_envelope("x", payload, key)
    envelope["payload"] = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    envelope["signatures"][0]["sig"] = base64.urlsafe_b64encode(
        base64.b64decode(envelope["signatures"][0]["sig"])
    ).decode()
    assert verify_envelope(envelope, key.public_key()) == payload


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        ([], "the envelope is not a JSON object"),
        ({"payload": "", "signatures": []}, "not a DSSE envelope"),
        (
            {"payloadType": "x", "payload": "!!", "signatures": [{"sig": "AA=="}]},
            "the payload is not valid base64",
        ),
        ({"payloadType": "x", "payload": "", "signatures": []}, "the envelope holds no signature"),
        (
            {"payloadType": "x", "payload": "", "signatures": [{"keyid": "k"}]},
            "a signature entry has no 'sig'",
        ),
        ({"payloadType": "x", "payload": "", "signatures": [{"sig": "%%"}]}, "the sig is not valid base64"),
    ],
)
def test_malformed_envelopes(envelope: object, message: str) -> None:
    key, _ = _keys("ed25519")
    with pytest.raises(VerificationError, match=message):
        verify_envelope(envelope, key.public_key())  # type: ignore[arg-type]


@pytest.mark.subprocess
def test_keyid_is_the_sha256_of_the_spki_der(tmp_path: Path, key_kind: str) -> None:
    """Computed independently with openssl, as a consumer would."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl is needed"
    _, public_pem = _keys(key_kind)
    (tmp_path / "k.pub").write_bytes(public_pem)
    der = subprocess.run(
        [openssl, "pkey", "-pubin", "-in", str(tmp_path / "k.pub"), "-outform", "DER"],
        check=True,
        capture_output=True,
        timeout=30,
    ).stdout
    assert key_id(load_public_key(tmp_path / "k.pub")) == hashlib.sha256(der).hexdigest()


# --- key files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o620])
def test_a_private_key_open_to_group_or_others_is_refused(
    make_keys: Callable[[str, str], KeyFiles], mode: int
) -> None:
    key, _ = make_keys("ecdsa-p256", "loose")
    key.chmod(mode)
    with pytest.raises(KeyFileError) as info:
        load_private_key(key)
    assert f"chmod 600 {key}" in info.value.message
    assert f"mode {mode:04o}" in info.value.message
    key.chmod(0o600)
    load_private_key(key)
    key.chmod(0o400)
    load_private_key(key)


def test_an_encrypted_key_needs_the_passphrase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    private_pem, _ = generate_keypair("ed25519", passphrase=b"correct horse")
    assert b"ENCRYPTED" in private_pem
    key = tmp_path / "enc.key"
    key.write_bytes(private_pem)
    key.chmod(0o600)
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    with pytest.raises(KeyFileError, match="encrypted and no passphrase was given") as info:
        load_private_key(key)
    assert info.value.hint == f"set {PASSPHRASE_ENV}"
    monkeypatch.setenv(PASSPHRASE_ENV, "wrong")
    with pytest.raises(KeyFileError, match="wrong passphrase"):
        load_private_key(key)
    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse")
    assert isinstance(load_private_key(key), ed25519.Ed25519PrivateKey)
    assert isinstance(load_private_key(key, passphrase=b"correct horse"), ed25519.Ed25519PrivateKey)


def test_a_passphrase_for_an_unencrypted_key_is_ignored(
    make_keys: Callable[[str, str], KeyFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _ = make_keys("ecdsa-p256", "plain")
    monkeypatch.setenv(PASSPHRASE_ENV, "unused")
    assert isinstance(load_private_key(key), ec.EllipticCurvePrivateKey)


@pytest.mark.parametrize(
    "make",
    [
        lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
        lambda: ec.generate_private_key(ec.SECP384R1()),
    ],
    ids=["rsa", "p384"],
)
def test_other_key_types_are_refused(tmp_path: Path, make: Callable[[], object]) -> None:
    private = make()
    key, pub = tmp_path / "other.key", tmp_path / "other.pub"
    key.write_bytes(
        private.private_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key.chmod(0o600)
    pub.write_bytes(
        private.public_key().public_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(KeyFileError, match="unsupported key type"):
        load_private_key(key)
    with pytest.raises(KeyFileError, match="unsupported key type"):
        load_public_key(pub)


def test_unreadable_or_wrong_key_files(tmp_path: Path, make_keys: Callable[[str, str], KeyFiles]) -> None:
    key, pub = make_keys("ed25519", "k")
    with pytest.raises(KeyFileError, match="cannot open the private key"):
        load_private_key(tmp_path / "absent.key")
    with pytest.raises(KeyFileError, match="cannot read the public key"):
        load_public_key(tmp_path / "absent.pub")
    pub.chmod(0o600)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_private_key(pub)
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        load_public_key(key)
    link = tmp_path / "link.key"  # as in a Kubernetes secret volume: the target's mode is what counts
    link.symlink_to(key)
    assert isinstance(load_private_key(link), ed25519.Ed25519PrivateKey)
    key.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_private_key(link)


def test_unknown_key_kind() -> None:
    with pytest.raises(KeyFileError, match="unknown key kind 'rsa'"):
        generate_keypair("rsa")


# --- signing a folder -------------------------------------------------------------------------------


def test_sign_build_refuses_a_file_changed_after_sha256sums(unsigned_build: Path, keys: KeyFiles) -> None:
    key, pub = keys
    write_trust_outputs(unsigned_build, key=None)
    sign_build(unsigned_build, key)
    envelope = json.loads((unsigned_build / "signature.dsse.json").read_text())
    assert envelope["signatures"][0]["keyid"] == key_id(load_public_key(pub))
    with (unsigned_build / "console.log").open("a") as fh:
        fh.write("late line\n")
    with pytest.raises(
        OutputError, match=r"console.log: sha256 mismatch \(SHA256SUMS says [0-9a-f]{64}, file is"
    ):
        sign_build(unsigned_build, key)
