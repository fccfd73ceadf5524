"""Seal archives and seal disks for the tests, made in memory (no root, no device nodes on this host)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder import assemble, reproducible, sealtree

MIB = 2**20
DISK = 200 * MIB
ESP_START, ESP_SECTORS = 2048, 40 * 2048
ROOT_START = ESP_START + ESP_SECTORS
ROOT_SECTORS = (DISK // 512) - 34 - ROOT_START - 2014  # leave the backup GPT and some slack
LINUX = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
OLD = {  # "the installer's" identifiers in a test seal header
    "root_uuid": "25e1629c-0b7e-4f0a-9a1e-0d2f5b6f8a11",
    "esp_uuid": "C459-3AF6",
    "root_partuuid": "7f0c1d2e-3b4a-4c5d-8e6f-708192a3b4c5",
    "esp_partuuid": "0a1b2c3d-4e5f-4a6b-8c7d-8e9fa0b1c2d3",
    "disk_guid": "11223344-5566-4778-899a-abbccddeeff0",
}


def layout() -> assemble.Layout:
    return assemble.Layout(
        disk_bytes=DISK,
        first_lba=2048,
        last_lba=DISK // 512 - 34,
        partitions=(
            assemble.Partition(1, ESP_START, ESP_SECTORS, assemble.ESP_TYPE, "EFI System"),
            assemble.Partition(2, ROOT_START, ROOT_SECTORS, LINUX),
        ),
        esp=1,
        root=2,
    )


def sfdisk_table() -> dict[str, Any]:
    """The table as ``sfdisk -J`` prints it for :func:`layout`."""
    lay = layout()
    return {
        "partitiontable": {
            "label": "gpt",
            "id": OLD["disk_guid"].upper(),
            "device": "/dev/vda",
            "unit": "sectors",
            "firstlba": lay.first_lba,
            "lastlba": lay.last_lba,
            "sectorsize": 512,
            "partitions": [
                {"node": "/dev/vda1", "start": ESP_START, "size": ESP_SECTORS, "type": assemble.ESP_TYPE,
                 "uuid": OLD["esp_partuuid"].upper(), "name": "EFI System"},
                {"node": "/dev/vda2", "start": ROOT_START, "size": ROOT_SECTORS, "type": LINUX,
                 "uuid": OLD["root_partuuid"].upper()},
            ],
        }
    }  # fmt: skip


@dataclass
class Member:
    name: str
    kind: str = "file"  # file, dir, symlink, hardlink, char, block, fifo
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: float = 1_600_000_000
    target: str = ""
    major: int = 0
    minor: int = 0
    pax: dict[str, str] = field(default_factory=dict)


_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
          "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}  # fmt: skip


def archive(members: list[Member]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = _TYPES[m.kind]
            info.mode, info.uid, info.gid, info.mtime = m.mode, m.uid, m.gid, m.mtime
            info.linkname = m.target
            info.devmajor, info.devminor = m.major, m.minor
            info.pax_headers = dict(m.pax)
            info.size = len(m.data) if m.kind == "file" else 0
            tar.addfile(info, io.BytesIO(m.data) if m.kind == "file" else None)
    return out.getvalue()


def d(name: str, mode: int = 0o755, **kw: object) -> Member:
    return Member(name, "dir", mode=mode, **kw)  # type: ignore[arg-type]


CAPABILITY = bytes.fromhex("0100000200200000000000000000000000000000")  # cap_net_raw+ep, VFS_CAP_REVISION_2


def root_members(now: float) -> list[Member]:
    """A small root file system with every kind of member the seal takes; ``now``: the mtime of the files the
    build wrote (clamped to SOURCE_DATE_EPOCH)."""
    return [
        d("root"),
        d("root/boot"),
        d("root/boot/efi", mode=0o700),
        d("root/dev"),
        Member("root/dev/null", "char", mode=0o666, major=1, minor=3),
        Member("root/dev/sda", "block", mode=0o660, gid=6, major=8, minor=0),
        d("root/etc"),
        Member("root/etc/fstab", data=b"UUID=new / ext4 defaults 0 1\n", mtime=now),
        Member("root/etc/shadow", data=b"root:*:20000:0:99999:7:::\n", mode=0o640, gid=42),
        d("root/run"),
        Member("root/run/initctl", "fifo", mode=0o600),
        d("root/tmp", mode=0o1777),
        d("root/usr"),
        d("root/usr/bin"),
        Member(
            "root/usr/bin/ping",
            data=b"\x7fELF ping",
            mode=0o755,
            pax={"SCHILY.xattr.security.capability": CAPABILITY.decode("utf-8", "surrogateescape")},
        ),
        Member("root/usr/bin/ping6", "hardlink", target="root/usr/bin/ping"),
        Member("root/usr/bin/sudo", data=b"\x7fELF sudo", mode=0o4755),
        Member('root/usr/bin/with space "quoted"', data=b"odd name", mode=0o755),
        Member("root/usr/bin/zeros", data=bytes(3 * 4096) + b"tail"),
        Member("root/vmlinuz", "symlink", target="boot/vmlinuz-6.1.0-50-amd64"),
    ]


def esp_members(now: float) -> list[Member]:
    return [
        d("esp", mode=0o700),
        d("esp/EFI", mode=0o700),
        d("esp/EFI/BOOT", mode=0o700),
        Member("esp/EFI/BOOT/BOOTX64.EFI", data=b"MZ" + bytes(5000), mtime=now),
        d("esp/EFI/debian", mode=0o700),
        Member("esp/EFI/debian/grub.cfg", data=b"search.fs_uuid new root\n", mtime=1_500_000_000),
    ]


def qcow2_disk(
    members: list[Member], ident: reproducible.Identity, where: Path, *, name: str = "image.qcow2",
    root_label: str = "root",
) -> Path:  # fmt: skip
    """The archive of ``members`` assembled on :func:`layout` with ``ident`` and converted to ``where/name``:
    a sealed disk as the builder makes one (the raw disk is removed)."""
    tar = archive(members)
    lay = layout()
    trees = sealtree.read_archive(
        io.BytesIO(tar), offset=0, length=len(tar), epoch=ident.source_date_epoch,
        trees={"root": (where / "root", "root", lay.part(2).bytes), "esp": (where / "esp", "esp", lay.part(1).bytes)},
    )  # fmt: skip
    raw = assemble.assemble(where / f"{name}.raw", lay, ident, esp=trees["esp"], root=trees["root"], esp_label="UEFI",
                            root_label=root_label, work=where / "work").disk  # fmt: skip
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(where / name)], check=True
    )
    raw.unlink()
    return where / name
