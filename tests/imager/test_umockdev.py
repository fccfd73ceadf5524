"""``nodeimager disks`` with its default paths (``/sys/block``) under umockdev, as tests/gpu runs the agent:
the mock sysfs comes from umockdev's own device description format, read through the real file calls."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]


def _device(
    path: str, name: str, major_minor: str, sectors: int, *, serial: str = "", removable: bool = False
) -> str:
    lines = [f"P: {path}/{name}", f"N: {name}", f"E: DEVNAME=/dev/{name}", "E: DEVTYPE=disk", "E: SUBSYSTEM=block",
             f"A: dev={major_minor}", f"A: size={sectors}", f"A: removable={int(removable)}", "A: ro=0"]  # fmt: skip
    if serial:
        lines.append(f"A: serial={serial}")
    return "\n".join(lines) + "\n\n"


def test_the_default_sysfs_paths_read_a_mocked_eight_disk_server(tmp_path: Path) -> None:
    umockdev = shutil.which("umockdev-run")
    if umockdev is None:
        pytest.fail("umockdev-run is missing: apt-get install umockdev")
    text = "".join(
        _device(
            f"/devices/pci0000:00/0000:00:{4 + i:02x}.0/nvme/nvme{i}",
            f"nvme{i}n1",
            f"259:{i * 16}",
            7_500_000_000,
            serial=f"PHA{i:05d}",
        )
        for i in range(8)
    ) + _device(
        "/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/host0/target0:0:0/0:0:0:0/block",
        "sdz",
        "65:144",
        62_500_000,
        serial="USB-KEY",
        removable=True,
    )
    (tmp_path / "server.umockdev").write_text(text)
    argv = [umockdev, "-d", str(tmp_path / "server.umockdev"), "--", sys.executable, "-m", "imager", "disks",
            "--cmdline", "/dev/null", "--serial", "PHA00005", "--json"]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["chosen"]["name"] == "nvme5n1" and doc["chosen"]["size"] == 7_500_000_000 * 512
    by_name = {d["name"]: d for d in doc["disks"]}
    assert len(by_name) == 9 and [x["reason"] for x in by_name["sdz"]["excluded"]] == ["removable"]
    assert all(
        by_name[f"nvme{i}n1"]["unmatched"] == [f"serial is PHA{i:05d}, not PHA00005"]
        for i in range(8)
        if i != 5
    )
