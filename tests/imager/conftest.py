"""Imager fixtures: a real little node image (GPT, FAT ESP with a loader, ext4 root; raw and QCOW2 by
qemu-img), signed build folders made by the builder's own trust code, a loopback release server,
fabricated machines with file-backed disks, and the firmware double."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from imagebuilder.sign import generate_keypair
from imagebuilder.trust import write_trust_outputs
from imager.errors import ImagerError
from imager.events import Events
from imager.flow import Imaging, Result
from imager.http import Fetcher
from imager.inventory import SysfsInventory
from imager.params import Params
from protocol.dsse import fingerprint, load_public_key
from tests.imager.doubles import FirmwareDouble
from tests.imager.server import ReleaseServer
from tests.imager.sysfs import FakeDisk, make_machine
from tests.imagetrust.conftest import make_manifest

MiB = 1 << 20
VIRTUAL = 64 * MiB
BUILD_ID = "node-debian-12-20261130T081500Z-3f2a1b"
QCOW2 = "node-debian-12.qcow2"
RAW = "node-debian-12.raw"
RAW_MEDIA_TYPE = "application/vnd.nodetrust.raw-disk"


def tool(name: str, package: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        pytest.fail(f"{name} is not installed: apt-get install {package} (scripts/ensure-deps.sh)")
    return found


def sh(*argv: str, input_bytes: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(list(argv), input=input_bytes, capture_output=True, check=False, timeout=120)
    if done.returncode:  # what the tool said, not only its exit status (a failure seen once under load)
        pytest.fail(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}"
        )
    return done


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class NodeImage:
    raw: Path
    qcow2: Path
    esp_uuid: str
    root_uuid: str


def _make_image(work: Path, *, root_label: str = "cloudimg-rootfs", loader: Path | None = None) -> NodeImage:
    """A 64 MiB raw disk (GPT: a FAT ESP with ``EFI/BOOT/BOOTX64.EFI``, an ext4 root) and its QCOW2.

    ``loader`` is the EFI application to install (a kernel with its EFI stub boots under OVMF); by
    default 4 KiB of random bytes behind an MZ signature, enough for everything but booting it.
    """
    for name, package in (("sfdisk", "fdisk"), ("mkfs.vfat", "dosfstools"), ("mcopy", "mtools"),
                          ("mkfs.ext4", "e2fsprogs"), ("qemu-img", "qemu-utils")):  # fmt: skip
        tool(name, package)
    raw = work / RAW
    with raw.open("wb") as fh:
        fh.truncate(VIRTUAL)
    sh(
        "sfdisk",
        "-q",
        str(raw),
        input_bytes=b"label: gpt\nstart=2048, size=32768, type=uefi\nstart=34816, type=linux\n",
    )
    esp, root = work / "esp.fat", work / "root.ext4"
    sh("mkfs.vfat", "-C", "-n", "UEFI", str(esp), "16384")
    sh("mmd", "-i", str(esp), "::/EFI", "::/EFI/BOOT")
    efi_app = work / "BOOTX64.EFI"
    efi_app.write_bytes(loader.read_bytes() if loader is not None else b"MZ" + os.urandom(4094))
    sh("mcopy", "-i", str(esp), str(efi_app), "::/EFI/BOOT/BOOTX64.EFI")
    tree = work / "rootfs"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "os-release").write_text("ID=debian\n")
    (tree / "payload.bin").write_bytes(os.urandom(4 * MiB))
    sh("mkfs.ext4", "-q", "-F", "-L", root_label, "-d", str(tree), str(root), "40M")
    with raw.open("r+b") as fh:
        fh.seek(2048 * 512)
        fh.write(esp.read_bytes())
        fh.seek(34816 * 512)
        fh.write(root.read_bytes())
    qcow2 = work / QCOW2
    sh("qemu-img", "convert", "-q", "-c", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2))
    esp_uuid = sh("blkid", "-p", "-o", "value", "-s", "UUID", str(esp)).stdout.decode().strip()
    root_uuid = sh("blkid", "-p", "-o", "value", "-s", "UUID", str(root)).stdout.decode().strip()
    return NodeImage(raw, qcow2, esp_uuid, root_uuid)


@pytest.fixture(scope="session")
def node_image(tmp_path_factory: pytest.TempPathFactory) -> NodeImage:
    return _make_image(tmp_path_factory.mktemp("node-image"))


@dataclass(frozen=True)
class Keys:
    key: Path
    pub: Path
    fingerprint: str


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Keys]:
    """Two signing keys: ``release`` (trusted) and ``other`` (a stranger's)."""
    base = tmp_path_factory.mktemp("keys")
    out = {}
    for name, kind in (("release", "ecdsa-p256"), ("other", "ed25519")):
        private_pem, public_pem = generate_keypair(kind)
        key, pub = base / f"{name}.key", base / f"{name}.pub"
        key.write_bytes(private_pem)
        key.chmod(0o600)
        pub.write_bytes(public_pem)
        out[name] = Keys(key, pub, fingerprint(load_public_key(public_pem)))
    return out


def sign_build(folder: Path, key: Path, *, raw: bool, virtual: int = VIRTUAL) -> None:
    """Write manifest.json for the files in ``folder`` and the builder's trust outputs, signed."""
    manifest = make_manifest(folder)
    manifest["build_id"] = BUILD_ID
    manifest["outputs"] = [o for o in manifest["outputs"] if o["name"] != "node-debian-12.qcow2"]
    for name, media in ((QCOW2, "application/x-qemu-disk"), *([(RAW, RAW_MEDIA_TYPE)] if raw else [])):
        path = folder / name
        manifest["outputs"].append(
            {"name": name, "sha256": sha256(path), "size": path.stat().st_size, "media_type": media}
        )
    manifest["image"] = {"format": "qcow2", "virtual_size": virtual, "compressed": True}
    (folder / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    write_trust_outputs(folder, key=key)


@pytest.fixture
def build_folder(tmp_path: Path, node_image: NodeImage, keys: dict[str, Keys]) -> Callable[..., Path]:
    """``make(raw=True, key='release', qcow2=None)``: a signed build folder under ``<tmp>/srv/``."""

    def make(
        *, raw: bool = True, key: str = "release", qcow2: Path | None = None, name: str = "build"
    ) -> Path:
        folder = tmp_path / "srv" / name
        folder.mkdir(parents=True)
        shutil.copyfile(qcow2 or node_image.qcow2, folder / QCOW2)
        if raw:
            shutil.copyfile(node_image.raw, folder / RAW)
        (folder / "console.log").write_text("[    0.000000] Linux version 6.1.0-28-amd64\n")
        sign_build(folder, keys[key].key, raw=raw)
        return folder

    return make


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ReleaseServer]:
    (tmp_path / "srv").mkdir(exist_ok=True)
    with ReleaseServer(tmp_path / "srv") as srv:
        yield srv


TARGET_SERIAL = "S-TARGET-01"


def standard_disks() -> list[FakeDisk]:
    """A target NVMe of 128 MiB with a serial, a second one of 256 MiB, and a USB stick."""
    return [
        FakeDisk(
            "nvme0n1",
            128 * MiB,
            serial=TARGET_SERIAL,
            wwn="eui.0025388b91b2d4d1",
            model="Fixture NVMe 128",
            by_path="pci-0000:41:00.0-nvme-1",
        ),
        FakeDisk(
            "nvme1n1",
            256 * MiB,
            serial="S-OTHER-02",
            wwn="eui.0025388b91b2d4d2",
            model="Fixture NVMe 256",
            by_path="pci-0000:42:00.0-nvme-1",
        ),
        FakeDisk(
            "sda", 64 * MiB, serial="USB-STICK", model="Flash Disk", bus="usb", removable=True, major=8
        ),
    ]


SHM = Path("/dev/shm")  # memory-backed (tmpfs: no O_DIRECT), as the boot environment's /run


@dataclass
class Machine:
    root: Path
    firmware: FirmwareDouble = field(default_factory=FirmwareDouble)
    console: io.StringIO = field(default_factory=io.StringIO)

    @property
    def scratch(self) -> Path:
        """A tmpfs folder, as /run/nodeimager is in the boot environment (tmpfs refuses O_DIRECT)."""
        return (
            SHM / f"nodeimager-test-{self.root.parent.name}"
            if SHM.is_dir()
            else self.root / "run" / "nodeimager"
        )

    def node(self, name: str) -> Path:
        return self.root / "dev" / name

    def image(self, params: Params, *, keys_dir: Path | None = None, scratch: Path | None = None,
              fetcher: Fetcher | None = None) -> Result:  # fmt: skip
        imaging = Imaging(params=params, inventory=SysfsInventory(self.root), firmware=self.firmware,
                          fetcher=fetcher or Fetcher(attempts=2, pause_s=0.0, timeout_s=10.0),
                          events=Events(console=self.console), keys_dir=keys_dir,
                          scratch_dir=scratch or self.scratch)  # fmt: skip
        self.events = imaging.events
        return imaging.run()

    def refused(self, params: Params, **kw: Any) -> ImagerError:
        with pytest.raises(ImagerError) as caught:
            self.image(params, **kw)
        return caught.value


@pytest.fixture
def machine(tmp_path: Path) -> Callable[..., Machine]:
    def make(disks: list[FakeDisk] | None = None) -> Machine:
        root = tmp_path / "machine"
        make_machine(root, standard_disks() if disks is None else disks)
        return Machine(root)

    return make


def has_partition_table(path: Path) -> bool:
    """Whether sfdisk (util-linux) finds any partition table on ``path``."""
    found = subprocess.run(
        ["blkid", "-p", "-o", "value", "-s", "PTTYPE", str(path)], capture_output=True, check=False
    )
    return bool(found.stdout.strip())


@pytest.fixture
def baked(tmp_path: Path, keys: dict[str, Keys]) -> Path:
    """The boot environment's key folder, holding the release key only."""
    folder = tmp_path / "baked-keys"
    folder.mkdir()
    shutil.copyfile(keys["release"].pub, folder / "release.pub")
    return folder
