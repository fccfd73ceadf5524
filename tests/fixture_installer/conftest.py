"""Fixtures for the fixture-installer tests: the built ISO, its kernel, VMs and a listener.

The VM tests never skip: a missing tool fails with the Debian package to install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.installer.build import BuiltIso, build_installer_iso
from fixtures.installer.proc import BuildError, run
from tests.fixture_installer.qemu import OVMF_CODE, OVMF_VARS, Listener

HOST_TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "xorriso": "xorriso",
    "debootstrap": "debootstrap",
    "mksquashfs": "squashfs-tools",
    "busybox": "busybox-static",
    "mkfs.vfat": "dosfstools",
    "mcopy": "mtools",
    "dpkg-deb": "dpkg",
    "unshare": "util-linux",
    "zstd": "zstd",
}


def _require_host() -> None:
    missing = sorted(
        {
            pkg
            for tool, pkg in HOST_TOOLS.items()
            if shutil.which(tool, path=os.environ["PATH"] + ":/usr/sbin:/sbin") is None
        }
    )
    for firmware in (OVMF_CODE, OVMF_VARS):
        if not firmware.is_file():
            missing.append("ovmf")
    if missing:
        pytest.fail(f"the fixture installer tests need: apt-get install {' '.join(sorted(set(missing)))}")
    if os.geteuid() != 0:
        pytest.fail("building the fixture installer ISO needs root (debootstrap, chroot, mount namespaces)")


@pytest.fixture(scope="session")
def installer_iso() -> BuiltIso:
    """The cached fixture ISO (built on first use: a few minutes, needs the Debian mirror)."""
    _require_host()
    try:
        return build_installer_iso()
    except BuildError as exc:
        pytest.fail(f"building the fixture installer ISO failed: {exc}")


@dataclass(frozen=True)
class BootFiles:
    iso: Path
    kernel: Path
    initrd: Path


@pytest.fixture(scope="session")
def boot_files(installer_iso: BuiltIso, tmp_path_factory: pytest.TempPathFactory) -> BootFiles:
    """``casper/vmlinuz`` and ``casper/initrd`` taken out of the ISO, as the builder does."""
    out = tmp_path_factory.mktemp("casper")
    run(
        [
            "xorriso",
            "-osirrox",
            "on",
            "-indev",
            str(installer_iso.iso),
            "-extract",
            "/casper/vmlinuz",
            str(out / "vmlinuz"),
            "-extract",
            "/casper/initrd",
            str(out / "initrd"),
        ]
    )
    return BootFiles(installer_iso.iso, out / "vmlinuz", out / "initrd")


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


def new_disk(path: Path, size: str = "8G") -> Path:
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), size])
    return path
