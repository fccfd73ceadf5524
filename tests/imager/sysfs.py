"""Fabricated machines for the disk inventory: sysfs, the udev database, mountinfo and device nodes.

:func:`make_machine` writes, under a root folder, what :class:`imager.inventory.SysfsInventory`
reads on a server (``sys/block/<name>/...``, ``run/udev/data/b<major>:<minor>``,
``proc/self/mountinfo``, ``proc/swaps``) with the attribute names and formats the kernel and
udev use (checked against this machine's own /sys in test_inventory.py), and a device node
``dev/<name>`` that is a sparse regular file of the disk's size: a file-backed disk the imager
writes for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FakePart:
    number: int
    fs_type: str = ""
    fs_uuid: str = ""
    fs_label: str = ""
    part_uuid: str = ""
    mounted_on: str = ""
    holders: tuple[str, ...] = ()


@dataclass
class FakeDisk:
    name: str
    size: int
    serial: str = ""
    wwn: str = ""
    model: str = ""
    vendor: str = ""
    by_path: str = ""
    bus: str = "nvme"
    rotational: bool = False
    removable: bool = False
    read_only: bool = False
    fs_type: str = ""
    holders: tuple[str, ...] = ()
    mounted_on: str = ""
    swap: bool = False
    cdrom: bool = False
    kind: str = ""  # "loop", "dm", "md": adds the kernel's marker folder
    partitions: list[FakePart] = field(default_factory=list)
    major: int = 259
    udev: bool = True  # whether udev has a record for it
    logical_block_size: int = 512


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_machine(root: Path, disks: list[FakeDisk], *, node_files: bool = True) -> Path:
    mountinfo: list[str] = []
    swaps = ["Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"]
    for index, disk in enumerate(disks):
        minor = index * 16
        base = root / "sys" / "block" / disk.name
        _write(base / "dev", f"{disk.major}:{minor}\n")
        _write(base / "size", f"{disk.size // 512}\n")
        _write(base / "removable", "1\n" if disk.removable else "0\n")
        _write(base / "ro", "1\n" if disk.read_only else "0\n")
        _write(base / "queue" / "rotational", "1\n" if disk.rotational else "0\n")
        _write(base / "queue" / "logical_block_size", f"{disk.logical_block_size}\n")
        (base / "holders").mkdir(parents=True, exist_ok=True)
        for holder in disk.holders:
            (base / "holders" / holder).mkdir()
        if disk.kind in ("loop", "dm", "md"):
            (base / disk.kind).mkdir()
        if disk.serial:
            _write(base / "device" / "serial", disk.serial + "\n")
        if disk.model:
            _write(base / "device" / "model", disk.model.ljust(40) + "\n")
        if disk.mounted_on:
            mountinfo.append(
                f"{30 + index} 1 {disk.major}:{minor} / {disk.mounted_on} rw,relatime - ext4 /dev/{disk.name} rw"
            )
        if disk.swap:
            swaps.append(f"/dev/{disk.name}\t\t\t\tpartition\t1048572\t\t0\t\t-2")
        props = {
            "ID_SERIAL_SHORT": disk.serial,
            "ID_WWN": disk.wwn,
            "ID_MODEL": disk.model.replace(" ", "_"),
            "ID_VENDOR": disk.vendor.replace(" ", "_"),
            "ID_PATH": disk.by_path,
            "ID_BUS": disk.bus,
            "ID_FS_TYPE": disk.fs_type,
            "ID_CDROM": "1" if disk.cdrom else "",
        }
        links = []
        if disk.serial:
            links.append(f"disk/by-id/{disk.bus}-{disk.model.replace(' ', '_')}_{disk.serial}")
        if disk.wwn:
            links.append(f"disk/by-id/wwn-{disk.wwn}")
        if disk.by_path:
            links.append(f"disk/by-path/{disk.by_path}")
        if disk.udev:
            record = "".join(f"S:{link}\n" for link in links) + "".join(
                f"E:{k}={v}\n" for k, v in props.items() if v
            )
            _write(root / "run" / "udev" / "data" / f"b{disk.major}:{minor}", record)
        for part in disk.partitions:
            pname = f"{disk.name}p{part.number}" if disk.name[-1].isdigit() else f"{disk.name}{part.number}"
            pdir = base / pname
            _write(pdir / "partition", f"{part.number}\n")
            _write(pdir / "dev", f"{disk.major}:{minor + part.number}\n")
            (pdir / "holders").mkdir(parents=True, exist_ok=True)
            for holder in part.holders:
                (pdir / "holders" / holder).mkdir()
            pprops = {"ID_FS_TYPE": part.fs_type, "ID_FS_UUID": part.fs_uuid, "ID_FS_LABEL": part.fs_label,
                      "ID_PART_ENTRY_UUID": part.part_uuid}  # fmt: skip
            _write(root / "run" / "udev" / "data" / f"b{disk.major}:{minor + part.number}",
                   "".join(f"E:{k}={v}\n" for k, v in pprops.items() if v))  # fmt: skip
            if part.mounted_on:
                mountinfo.append(
                    f"{60 + index} 1 {disk.major}:{minor + part.number} / {part.mounted_on} rw - ext4 /dev/{pname} rw"
                )
        if node_files:
            node = root / "dev" / disk.name
            node.parent.mkdir(parents=True, exist_ok=True)
            with node.open("wb") as fh:
                fh.truncate(disk.size)
    _write(root / "proc" / "self" / "mountinfo", "\n".join(mountinfo) + ("\n" if mountinfo else ""))
    _write(root / "proc" / "swaps", "\n".join(swaps) + "\n")
    return root
