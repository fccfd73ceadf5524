"""Reading a GUID partition table (UEFI 2.10, section 5.3) from a disk or a file, bounded and checked.

The imager reads the GPT of the disk it wrote, to check that the primary and backup headers are
valid and where they belong (the backup in the last sector, after :func:`imager.post.relocate`),
and to find the image's EFI system partition and root partition, whose identities must resolve on
this disk only (:mod:`imager.post`). 512-byte logical sectors only: the images are built that way.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from imager.blockdev import disk_size, read_at
from imager.errors import ImagerError, Reason

SECTOR = 512
SIGNATURE = b"EFI PART"
MAX_ENTRIES = 1024
ESP_TYPE = uuid.UUID("c12a7328-f81f-11d2-ba4b-00a0c93ec93b")
LINUX_FS_TYPE = uuid.UUID("0fc63daf-8483-4772-8e79-3d69d8477de4")
ROOT_X86_64_TYPE = uuid.UUID("4f68bce3-e8cd-4db1-96e7-fbcaf984b709")
ROOT_ARM64_TYPE = uuid.UUID("b921b045-1df0-41c3-af44-4c6f280d3fae")
ROOT_TYPES = frozenset({LINUX_FS_TYPE, ROOT_X86_64_TYPE, ROOT_ARM64_TYPE})
_HEADER = struct.Struct("<8sIIIIQQQQ16sQIII")


@dataclass(frozen=True)
class Header:
    my_lba: int
    alternate_lba: int
    first_usable: int
    last_usable: int
    disk_guid: uuid.UUID
    entries_lba: int
    num_entries: int
    entry_size: int
    entries_crc: int


@dataclass(frozen=True)
class Entry:
    number: int  # 1-based, as the kernel numbers partitions
    type_guid: uuid.UUID
    part_guid: uuid.UUID
    first_lba: int
    last_lba: int
    name: str

    @property
    def offset(self) -> int:
        return self.first_lba * SECTOR

    @property
    def size(self) -> int:
        return (self.last_lba - self.first_lba + 1) * SECTOR


@dataclass(frozen=True)
class Gpt:
    disk_sectors: int
    primary: Header
    entries: tuple[Entry, ...]
    backup: Header | None
    problems: tuple[str, ...]  # empty when both headers are valid, consistent and in place

    def esp(self) -> Entry | None:
        found = [e for e in self.entries if e.type_guid == ESP_TYPE]
        return found[0] if len(found) == 1 else None

    def root(self) -> Entry | None:
        """The root partition: the x86-64/arm64 root type, else the largest Linux file system."""
        typed = [e for e in self.entries if e.type_guid in (ROOT_X86_64_TYPE, ROOT_ARM64_TYPE)]
        if len(typed) == 1:
            return typed[0]
        linux = [e for e in self.entries if e.type_guid == LINUX_FS_TYPE]
        return max(linux, key=lambda e: e.size) if linux else None


def _header(data: bytes, lba: int) -> tuple[Header | None, str]:
    if len(data) < 92 or data[:8] != SIGNATURE:
        return None, f"no GPT header at LBA {lba}"
    (
        _sig,
        _rev,
        size,
        crc,
        _res,
        my_lba,
        alt,
        first,
        last,
        guid,
        entries,
        count,
        entry_size,
        entries_crc,
    ) = _HEADER.unpack_from(data)
    if not 92 <= size <= SECTOR:
        return None, f"the GPT header at LBA {lba} has size {size}"
    check = bytearray(data[:size])
    check[16:20] = b"\0\0\0\0"
    if zlib.crc32(check) != crc:
        return None, f"the GPT header at LBA {lba} fails its CRC"
    if my_lba != lba:
        return None, f"the GPT header at LBA {lba} says it is at LBA {my_lba}"
    if not 0 < count <= MAX_ENTRIES or entry_size < 128 or entry_size % 8 or entry_size > 1024:
        return None, f"the GPT header at LBA {lba} has {count} entries of {entry_size} bytes"
    return Header(
        my_lba, alt, first, last, uuid.UUID(bytes_le=guid), entries, count, entry_size, entries_crc
    ), ""


def _entries(path: Path, header: Header) -> tuple[tuple[Entry, ...], str]:
    raw = read_at(path, header.entries_lba * SECTOR, header.num_entries * header.entry_size)
    if len(raw) != header.num_entries * header.entry_size:
        return (), "the partition entries are cut short"
    if zlib.crc32(raw) != header.entries_crc:
        return (), "the partition entries fail their CRC"
    out = []
    for i in range(header.num_entries):
        chunk = raw[i * header.entry_size : i * header.entry_size + 128]
        type_guid = uuid.UUID(bytes_le=chunk[:16])
        if type_guid.int == 0:
            continue
        first, last = struct.unpack_from("<QQ", chunk, 32)
        name = chunk[56:128].decode("utf-16-le", errors="replace").split("\0", 1)[0]
        out.append(Entry(i + 1, type_guid, uuid.UUID(bytes_le=chunk[16:32]), first, last, name))
    return tuple(out), ""


def read_gpt(path: Path) -> Gpt:
    """The disk's GPT; ImagerError(gpt) when there is no valid primary table at all."""
    sectors = disk_size(path) // SECTOR
    primary, why = _header(read_at(path, SECTOR, SECTOR), 1)
    if primary is None:
        raise ImagerError(Reason.gpt, f"{path}: {why}", hint="the image has no valid GPT: rebuild it")
    entries, why = _entries(path, primary)
    if why:
        raise ImagerError(Reason.gpt, f"{path}: primary GPT: {why}")
    problems: list[str] = []
    backup, why = _header(read_at(path, (sectors - 1) * SECTOR, SECTOR), sectors - 1)
    if backup is None:
        problems.append(f"backup GPT: {why} (the last sector of the disk)")
    else:
        backup_entries, why = _entries(path, backup)
        if why:
            problems.append(f"backup GPT: {why}")
        elif backup_entries != entries:
            problems.append("the backup GPT lists other partitions than the primary")
        if backup.disk_guid != primary.disk_guid:
            problems.append("the backup GPT has another disk GUID")
    if primary.alternate_lba != sectors - 1:
        problems.append(
            f"the primary GPT points at a backup at LBA {primary.alternate_lba}, not the last sector {sectors - 1}"
        )
    last = -1
    for entry in sorted(entries, key=lambda e: e.first_lba):
        if (
            entry.first_lba < primary.first_usable
            or entry.last_lba > primary.last_usable
            or entry.last_lba < entry.first_lba
        ):
            problems.append(f"partition {entry.number} lies outside the usable sectors")
        if entry.first_lba <= last:
            problems.append(f"partition {entry.number} overlaps another")
        last = max(last, entry.last_lba)
    return Gpt(sectors, primary, entries, backup, tuple(problems))
