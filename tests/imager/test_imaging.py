"""The whole imaging run against a real loopback release server and file-backed disks: the happy paths.

What each test proves from its own evidence: the disk reads back as the image (cmp), the backup GPT
sits in the last sector (our reader, sfdisk --verify and sgdisk -v agree), the boot entry names the
written ESP's partition GUID and is first, the events tell the story in order.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from imager.gpt import read_gpt
from imager.params import Params
from tests.imager.conftest import QCOW2, TARGET_SERIAL, VIRTUAL, Keys, Machine, NodeImage, tool
from tests.imager.server import ReleaseServer

pytestmark = pytest.mark.subprocess


@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
def test_a_signed_image_is_written_to_the_hinted_disk_and_made_bootable(
    fmt: str,
    build_folder: Callable[..., Path],
    server: ReleaseServer,
    machine: Callable[..., Machine],
    keys: dict[str, Keys],
    node_image: NodeImage,
    baked: Path,
) -> None:
    folder = build_folder(raw=True)
    m = machine()
    pxe = m.firmware.add("UEFI PXEv4 (MAC:525400123456)", None)
    params = Params(release=f"{server.url}/{folder.name}/", key=keys["release"].fingerprint, format=fmt,
                    hints={"serial": TARGET_SERIAL}, reboot="no")  # fmt: skip
    result = m.image(params, keys_dir=baked)

    target = m.node("nvme0n1")
    assert result.disk is not None and result.disk.serial == TARGET_SERIAL
    # the image's partitions, byte for byte, everything but the GPT structures that relocation rewrites
    with target.open("rb") as a, node_image.raw.open("rb") as b:
        a.seek(2048 * 512)
        b.seek(2048 * 512)
        assert a.read(VIRTUAL - 2048 * 512 - 34 * 512) == b.read(VIRTUAL - 2048 * 512 - 34 * 512)
    table = read_gpt(target)
    assert not table.problems and table.backup is not None
    assert table.primary.alternate_lba == table.disk_sectors - 1
    subprocess.run(["sfdisk", "--verify", str(target)], check=True, capture_output=True)
    sgdisk = subprocess.run(
        [tool("sgdisk", "gdisk"), "-v", str(target)], capture_output=True, text=True, check=False
    )
    assert sgdisk.returncode == 0 and "No problems found" in sgdisk.stdout
    # the other disks were never touched
    assert not any(m.node("nvme1n1").read_bytes()[: 1 << 20])
    # the boot entry: the ESP written, the removable-media loader, first in BootOrder, PXE kept after it
    esp = table.esp()
    assert esp is not None and result.boot_entry is not None
    entry = m.firmware.boot[result.boot_entry]
    assert entry.part_guid == esp.part_guid and entry.path == "\\EFI\\BOOT\\BOOTX64.EFI"
    assert m.firmware.order == [result.boot_entry, pxe]
    names = [e["event"] for e in m.events.sent]
    assert names == ["started", "verified", "disk-chosen", "written", "boot-entry", "done"]
    assert m.events.sent[2]["disk"]["serial"] == TARGET_SERIAL
    assert m.events.sent[3]["sha256"] == (result.image.sha256 if result.image else None)
    assert (fmt == "raw") == (result.image is not None and result.image.format == "raw")
    assert result.image is not None and result.image.name.endswith(fmt if fmt == "raw" else QCOW2)
