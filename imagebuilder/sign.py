"""Keys and the build signature: one DSSE envelope (signature.dsse.json) over an in-toto Statement.

The signed payload (``payloadType: application/vnd.in-toto+json``) is an in-toto Statement v1 whose
``subject`` is ``SHA256SUMS`` and every file that ``SHA256SUMS`` lists, each with its sha256: the
manifest, the provenance, the SBOM, the image and the console log are all named, and since
``SHA256SUMS`` is itself a subject, one signature covers the whole folder. Its ``predicateType`` is
:data:`ATTESTATION_TYPE`. See docs/building-images.md, "Keys, signatures and verification".

Signing is over DSSE's pre-authentication encoding (:func:`pae`) with ECDSA P-256 (SHA-256, DER
signature) or Ed25519. A signature's ``keyid`` is the hex SHA-256 of the public key's
SubjectPublicKeyInfo DER; it is a hint only, never trusted.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from imagebuilder.buildfolder import (
    MANIFEST,
    PROVENANCE,
    SBOM,
    SHA256SUMS,
    SIGNATURE,
    digests_equal,
    dump_json,
    image_output,
    load_manifest_bytes,
    parse_sha256sums,
    sha256_bytes,
    sha256_file,
    write_atomic,
)
from imagebuilder.errors import KeyFileError, OutputError, VerificationError
from imagebuilder.provenance import STATEMENT_TYPE

log = logging.getLogger(__name__)

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

KEY_KINDS = ("ecdsa-p256", "ed25519")
PASSPHRASE_ENV = "IMAGEBUILDER_KEY_PASSPHRASE"  # noqa: S105 (the variable's name, not a secret)
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
ATTESTATION_TYPE = "https://nodetrust.dev/image-attestation/v1"


# --- keys -----------------------------------------------------------------------------------------


def generate_keypair(kind: str, *, passphrase: bytes | None = None) -> tuple[bytes, bytes]:
    """A new key pair as ``(private PEM (PKCS#8, encrypted when a passphrase is given), public PEM (SPKI))``."""
    private: PrivateKey
    if kind == "ecdsa-p256":
        private = ec.generate_private_key(ec.SECP256R1())
    elif kind == "ed25519":
        private = ed25519.Ed25519PrivateKey.generate()
    else:
        raise KeyFileError(f"unknown key kind {kind!r}; use one of {', '.join(KEY_KINDS)}")
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )
    return private_pem, public_pem(private.public_key())


def write_keypair(prefix: Path, kind: str, *, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """Write ``PREFIX.key`` (mode 0600) and ``PREFIX.pub`` (0644); refuse if either exists already."""
    key_path, pub_path = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    for path in (key_path, pub_path):
        if os.path.lexists(path):
            raise KeyFileError(
                f"{path}: already exists; refusing to overwrite a key", hint="choose another --out"
            )
    private_pem, pub_pem = generate_keypair(kind, passphrase=passphrase)
    written: list[Path] = []
    try:
        for path, data, mode in ((key_path, private_pem, 0o600), (pub_path, pub_pem, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            written.append(path)
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), mode)
                fh.write(data)
    except FileExistsError as exc:
        for path in written:
            path.unlink(missing_ok=True)
        raise KeyFileError(f"{exc.filename}: already exists; refusing to overwrite a key") from None
    except OSError as exc:
        for path in written:
            path.unlink(missing_ok=True)
        raise KeyFileError(f"{exc.filename or prefix}: cannot write the key: {exc.strerror}") from None
    log.info("wrote %s and %s (keyid %s)", key_path, pub_path, key_id(load_public_key(pub_path)))
    return key_path, pub_path


def public_pem(key: PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: PublicKey) -> str:
    """Hex SHA-256 of the public key's SubjectPublicKeyInfo DER."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return sha256_bytes(der)


def key_kind(key: PublicKey | PrivateKey) -> str:
    return (
        "ed25519" if isinstance(key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey) else "ecdsa-p256"
    )


def load_private_key(path: Path, *, passphrase: bytes | None = None) -> PrivateKey:
    """Read a PEM private key that only its owner may read or write.

    The passphrase of an encrypted key is ``passphrase`` or, when None, the environment variable
    ``IMAGEBUILDER_KEY_PASSPHRASE``. A passphrase given for an unencrypted key is ignored.
    """
    try:
        fd = os.open(path, os.O_RDONLY)  # a symlink is fine (secret mounts); the target's mode counts
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot open the private key: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise KeyFileError(f"{path}: the private key is not a regular file")
        if mode & 0o077:
            raise KeyFileError(
                f"{path}: private key is accessible to group or others (mode {stat.S_IMODE(mode):04o}); "
                f"run `chmod 600 {path}`",
                hint=f"chmod 600 {path}",
            )
        data = fh.read()
    if passphrase is None:
        env = os.environ.get(PASSPHRASE_ENV)
        passphrase = env.encode("utf-8") if env else None
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:
        if passphrase is None:
            raise KeyFileError(
                f"{path}: the private key is encrypted and no passphrase was given",
                hint=f"set {PASSPHRASE_ENV}",
            ) from None
        key = _load_unencrypted(path, data)
    except (ValueError, UnsupportedAlgorithm):
        reason = "wrong passphrase, or not a PEM private key" if passphrase else "not a PEM private key"
        raise KeyFileError(f"{path}: cannot read the private key ({reason})") from None
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise KeyFileError(f"{path}: unsupported key type {_describe(key)}; use ECDSA P-256 or Ed25519")


def _load_unencrypted(path: Path, data: bytes) -> Any:
    log.debug("%s is not encrypted; ignoring %s", path, PASSPHRASE_ENV)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path}: cannot read the private key (not a PEM private key)") from None


def load_public_key(path: Path) -> PublicKey:
    """Read a PEM SubjectPublicKeyInfo public key (ECDSA P-256 or Ed25519)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the public key: {exc.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path}: not a PEM public key (SubjectPublicKeyInfo)") from None
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise KeyFileError(f"{path}: unsupported key type {_describe(key)}; use ECDSA P-256 or Ed25519")


def _describe(key: object) -> str:
    curve = getattr(key, "curve", None)
    return f"{type(key).__name__}({curve.name})" if curve is not None else type(key).__name__


# --- DSSE -----------------------------------------------------------------------------------------


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``,
    lengths as ASCII decimal byte counts (the type is UTF-8)."""
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(payload), payload)


def sign_envelope(payload_type: str, payload: bytes, private_key: PrivateKey) -> dict[str, Any]:
    """A DSSE envelope with one signature by ``private_key``."""
    message = pae(payload_type, payload)
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        signature = private_key.sign(message)
    else:
        signature = private_key.sign(message, ec.ECDSA(hashes.SHA256()))
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [
            {"keyid": key_id(private_key.public_key()), "sig": base64.b64encode(signature).decode("ascii")}
        ],
    }


def verify_envelope(
    envelope: Mapping[str, Any], public_key: PublicKey, *, payload_type: str | None = None
) -> bytes:
    """Return the payload of ``envelope`` if one of its signatures verifies with ``public_key``.

    Every signature is tried whatever its ``keyid`` says (the keyid is not signed). With
    ``payload_type``, any other payload type is refused. Raises VerificationError saying why.
    """
    if not isinstance(envelope, Mapping):
        raise VerificationError("the envelope is not a JSON object")
    kind, body, signatures = envelope.get("payloadType"), envelope.get("payload"), envelope.get("signatures")
    if not isinstance(kind, str) or not isinstance(body, str) or not isinstance(signatures, list):
        raise VerificationError("not a DSSE envelope (payloadType, payload and signatures are required)")
    if payload_type is not None and kind != payload_type:
        raise VerificationError(f"payloadType is {kind!r}, expected {payload_type!r}")
    payload = _b64decode(body, "payload")
    if not signatures:
        raise VerificationError("the envelope holds no signature")
    message = pae(kind, payload)
    wanted = key_id(public_key)
    named: list[str] = []
    for entry in signatures:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sig"), str):
            raise VerificationError("a signature entry has no 'sig' string")
        keyid = entry.get("keyid")
        named.append(keyid if isinstance(keyid, str) and keyid else "(no keyid)")
        if _verifies(public_key, _b64decode(entry["sig"], "sig"), message):
            return payload
    if any(digests_equal(name, wanted) for name in named):
        raise VerificationError(
            f"the signature by key {wanted} does not verify (the payload or the signature was changed)"
        )
    raise VerificationError(f"not signed by key {wanted} (the envelope names {', '.join(named)})")


def _verifies(public_key: PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, message)
        else:
            public_key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def _b64decode(text: str, what: str) -> bytes:
    """DSSE allows standard and URL-safe base64; padding may be left out."""
    padded = text + "=" * (-len(text) % 4)
    alphabet = b"-_" if ("-" in text or "_" in text) else None
    try:
        return base64.b64decode(padded, altchars=alphabet, validate=True)
    except (binascii.Error, ValueError):
        raise VerificationError(f"the {what} is not valid base64") from None


# --- the build signature --------------------------------------------------------------------------


def make_attestation(build_id: str, image_name: str, digests: Mapping[str, str]) -> dict[str, Any]:
    """The in-toto Statement that signature.dsse.json signs: ``digests`` (file name -> hex sha256,
    SHA256SUMS and everything it lists) become the subjects, sorted by name."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digests[name]}} for name in sorted(digests)],
        "predicateType": ATTESTATION_TYPE,
        "predicate": {
            "buildId": build_id,
            "image": image_name,
            "manifest": MANIFEST,
            "provenance": PROVENANCE,
            "sbom": SBOM,
            "sha256sums": SHA256SUMS,
        },
    }


def sign_folder(build_dir: Path, private_key: PrivateKey, digests: Mapping[str, str]) -> None:
    """Write signature.dsse.json for a folder whose ``SHA256SUMS`` holds ``digests`` (already checked)."""
    sums = (build_dir / SHA256SUMS).read_bytes()
    if dict(digests) != parse_sha256sums(sums):
        raise OutputError(f"{SHA256SUMS}: does not hold the digests being signed")
    try:
        manifest = load_manifest_bytes((build_dir / MANIFEST).read_bytes())
    except ValueError as exc:
        raise OutputError(f"{MANIFEST}: {exc}") from None
    subjects = {**digests, SHA256SUMS: sha256_bytes(sums)}
    statement = make_attestation(str(manifest["build_id"]), str(image_output(manifest)["name"]), subjects)
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode("utf-8")
    envelope = sign_envelope(IN_TOTO_PAYLOAD_TYPE, payload, private_key)
    write_atomic(build_dir / SIGNATURE, dump_json(envelope))
    log.info("signed %s with key %s", build_dir, envelope["signatures"][0]["keyid"])


def sign_build(build_dir: Path, key_path: Path) -> None:
    """Sign a build folder that already holds its ``SHA256SUMS``: check every listed file against it
    (a signature must never vouch for a changed file), then write signature.dsse.json."""
    private_key = load_private_key(key_path)
    try:
        listed = parse_sha256sums((build_dir / SHA256SUMS).read_bytes())
    except OSError as exc:
        raise OutputError(f"{SHA256SUMS}: cannot read it: {exc.strerror}") from None
    except ValueError as exc:
        raise OutputError(f"{SHA256SUMS}: {exc}") from None
    for name, expected in listed.items():
        try:
            actual = sha256_file(build_dir / name)
        except OSError as exc:
            raise OutputError(f"{name}: listed in SHA256SUMS but cannot be read: {exc.strerror}") from None
        if not digests_equal(expected, actual):
            raise OutputError(f"{name}: sha256 mismatch (SHA256SUMS says {expected}, file is {actual})")
    sign_folder(build_dir, private_key, listed)
