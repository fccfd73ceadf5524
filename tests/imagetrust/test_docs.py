"""docs/building-images.md stays true: its shell recipes verify a real build folder with openssl, jq and
coreutils alone (and reject a tampered one), and it states the facts the code relies on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from imagebuilder.sign import IN_TOTO_PAYLOAD_TYPE, PASSPHRASE_ENV, pae
from imagebuilder.trust import write_trust_outputs
from tests.imagetrust.conftest import IMAGE, KeyFiles

DOC = (Path(__file__).resolve().parents[2] / "docs" / "building-images.md").read_text()
SECTION = DOC[DOC.index("## Keys, signatures and verification") :]

pytestmark = pytest.mark.subprocess


def _script(name: str) -> str:
    match = re.search(rf"<!-- {re.escape(name)} -->\n```bash\n(.*?)```", SECTION, re.DOTALL)
    assert match is not None, f"{name} not found in docs/building-images.md"
    return match.group(1)


def _run(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    for tool in ("bash", "openssl", "jq", "sha256sum", "base64"):
        assert shutil.which(tool), f"{tool} is needed to run the documented recipe"
    return subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], "LC_ALL": "C.UTF-8", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def signed_build(unsigned_build: Path, keys: KeyFiles) -> Path:
    write_trust_outputs(unsigned_build, key=keys[0])
    return unsigned_build


def test_the_folder_recipe_verifies_a_good_build(signed_build: Path, keys: KeyFiles) -> None:
    done = _run(_script("verify-folder.sh"), signed_build, PUB=str(keys[1]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"verified: {signed_build.name}")


@pytest.mark.parametrize("name", [IMAGE, "manifest.json", "SHA256SUMS", "console.log"])
def test_the_folder_recipe_rejects_a_flipped_byte(signed_build: Path, keys: KeyFiles, name: str) -> None:
    path = signed_build / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    done = _run(_script("verify-folder.sh"), signed_build, PUB=str(keys[1]))
    assert done.returncode != 0
    assert f"{name}: FAILED" in done.stdout


def test_the_folder_recipe_rejects_another_key_and_an_extra_file(
    signed_build: Path, keys: KeyFiles, make_keys: Callable[[str, str], KeyFiles]
) -> None:
    _, other = make_keys("ed25519", "other")
    assert _run(_script("verify-folder.sh"), signed_build, PUB=str(other)).returncode != 0
    (signed_build / "extra.txt").write_text("x")
    done = _run(_script("verify-folder.sh"), signed_build, PUB=str(keys[1]))
    assert done.returncode != 0
    assert "extra.txt" in done.stdout


def test_the_image_recipe(signed_build: Path) -> None:
    script = _script("verify-image.sh")
    assert _run(script, signed_build, IMAGE=IMAGE).returncode == 0
    with (signed_build / IMAGE).open("ab") as fh:
        fh.write(b"\0")
    done = _run(script, signed_build, IMAGE=IMAGE)
    assert done.returncode != 0
    assert "not the image the signature names" in done.stderr


def test_the_documented_facts() -> None:
    assert "DSSEv1 29 http://example.com/HelloWorld 11 hello world" in SECTION
    assert pae("http://example.com/HelloWorld", b"hello world").decode() in SECTION
    assert f"`{pae(IN_TOTO_PAYLOAD_TYPE, b'').decode().rsplit(' 0 ', 1)[0]} <n> `" in SECTION
    assert PASSPHRASE_ENV in SECTION
    assert "chmod 600" in SECTION
    for heading in (
        "### Making a key",
        "### Keeping the key",
        "### What is signed",
        "### `imagebuilder verify`",
    ):
        assert heading in SECTION
