"""The block devices of the machine, read from sysfs and the udev database, never from kernel names alone.

:class:`SysfsInventory` reads, under a root folder (``/`` on a server; a fabricated tree in the
fast tests):

* ``sys/block/<name>/``: ``dev``, ``size`` (512-byte sectors), ``removable``, ``ro``,
  ``queue/rotational``, ``queue/logical_block_size``, ``serial`` / ``device/serial``,
  ``wwid`` / ``device/wwid``, ``device/model``, ``device/vendor``, ``holders/``, ``dm/uuid``,
  ``loop/``, the partitions (sub-folders with a ``partition`` file);
* ``run/udev/data/b<major>:<minor>``: udev's properties (``E:ID_SERIAL_SHORT=...``, ``ID_WWN``,
  ``ID_MODEL``, ``ID_VENDOR``, ``ID_PATH``, ``ID_BUS``, ``ID_FS_TYPE``, ``ID_FS_UUID``,
  ``ID_FS_LABEL``, ``ID_PART_ENTRY_UUID``, ``DM_MULTIPATH_DEVICE_PATH``, ``ID_CDROM``) and links
  (``S:disk/by-id/...``), which win over sysfs where both exist;
* ``proc/self/mountinfo`` and ``proc/swaps``: what is mounted or swapped on;
* ``dev/<name>``: the device node (a regular file in the tests: a file-backed disk).

The inventory only describes; :mod:`imager.select` decides which disks may be written.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

SECTOR = 512
MAX_ATTR_BYTES = 64 << 10  # a sysfs attribute or a udev record larger than this is not one
_MAJMIN = re.compile(r"(\d+):(\d+)")


@dataclass(frozen=True)
class Partition:
    name: str
    number: int
    devnode: Path
    major_minor: str
    part_uuid: str = ""
    fs_type: str = ""
    fs_uuid: str = ""
    fs_label: str = ""
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Disk:
    """One whole block device and every fact selection may use."""

    name: str  # the kernel name (vda, nvme0n1): shown, never matched by default
    devnode: Path
    major_minor: str
    size: int  # bytes
    logical_block_size: int = SECTOR
    removable: bool = False
    read_only: bool = False
    rotational: bool = False
    model: str = ""
    vendor: str = ""
    serial: str = ""
    wwn: str = ""
    by_path: str = ""
    by_id: tuple[str, ...] = ()
    bus: str = ""
    holders: tuple[str, ...] = ()
    multipath_member: bool = False
    fs_type: str = ""  # a file system or member signature on the whole disk (udev ID_FS_TYPE)
    cdrom: bool = False
    is_dm: bool = False
    is_md: bool = False
    is_loop: bool = False
    partitions: tuple[Partition, ...] = ()
    mounts: tuple[str, ...] = ()  # mount points (and "[swap]") on the disk or any of its partitions
    properties: Mapping[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``disk``, or what else it is: ``loop``, ``ram``, ``zram``, ``device-mapper``, ``md``, ..."""
        if self.is_loop or self.name.startswith("loop"):
            return "loop"
        if self.name.startswith("zram"):
            return "zram"
        if self.name.startswith(("ram", "brd")):
            return "ram"
        if self.is_dm or self.name.startswith("dm-"):
            return "device-mapper"
        if self.is_md or self.name.startswith("md"):
            return "md"
        if self.cdrom or self.name.startswith("sr"):
            return "optical"
        if self.name.startswith(("nbd", "fd", "mtdblock")):
            return self.name.rstrip("0123456789")
        return "disk"

    def identity(self) -> dict[str, object]:
        """What names this disk stably: for events and refusals."""
        out: dict[str, object] = {"name": self.name, "size": self.size}
        for key in ("serial", "wwn", "model", "vendor", "by_path"):
            value = getattr(self, key)
            if value:
                out[key] = value
        if self.by_id:
            out["by_id"] = list(self.by_id)
        return out

    def describe(self) -> str:
        parts = [f"{self.name} ({_human(self.size)}"]
        for key in ("serial", "wwn", "model", "by_path"):
            value = getattr(self, key)
            if value:
                parts.append(f"{key} {value}")
        return ", ".join(parts) + ")"


class Inventory(Protocol):
    """Where the disks come from: sysfs and udev on a server, a fabricated tree in the tests."""

    def disks(self) -> list[Disk]: ...


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _read(path: Path) -> str:
    """A small text attribute, stripped; empty when absent or unreadable."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_ATTR_BYTES + 1)
    except OSError:
        return ""
    if len(data) > MAX_ATTR_BYTES:
        log.warning("%s: larger than %d bytes; ignored", path, MAX_ATTR_BYTES)
        return ""
    return data.decode("utf-8", errors="replace").strip()


def _int(text: str, default: int = 0) -> int:
    return int(text) if text.isascii() and text.isdigit() else default


def parse_udev_record(text: str) -> tuple[dict[str, str], list[str]]:
    """``E:KEY=VALUE`` properties and ``S:link`` symlinks of one udev database record."""
    props: dict[str, str] = {}
    links: list[str] = []
    for line in text.splitlines():
        if line.startswith("E:") and "=" in line:
            key, _, value = line[2:].partition("=")
            props[key] = value
        elif line.startswith("S:"):
            links.append(line[2:])
    return props, links


def parse_mountinfo(text: str) -> dict[str, list[str]]:
    """major:minor -> mount points, from ``/proc/self/mountinfo``."""
    mounted: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) >= 5 and _MAJMIN.fullmatch(fields[2]):
            mounted.setdefault(fields[2], []).append(fields[4].replace("\\040", " "))
    return mounted


def parse_swaps(text: str) -> set[str]:
    """Kernel names of the active swap devices (``/proc/swaps``; files are not devices)."""
    names: set[str] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[1] == "partition" and fields[0].startswith("/dev/"):
            names.add(fields[0].rsplit("/", 1)[-1])
    return names


@dataclass
class SysfsInventory:
    """Disks under ``root`` (``/`` on a server)."""

    root: Path = Path("/")

    @property
    def sys_block(self) -> Path:
        return self.root / "sys" / "block"

    def _udev(self, major_minor: str) -> tuple[dict[str, str], list[str]]:
        return parse_udev_record(_read(self.root / "run" / "udev" / "data" / f"b{major_minor}"))

    def _partitions(self, disk_dir: Path, name: str) -> list[Partition]:
        out = []
        try:
            entries = sorted(os.listdir(disk_dir))
        except OSError:
            return []
        for entry in entries:
            part_dir = disk_dir / entry
            if not entry.startswith(name) or not (part_dir / "partition").exists():
                continue
            major_minor = _read(part_dir / "dev")
            props, _ = self._udev(major_minor)
            try:
                holders = tuple(sorted(os.listdir(part_dir / "holders")))
            except OSError:
                holders = ()
            out.append(
                Partition(
                    name=entry,
                    number=_int(_read(part_dir / "partition")),
                    devnode=self.root / "dev" / entry,
                    major_minor=major_minor,
                    part_uuid=props.get("ID_PART_ENTRY_UUID", "").lower(),
                    fs_type=props.get("ID_FS_TYPE", ""),
                    fs_uuid=props.get("ID_FS_UUID", "").lower(),
                    fs_label=props.get("ID_FS_LABEL", ""),
                    holders=holders,
                )
            )
        return out

    def disks(self) -> list[Disk]:
        mounted = parse_mountinfo(_read(self.root / "proc" / "self" / "mountinfo"))
        swaps = parse_swaps(_read(self.root / "proc" / "swaps"))
        try:
            names = sorted(os.listdir(self.sys_block))
        except OSError as exc:
            log.warning("%s: cannot list block devices: %s", self.sys_block, exc.strerror)
            return []
        return [self._disk(name, mounted, swaps) for name in names if _is_name(name)]

    def _disk(self, name: str, mounted: Mapping[str, list[str]], swaps: Iterable[str]) -> Disk:
        d = self.sys_block / name
        major_minor = _read(d / "dev")
        props, links = self._udev(major_minor)
        partitions = self._partitions(d, name)
        swap_names = set(swaps)
        mounts: list[str] = list(mounted.get(major_minor, []))
        if name in swap_names:
            mounts.append("[swap]")
        for part in partitions:
            mounts.extend(mounted.get(part.major_minor, []))
            if part.name in swap_names:
                mounts.append("[swap]")
        try:
            holders = tuple(sorted(os.listdir(d / "holders")))
        except OSError:
            holders = ()
        holders = tuple(sorted({*holders, *(h for part in partitions for h in part.holders)}))
        dm_uuid = _read(d / "dm" / "uuid")

        def pick(key: str, *files: str) -> str:
            if props.get(key):
                return props[key].strip()
            for rel in files:
                value = _read(d / rel)
                if value:
                    return value
            return ""

        by_id = tuple(
            sorted(link.removeprefix("disk/by-id/") for link in links if link.startswith("disk/by-id/"))
        )
        by_path = next(
            (link.removeprefix("disk/by-path/") for link in links if link.startswith("disk/by-path/")), ""
        )
        wwn = (
            props.get("ID_WWN_WITH_EXTENSION")
            or props.get("ID_WWN")
            or _read(d / "wwid")
            or _read(d / "device" / "wwid")
        )
        return Disk(
            name=name,
            devnode=self.root / "dev" / name,
            major_minor=major_minor,
            size=_int(_read(d / "size")) * SECTOR,
            logical_block_size=_int(_read(d / "queue" / "logical_block_size"), SECTOR) or SECTOR,
            removable=_read(d / "removable") == "1",
            read_only=_read(d / "ro") == "1",
            rotational=_read(d / "queue" / "rotational") == "1",
            model=pick("ID_MODEL", "device/model").replace("_", " ").strip(),
            vendor=pick("ID_VENDOR", "device/vendor").replace("_", " ").strip(),
            serial=pick("ID_SERIAL_SHORT", "serial", "device/serial"),
            wwn=wwn.strip().lower(),
            by_path=by_path or props.get("ID_PATH", ""),
            by_id=by_id,
            bus=props.get("ID_BUS", ""),
            holders=holders,
            multipath_member=props.get("DM_MULTIPATH_DEVICE_PATH") == "1" or dm_uuid.startswith("mpath-"),
            fs_type=props.get("ID_FS_TYPE", ""),
            cdrom=props.get("ID_CDROM") == "1",
            is_dm=(d / "dm").is_dir(),
            is_md=(d / "md").is_dir(),
            is_loop=(d / "loop").is_dir(),
            partitions=tuple(partitions),
            mounts=tuple(mounts),
            properties=props,
        )


def _is_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in {".", ".."} and name.isprintable()
