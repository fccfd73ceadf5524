"""imagebuilder verify: a good folder passes; every tampering names the first file that does not match."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from imagebuilder.buildfolder import format_sha256sums
from imagebuilder.cli import main
from imagebuilder.errors import FolderMismatch
from imagebuilder.provenance import make_provenance
from imagebuilder.sbom import make_sbom
from imagebuilder.sign import (
    IN_TOTO_PAYLOAD_TYPE,
    key_id,
    load_private_key,
    load_public_key,
    sign_envelope,
    sign_folder,
)
from imagebuilder.trust import write_trust_outputs
from imagebuilder.verify import verify_build
from tests.imagetrust.conftest import BUILD_ID, IMAGE, PACKAGES, KeyFiles, file_sha256, write_manifest

SIGNATURE = "signature.dsse.json"


@pytest.fixture
def build(unsigned_build: Path, keys: KeyFiles) -> Path:
    write_trust_outputs(unsigned_build, key=keys[0])
    return unsigned_build


def _fails(build: Path, pub: Path) -> FolderMismatch:
    with pytest.raises(FolderMismatch) as info:
        verify_build(build, load_public_key(pub))
    return info.value


def _keyid(pub: Path) -> str:
    return key_id(load_public_key(pub))


def _flip(path: Path, offset: int, xor: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= xor
    path.write_bytes(bytes(data))


# --- a good folder -----------------------------------------------------------------------------------


def test_a_good_folder_verifies(
    build: Path, keys: KeyFiles, key_kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, pub = keys
    result = verify_build(build, load_public_key(pub))
    assert result.build_id == BUILD_ID
    assert result.image == IMAGE
    assert result.image_sha256 == file_sha256(build / IMAGE)
    assert result.signer_keyid == _keyid(pub)
    assert result.signer_kind == key_kind
    assert result.packages == len(PACKAGES)
    assert result.files == 7

    assert main(["verify", str(build), "--key", str(pub)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"OK {BUILD_ID}: 7 files verified",
        f"image     {IMAGE} sha256:{result.image_sha256}",
        f"signer    {_keyid(pub)} ({key_kind})",
        f"packages  {len(PACKAGES)} installed, 5 inputs",
    ]


def test_json_output(build: Path, keys: KeyFiles, capsys: pytest.CaptureFixture[str]) -> None:
    _, pub = keys
    assert main(["verify", str(build), "--key", str(pub), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["image_sha256"] == file_sha256(build / IMAGE)
    assert report["signer_keyid"] == _keyid(pub)
    assert report["packages"] == len(PACKAGES)

    (build / "extra.bin").write_bytes(b"x")
    assert main(["verify", str(build), "--key", str(pub), "--json"]) == 5
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "ok": False,
        "file": "extra.bin",
        "reason": "not listed in SHA256SUMS",
        "error": "extra.bin: not listed in SHA256SUMS",
        "exit_code": 5,
    }


def test_a_failure_is_one_line_on_stderr_and_exit_status_5(
    build: Path, keys: KeyFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip(build / IMAGE, 0)
    assert main(["verify", str(build), "--key", str(keys[1])]) == 5
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"imagebuilder: error: {IMAGE}: sha256 mismatch (SHA256SUMS says ")


# --- one flipped byte in each file -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [IMAGE, "manifest.json", "sbom.spdx.json", "provenance.intoto.json", "console.log"]
)
def test_a_flipped_byte_in_a_listed_file_names_that_file(build: Path, keys: KeyFiles, name: str) -> None:
    path = build / name
    listed = file_sha256(path)
    _flip(path, path.stat().st_size // 2)
    error = _fails(build, keys[1])
    assert error.path == name
    assert (
        error.message == f"{name}: sha256 mismatch (SHA256SUMS says {listed}, file is {file_sha256(path)})"
    )


def test_a_flipped_digit_in_sha256sums_names_the_file_of_that_line(build: Path, keys: KeyFiles) -> None:
    sums = build / "SHA256SUMS"
    first_line = sums.read_text().splitlines()[0]
    assert first_line.endswith("  console.log")  # lines are sorted by name
    offset = next(i for i, c in enumerate(first_line) if c.isdigit())  # a digit XOR 1 is still a digit
    _flip(sums, offset)
    claimed = sums.read_text().splitlines()[0].split("  ")[0]
    error = _fails(build, keys[1])
    assert error.message == (
        f"console.log: sha256 mismatch (SHA256SUMS says {claimed}, file is {file_sha256(build / 'console.log')})"
    )


def test_a_flipped_letter_in_a_sha256sums_name_names_the_unknown_file(build: Path, keys: KeyFiles) -> None:
    sums = build / "SHA256SUMS"
    _flip(sums, 66, 0x20)  # "console.log" -> "Console.log"; sorts before every real file
    error = _fails(build, keys[1])
    assert error.message == "Console.log: listed in SHA256SUMS but missing from the folder"


def test_a_flipped_byte_that_breaks_a_sha256sums_line_names_sha256sums(build: Path, keys: KeyFiles) -> None:
    sums = build / "SHA256SUMS"
    _flip(sums, 64, 0x01)  # the first of the two spaces becomes '!'
    error = _fails(build, keys[1])
    assert error.message == "SHA256SUMS: line 1 is not '<lower-case hex sha256>  <file name>'"


def test_a_flipped_byte_in_the_signature_names_the_signature(build: Path, keys: KeyFiles) -> None:
    path = build / SIGNATURE
    text = path.read_text()
    sig = json.loads(text)["signatures"][0]["sig"]
    start = text.index(sig)
    middle = len(sig) // 2
    offset = start + next(
        i for i in range(middle, len(sig)) if sig[i] in "BCDEFGHIJKLMNOPQRSTUVWXYbcdefghijklmnopqrstuvwxy"
    )
    _flip(path, offset)
    error = _fails(build, keys[1])
    assert error.message == (
        f"{SIGNATURE}: the signature by key {_keyid(keys[1])} does not verify (the payload or the signature was changed)"
    )


def test_a_flipped_byte_in_the_signed_payload_names_the_signature(build: Path, keys: KeyFiles) -> None:
    path = build / SIGNATURE
    envelope = json.loads(path.read_text())
    payload = bytearray(base64.b64decode(envelope["payload"]))
    payload[len(payload) // 2] ^= 0x01
    envelope["payload"] = base64.b64encode(bytes(payload)).decode()
    path.write_text(json.dumps(envelope))
    error = _fails(build, keys[1])
    assert error.message == (
        f"{SIGNATURE}: the signature by key {_keyid(keys[1])} does not verify (the payload or the signature was changed)"
    )


def test_a_flipped_byte_that_breaks_the_signature_json_names_the_signature(
    build: Path, keys: KeyFiles
) -> None:
    _flip(build / SIGNATURE, 0, 0x40)  # '{' -> ';'
    error = _fails(build, keys[1])
    assert error.path == SIGNATURE
    assert error.reason.startswith("not valid UTF-8 JSON")


# --- keys --------------------------------------------------------------------------------------------


def test_the_wrong_public_key_fails(
    build: Path, keys: KeyFiles, make_keys: Callable[[str, str], KeyFiles]
) -> None:
    for kind in ("ecdsa-p256", "ed25519"):
        _, other = make_keys(kind, f"other-{kind}")
        error = _fails(build, other)
        assert (
            error.message
            == f"{SIGNATURE}: not signed by key {_keyid(other)} (the envelope names {_keyid(keys[1])})"
        )


def test_a_public_key_is_required_on_the_command_line(build: Path) -> None:
    with pytest.raises(SystemExit):
        main(["verify", str(build)])


# --- extra and missing files -------------------------------------------------------------------------


def test_an_extra_unlisted_file_fails(build: Path, keys: KeyFiles) -> None:
    (build / "zz-extra.txt").write_text("smuggled\n")
    assert _fails(build, keys[1]).message == "zz-extra.txt: not listed in SHA256SUMS"


def test_an_extra_file_added_to_sha256sums_fails_at_the_manifest(build: Path, keys: KeyFiles) -> None:
    (build / "zz-extra.txt").write_text("smuggled\n")
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == "zz-extra.txt: not listed in manifest.json outputs"


def test_a_symlink_fails(build: Path, keys: KeyFiles) -> None:
    (build / "link.log").symlink_to(build / "console.log")
    assert _fails(build, keys[1]).message == "link.log: is a symlink, not a regular file"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("console.log", "console.log: listed in SHA256SUMS but missing from the folder"),
        (IMAGE, f"{IMAGE}: listed in SHA256SUMS but missing from the folder"),
        ("manifest.json", "manifest.json: listed in SHA256SUMS but missing from the folder"),
        ("SHA256SUMS", "SHA256SUMS: missing"),
        (SIGNATURE, f"{SIGNATURE}: missing: the build was not signed"),
    ],
)
def test_a_missing_file_fails(build: Path, keys: KeyFiles, name: str, message: str) -> None:
    (build / name).unlink()
    assert _fails(build, keys[1]).message == message


def test_an_unsigned_build_verifies_only_without_a_key(unsigned_build: Path, keys: KeyFiles) -> None:
    write_trust_outputs(unsigned_build, key=None)
    assert verify_build(unsigned_build, None).signer_keyid is None
    assert _fails(unsigned_build, keys[1]).message == f"{SIGNATURE}: missing: the build was not signed"


# --- an attacker who rewrites more and more of the folder, but has not got the key ---------------------


def _rewrite_sums(build: Path) -> None:
    names = [p.name for p in build.iterdir() if p.name not in {"SHA256SUMS", SIGNATURE}]
    (build / "SHA256SUMS").write_bytes(format_sha256sums({n: file_sha256(build / n) for n in names}))


def _manifest(build: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((build / "manifest.json").read_text())
    return manifest


def test_each_layer_catches_a_consistent_forgery(
    build: Path, keys: KeyFiles, make_keys: Callable[[str, str], KeyFiles], key_kind: str
) -> None:
    _, pub = keys
    old_image = file_sha256(build / IMAGE)
    with (build / IMAGE).open("ab") as fh:
        fh.write(b"backdoor")
    new_image = file_sha256(build / IMAGE)

    # 1. SHA256SUMS recomputed: the manifest still holds the real digest.
    _rewrite_sums(build)
    assert _fails(build, pub).message == (
        f"{IMAGE}: sha256 mismatch (manifest.json says {old_image}, file is {new_image})"
    )

    # 2. The manifest's outputs updated too: the SBOM still describes the real image.
    manifest = _manifest(build)
    image = next(o for o in manifest["outputs"] if o["name"] == IMAGE)
    image.update(sha256=new_image, size=(build / IMAGE).stat().st_size)
    write_manifest(build, manifest)
    _rewrite_sums(build)
    assert _fails(build, pub).message == (
        f"sbom.spdx.json: root package checksum {old_image} does not equal the image digest {new_image} ({IMAGE})"
    )

    # 3. The SBOM regenerated: the provenance still names the real image.
    (build / "sbom.spdx.json").write_text(json.dumps(make_sbom(manifest, created="2026-11-30T09:00:00Z")))
    _rewrite_sums(build)
    assert _fails(build, pub).message == (
        f"provenance.intoto.json: subject {IMAGE} sha256 {old_image} does not equal the image digest {new_image}"
    )

    # 4. The provenance regenerated: the signature still covers the real SHA256SUMS (which sorts first).
    (build / "provenance.intoto.json").write_text(json.dumps(make_provenance(manifest)))
    _rewrite_sums(build)
    signed = json.loads(base64.b64decode(json.loads((build / SIGNATURE).read_text())["payload"]))
    signed_sums = next(s["digest"]["sha256"] for s in signed["subject"] if s["name"] == "SHA256SUMS")
    assert _fails(build, pub).message == (
        f"SHA256SUMS: sha256 mismatch ({SIGNATURE} says {signed_sums}, file is {file_sha256(build / 'SHA256SUMS')})"
    )

    # 5. Re-signed with the attacker's own key: not the key the consumer trusts.
    attacker_key, attacker_pub = make_keys(key_kind, "attacker")
    digests = {p.name: file_sha256(p) for p in build.iterdir() if p.name not in {"SHA256SUMS", SIGNATURE}}
    sign_folder(build, load_private_key(attacker_key), digests)
    assert _fails(build, pub).message == (
        f"{SIGNATURE}: not signed by key {_keyid(pub)} (the envelope names {_keyid(attacker_pub)})"
    )
    verify_build(
        build, load_public_key(attacker_pub)
    )  # ...and it is a perfectly good build of the attacker's


def test_a_signature_made_for_other_contents_fails(build: Path, keys: KeyFiles) -> None:
    # Same folder, but a signature made for a different console.log: the payload does not cover this one.
    key, pub = keys
    original = (build / SIGNATURE).read_bytes()
    (build / "console.log").write_text("another run\n")
    manifest = _manifest(build)
    log = next(o for o in manifest["outputs"] if o["name"] == "console.log")
    log.update(sha256=file_sha256(build / "console.log"), size=(build / "console.log").stat().st_size)
    write_manifest(build, manifest)
    write_trust_outputs(build, key=key)
    (build / SIGNATURE).write_bytes(original)
    error = _fails(build, pub)
    assert error.path == "SHA256SUMS"
    assert error.reason.startswith(f"sha256 mismatch ({SIGNATURE} says ")


def test_the_signed_statement_must_cover_every_file(build: Path, keys: KeyFiles) -> None:
    key, pub = keys
    digests = {p.name: file_sha256(p) for p in build.iterdir() if p.name not in {"SHA256SUMS", SIGNATURE}}
    sign_folder(build, load_private_key(key), digests)
    envelope = json.loads((build / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["subject"] = [s for s in statement["subject"] if s["name"] != "console.log"]
    payload = json.dumps(statement).encode()
    (build / SIGNATURE).write_text(
        json.dumps(sign_envelope(IN_TOTO_PAYLOAD_TYPE, payload, load_private_key(key)))
    )
    assert _fails(build, pub).message == f"{SIGNATURE}: the signed statement does not cover console.log"


# --- hostile or broken metadata ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "sub/dir.txt", ".", "a\\b"])
def test_sha256sums_may_name_only_plain_files_of_the_folder(build: Path, keys: KeyFiles, name: str) -> None:
    with (build / "SHA256SUMS").open("a") as fh:
        fh.write(f"{'0' * 64}  {name}\n")
    error = _fails(build, keys[1])
    assert error.message == (
        f"SHA256SUMS: line 6 names {name!r}, which is not a plain file name of this folder"
    )


def test_sha256sums_may_not_list_the_signature(build: Path, keys: KeyFiles) -> None:
    with (build / "SHA256SUMS").open("a") as fh:
        fh.write(f"{file_sha256(build / SIGNATURE)}  {SIGNATURE}\n")
    assert _fails(build, keys[1]).message == f"SHA256SUMS: lists {SIGNATURE}, which it must not cover"


def test_a_broken_manifest_behind_a_consistent_sha256sums(build: Path, keys: KeyFiles) -> None:
    (build / "manifest.json").write_text("[]\n")
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == "manifest.json: is not a JSON object"
    manifest_text = json.dumps({"build_id": "../x"})
    (build / "manifest.json").write_text(manifest_text)
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == (
        "manifest.json: build_id may hold only letters, digits, '.', '_' and '-'"
    )


def test_a_size_that_does_not_match_the_manifest(build: Path, keys: KeyFiles) -> None:
    manifest = _manifest(build)
    log = next(o for o in manifest["outputs"] if o["name"] == "console.log")
    real = log["size"]
    log["size"] = real + 1
    write_manifest(build, manifest)
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == (
        f"console.log: size mismatch (manifest.json says {real + 1} bytes, file is {real} bytes)"
    )


def test_an_sbom_without_a_described_root(build: Path, keys: KeyFiles) -> None:
    sbom = json.loads((build / "sbom.spdx.json").read_text())
    sbom["relationships"] = [r for r in sbom["relationships"] if r["relationshipType"] != "DESCRIBES"]
    (build / "sbom.spdx.json").write_text(json.dumps(sbom))
    _rewrite_sums(build)
    assert (
        _fails(build, keys[1]).message
        == "sbom.spdx.json: no single package is DESCRIBED by SPDXRef-DOCUMENT"
    )


def test_provenance_of_another_build(build: Path, keys: KeyFiles) -> None:
    provenance = json.loads((build / "provenance.intoto.json").read_text())
    provenance["predicate"]["runDetails"]["metadata"]["invocationId"] = "some-other-build"
    (build / "provenance.intoto.json").write_text(json.dumps(provenance))
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == (
        f"provenance.intoto.json: invocationId 'some-other-build' is not the manifest's build_id '{BUILD_ID}'"
    )


def test_a_provenance_byproduct_that_does_not_match(build: Path, keys: KeyFiles) -> None:
    provenance = json.loads((build / "provenance.intoto.json").read_text())
    provenance["predicate"]["runDetails"]["byproducts"][0]["digest"]["sha256"] = "0" * 64
    (build / "provenance.intoto.json").write_text(json.dumps(provenance))
    _rewrite_sums(build)
    assert _fails(build, keys[1]).message == (
        f"provenance.intoto.json: byproduct console.log sha256 {'0' * 64} does not equal the file's "
        f"{file_sha256(build / 'console.log')}"
    )
