"""imagebuilder.imagefiles and bootmeasure.measure_image on a real QCOW2 made here (GPT, vfat ESP, ext4 root)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuilder import bootmeasure
from imagebuilder.errors import OutputError
from imagebuilder.imagefiles import ImageFiles
from imagebuilder.pehash import authenticode
from tests.fixture_installer.conftest import BootFiles

pytestmark = pytest.mark.subprocess
UUID = "6e0c1c5a-3b7d-4c1e-9a55-2f7d0b1e8c42"
TOOLS = ("qemu-img", "sfdisk", "mkfs.ext4", "mkfs.vfat", "mcopy", "mmd", "debugfs")


def _run(*argv: object, **kw: object) -> None:
    subprocess.run([str(a) for a in argv], check=True, capture_output=True, timeout=120, **kw)  # type: ignore[call-overload]


def _image(tmp: Path, loader: bytes, kernel: bytes, *, info: dict[str, str] | None) -> Path:
    missing = [t for t in TOOLS if shutil.which(t, path="/usr/sbin:/sbin:/usr/bin:/bin") is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)} (scripts/ensure-deps.sh installs them)")
    root = tmp / "rootfs"
    (root / "boot").mkdir(parents=True)
    (root / "etc/nodetrust").mkdir(parents=True)
    (root / "boot/vmlinuz-6.1.0-50-amd64").write_bytes(kernel)
    (root / "boot/initrd.img-6.1.0-50-amd64").write_bytes(b"an initrd")
    (root / "vmlinuz").symlink_to("boot/vmlinuz-6.1.0-50-amd64")
    if info is not None:
        (root / "etc/nodetrust/boot.json").write_text(json.dumps(info))
    _run("truncate", "-s", "64M", tmp / "root.ext4")
    _run("mkfs.ext4", "-q", "-F", "-U", UUID, "-d", root, tmp / "root.ext4")
    _run("truncate", "-s", "34M", tmp / "esp.vfat")
    _run("mkfs.vfat", "-F", "32", tmp / "esp.vfat")
    _run("mmd", "-i", tmp / "esp.vfat", "::/EFI", "::/EFI/BOOT")
    (tmp / "BOOTX64.EFI").write_bytes(loader)
    _run("mcopy", "-i", tmp / "esp.vfat", tmp / "BOOTX64.EFI", "::/EFI/BOOT/BOOTX64.EFI")
    disk = tmp / "disk.raw"
    _run("truncate", "-s", "110M", disk)
    _run("sfdisk", "-q", disk, input=b"label: gpt\nsize=34MiB, type=U\nsize=64MiB, type=L\n")
    table = json.loads(subprocess.run(["sfdisk", "-J", str(disk)], capture_output=True, check=True).stdout)
    for part, img in zip(table["partitiontable"]["partitions"], ("esp.vfat", "root.ext4"), strict=True):
        _run(
            "dd",
            f"if={tmp / img}",
            f"of={disk}",
            "bs=512",
            f"seek={part['start']}",
            "conv=notrunc",
            "status=none",
        )
    _run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", disk, tmp / "image.qcow2")
    return tmp / "image.qcow2"


def test_the_reference_is_computed_from_the_images_own_files(boot_files: BootFiles, tmp_path: Path) -> None:
    kernel = boot_files.kernel.read_bytes()
    loader = kernel  # any PE image stands in for GRUB here: its Authenticode hash is what PCR 4 gets
    info = {"root_uuid": UUID, "kernel": "/boot/vmlinuz-6.1.0-50-amd64", "initrd": "/boot/initrd.img-6.1.0-50-amd64",
            "cmdline": f"root=UUID={UUID} ro console=ttyS0,115200"}  # fmt: skip
    qcow2 = _image(tmp_path, loader, kernel, info=info)
    ref = bootmeasure.measure_image(qcow2, tmp_path / "work", image="b1")
    assert ref.image == "b1" and sorted(ref.pcrs) == [4, 8, 9]
    assert ref.pcrs[4].events[0].digest == authenticode(loader)
    assert [e.digest for e in ref.pcrs[9].events] == [
        hashlib.sha256(kernel).digest(),
        hashlib.sha256(b"an initrd").digest(),
    ]
    assert (
        ref.pcrs[8].events[0].text
        == f"kernel_cmdline: (hd0,gpt2)/boot/vmlinuz-6.1.0-50-amd64 {info['cmdline']}"
    )
    assert not (tmp_path / "work" / "image-files.raw").exists(), "the raw copy is removed"
    with ImageFiles(qcow2, tmp_path / "work2") as files:
        with pytest.raises(OutputError):
            files.root("/vmlinuz")  # a symbolic link: the reference names files, never links
        with pytest.raises(OutputError):
            files.root("/etc/shadow")  # absent
        with pytest.raises(OutputError):
            files.root("relative/path")
        with pytest.raises(OutputError):
            files.esp("EFI/debian/grubx64.efi")


def test_an_image_without_its_boot_description_is_refused(boot_files: BootFiles, tmp_path: Path) -> None:
    kernel = boot_files.kernel.read_bytes()
    qcow2 = _image(tmp_path, kernel, kernel, info=None)
    with pytest.raises(OutputError) as refused:
        bootmeasure.measure_image(qcow2, tmp_path / "work", image="b1")
    assert "/etc/nodetrust/boot.json" in refused.value.message
