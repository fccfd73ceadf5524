"""write_trust_outputs: what it writes, what SHA256SUMS covers, and what it refuses."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from imagebuilder.errors import KeyFileError, OutputError
from imagebuilder.sign import load_public_key
from imagebuilder.trust import write_trust_outputs
from imagebuilder.verify import verify_build
from tests.imagetrust.conftest import IMAGE, KeyFiles, file_sha256, make_manifest, write_manifest

TRUST = ["SHA256SUMS", "provenance.intoto.json", "sbom.spdx.json", "signature.dsse.json"]


def test_writes_every_trust_output(unsigned_build: Path, keys: KeyFiles) -> None:
    key, pub = keys
    write_trust_outputs(unsigned_build, key=key)
    assert sorted(p.name for p in unsigned_build.iterdir()) == sorted(
        [IMAGE, "console.log", "manifest.json", *TRUST]
    )
    result = verify_build(unsigned_build, load_public_key(pub))
    assert result.image == IMAGE


def test_sha256sums_covers_every_file_but_itself_and_the_signature(
    unsigned_build: Path, keys: KeyFiles
) -> None:
    write_trust_outputs(unsigned_build, key=keys[0])
    lines = (unsigned_build / "SHA256SUMS").read_text().splitlines()
    names = [line.split("  ", 1)[1] for line in lines]
    assert names == sorted(
        ["console.log", "manifest.json", IMAGE, "provenance.intoto.json", "sbom.spdx.json"]
    )
    for line in lines:
        digest, name = line.split("  ", 1)
        assert digest == file_sha256(unsigned_build / name)


@pytest.mark.subprocess
def test_sha256sums_is_what_coreutils_checks(unsigned_build: Path) -> None:
    write_trust_outputs(unsigned_build, key=None)
    sha256sum = shutil.which("sha256sum")
    assert sha256sum is not None
    done = subprocess.run(
        [sha256sum, "--check", "--strict", "SHA256SUMS"],
        check=False,
        cwd=unsigned_build,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": OK") == 5


def test_without_a_key_there_is_no_signature_and_a_stale_one_goes(
    unsigned_build: Path, keys: KeyFiles
) -> None:
    write_trust_outputs(unsigned_build, key=keys[0])
    assert (unsigned_build / "signature.dsse.json").exists()
    write_trust_outputs(unsigned_build, key=None)
    assert not (unsigned_build / "signature.dsse.json").exists()
    assert verify_build(unsigned_build, None).signer_keyid is None


def test_rewriting_replaces_the_trust_outputs(unsigned_build: Path, keys: KeyFiles) -> None:
    write_trust_outputs(unsigned_build, key=keys[0])
    first = json.loads((unsigned_build / "sbom.spdx.json").read_text())["documentNamespace"]
    write_trust_outputs(unsigned_build, key=keys[0])
    second = json.loads((unsigned_build / "sbom.spdx.json").read_text())["documentNamespace"]
    assert first != second
    verify_build(unsigned_build, load_public_key(keys[1]))


def test_created_comes_from_source_date_epoch(unsigned_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796026870")
    write_trust_outputs(unsigned_build, key=None)
    sbom = json.loads((unsigned_build / "sbom.spdx.json").read_text())
    assert sbom["creationInfo"]["created"] == "2026-11-30T08:21:10Z"
    write_trust_outputs(unsigned_build, key=None, created="2026-12-01T00:00:00Z")
    sbom = json.loads((unsigned_build / "sbom.spdx.json").read_text())
    assert sbom["creationInfo"]["created"] == "2026-12-01T00:00:00Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(OutputError, match="SOURCE_DATE_EPOCH"):
        write_trust_outputs(unsigned_build, key=None)


def test_a_bad_key_fails_before_anything_is_written(
    unsigned_build: Path, make_keys: Callable[[str, str], KeyFiles]
) -> None:
    key, _ = make_keys("ed25519", "loose")
    key.chmod(0o640)
    before = sorted(p.name for p in unsigned_build.iterdir())
    with pytest.raises(KeyFileError, match="chmod 600"):
        write_trust_outputs(unsigned_build, key=key)
    assert sorted(p.name for p in unsigned_build.iterdir()) == before


def test_the_folder_must_match_its_manifest(unsigned_build: Path) -> None:
    (unsigned_build / "console.log").write_text("changed after the manifest was written\n")
    with pytest.raises(
        OutputError, match=r"^console.log: sha256 mismatch \(manifest.json says [0-9a-f]{64}, file is"
    ):
        write_trust_outputs(unsigned_build, key=None)
    write_manifest(unsigned_build, make_manifest(unsigned_build))
    (unsigned_build / "stray.txt").write_text("x")
    with pytest.raises(
        OutputError, match=r"^stray.txt: in the folder but not listed in manifest.json outputs$"
    ):
        write_trust_outputs(unsigned_build, key=None)
    (unsigned_build / "stray.txt").unlink()
    (unsigned_build / "console.log").unlink()
    with pytest.raises(OutputError, match=r"^console.log: listed in manifest.json outputs but missing"):
        write_trust_outputs(unsigned_build, key=None)
    (unsigned_build / "console.log").mkdir()
    with pytest.raises(OutputError, match=r"^console.log: is a directory"):
        write_trust_outputs(unsigned_build, key=None)


def test_size_must_match_too(unsigned_build: Path) -> None:
    manifest = make_manifest(unsigned_build)
    manifest["outputs"][1]["size"] += 1
    write_manifest(unsigned_build, manifest)
    with pytest.raises(OutputError, match=r"^console.log: size mismatch"):
        write_trust_outputs(unsigned_build, key=None)


def test_a_missing_or_broken_manifest_is_refused(unsigned_build: Path, tmp_path: Path) -> None:
    (unsigned_build / "manifest.json").write_text("{not json")
    with pytest.raises(OutputError, match=r"^manifest.json: is not valid UTF-8 JSON"):
        write_trust_outputs(unsigned_build, key=None)
    (unsigned_build / "manifest.json").unlink()
    with pytest.raises(OutputError, match=r"^manifest.json: missing"):
        write_trust_outputs(unsigned_build, key=None)
    with pytest.raises(OutputError, match="not a directory"):
        write_trust_outputs(tmp_path / "nowhere", key=None)
