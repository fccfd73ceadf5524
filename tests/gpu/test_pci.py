"""PCI inventory through the real libudev: umockdev's mock sysfs here, the machine's own sysfs too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import pci
from tests.gpu.harness import FIXTURES, edit_umockdev, run_python

pytestmark = pytest.mark.subprocess

SCAN = "import json; from agent.gpu import pci; print(json.dumps([f.to_json() for f in pci.scan()]))"


def _scan(pci_file: Path) -> list[dict[str, Any]]:
    proc = run_python(SCAN, pci=pci_file)
    assert proc.returncode == 0, proc.stderr
    result: list[dict[str, Any]] = json.loads(proc.stdout)
    return result


def _records(text: str) -> dict[str, dict[str, str]]:
    """Read the umockdev file independently: address -> A: attributes (and the driver link's name)."""
    out = {}
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        attrs = {ln[3:].split("=", 1)[0]: ln[3:].split("=", 1)[1] for ln in lines if ln.startswith("A: ")}
        for ln in lines:
            if ln.startswith("L: driver="):
                attrs["driver"] = ln.rsplit("/", 1)[1]
        out[lines[0].rsplit("/", 1)[1]] = attrs
    return out


def test_hgx_inventory_matches_the_device_description(tmp_path: Path) -> None:
    text = (FIXTURES / "hgx-h200-8" / "pci.umockdev").read_text()
    records = _records(text)
    found = _scan(FIXTURES / "hgx-h200-8" / "pci.umockdev")
    nvidia = {a: r for a, r in records.items() if r["vendor"] == "0x10de"}
    assert [f["address"] for f in found] == sorted(nvidia)
    assert len(found) == 12 and "0000:1a:00.0" not in {f["address"] for f in found}  # the Mellanox NIC
    for f in found:
        r = nvidia[f["address"]]
        assert (f["class"], f["device"], f["driver"]) == (r["class"], r["device"], r["driver"])
        assert f["numa_node"] == int(r["numa_node"])
        assert f["current_link_width"] == r["current_link_width"]
        assert f["max_link_speed"] == r["max_link_speed"]
    gpus = [f for f in found if f["class"] == "0x030200"]
    assert len(gpus) == 8 and {g["driver"] for g in gpus} == {"nvidia"}
    assert [g["numa_node"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {f["driver"] for f in found if f["class"] == "0x068000"} == {"nvidia-nvswitch"}


def test_drivers_other_than_nvidia_are_reported(tmp_path: Path) -> None:
    text = (FIXTURES / "hgx-h200-8" / "pci.umockdev").read_text()
    edited = tmp_path / "pci.umockdev"
    edited.write_text(
        edit_umockdev(text, (), {"0000:18:00.0": {"driver": "vfio-pci"}, "0000:2a:00.0": {"driver": ""}})
    )
    by_address = {f["address"]: f for f in _scan(edited)}
    assert by_address["0000:18:00.0"]["driver"] == "vfio-pci"
    assert by_address["0000:2a:00.0"]["driver"] is None
    assert by_address["0000:3a:00.0"]["driver"] == "nvidia"


def test_cpu_server_has_no_nvidia_function() -> None:
    assert _scan(FIXTURES / "cpu-node" / "pci.umockdev") == []


def test_this_machine_matches_its_own_sysfs() -> None:
    """The same scan on the real sysfs of the machine running the tests, checked against a plain read."""
    expected = (
        sorted(
            p.name
            for p in Path("/sys/bus/pci/devices").iterdir()
            if (p / "vendor").read_text().strip().lower() == "0x10de"
        )
        if Path("/sys/bus/pci/devices").is_dir()
        else []
    )
    assert [f.address for f in pci.scan()] == expected
