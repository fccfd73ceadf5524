"""``nodeimager`` as an operator runs it: --help with the exit statuses, --version, --json, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.imager.conftest import TARGET_SERIAL, Keys, standard_disks
from tests.imager.server import ReleaseServer
from tests.imager.sysfs import make_machine

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]


def nodeimager(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "imager", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_help_explains_and_lists_the_exit_statuses() -> None:
    for args in ((), ("run",), ("verify",), ("disks",)):
        out = nodeimager(*args, "--help")
        assert out.returncode == 0
        assert (
            "exit status:" in out.stdout
            and "6  no disk" in out.stdout
            and "docs/bare-metal.md" in nodeimager("--help").stdout
        )
    version = nodeimager("--version")
    assert version.returncode == 0 and version.stdout.startswith("nodeimager ")


def test_disks_json_lists_every_disk_and_the_choice(tmp_path: Path) -> None:
    root = make_machine(tmp_path / "m", standard_disks())
    out = nodeimager(
        "disks", "--root", str(root), "--cmdline", "/dev/null", "--serial", TARGET_SERIAL, "--json"
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["chosen"]["serial"] == TARGET_SERIAL and len(doc["disks"]) == 3
    refused = nodeimager("disks", "--root", str(root), "--cmdline", "/dev/null", "--json")
    assert refused.returncode == 6 and json.loads(refused.stdout)["reason"] == "no-hint"


def test_verify_json_and_the_exit_status_of_a_refusal(
    build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys], tmp_path: Path
) -> None:
    folder = build_folder()
    (tmp_path / "cmdline").write_bytes(f"quiet nodeimager.release={server.url}/{folder.name}/\n".encode())
    ok = nodeimager("verify", "--cmdline", str(tmp_path / "cmdline"), "--key", keys["release"].fingerprint,
                    "--keys-dir", str(tmp_path / "none"), "--json")  # fmt: skip
    # a build folder publishes no signing-key.pub: with no baked key the pinned one cannot be fetched
    assert ok.returncode == 3 and json.loads(ok.stdout)["reason"] == "http-error"
    keydir = tmp_path / "k"
    keydir.mkdir()
    (keydir / "release.pub").write_bytes(keys["release"].pub.read_bytes())
    ok = nodeimager("verify", "--cmdline", str(tmp_path / "cmdline"), "--keys-dir", str(keydir), "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["kind"] == "build" and {i["format"] for i in doc["images"]} == {"qcow2", "raw"}
    bad = nodeimager("verify", "--cmdline", str(tmp_path / "cmdline"), "--keys-dir", str(keydir), "--json",
                     "--image", "sha256:" + "0" * 64)  # fmt: skip
    assert bad.returncode == 4 and json.loads(bad.stdout)["reason"] == "image-pin-mismatch"
    assert "hint:" in bad.stderr
