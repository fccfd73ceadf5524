"""UEFI boot entries: read from efivarfs as the firmware stores them, changed through efibootmgr.

:class:`EfiVars` reads ``Boot####`` and ``BootOrder`` from ``/sys/firmware/efi/efivars`` itself
(an ``EFI_LOAD_OPTION``: attributes, the description, a device path whose hard-drive node names
the partition's GPT GUID, UEFI 2.10 sections 3.1.3 and 10.3.5.1), so which entry points where is
decided from the firmware's own data, not from efibootmgr's text. It changes them with
``efibootmgr`` (create with ``-c -d -p -l -L``, delete with ``-b -B``, order with ``-o``).

The fast tests use :class:`tests.imager.doubles.FirmwareDouble` behind the same :class:`Firmware`
interface (there is no firmware on a development machine); the VM test uses the real OVMF NVRAM.
"""

from __future__ import annotations

import logging
import re
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from imager.errors import ImagerError, Reason
from imager.run import run

log = logging.getLogger(__name__)

GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
EFIVARS = Path("/sys/firmware/efi/efivars")
MAX_VAR_BYTES = 64 << 10
_BOOT_VAR = re.compile(rf"Boot([0-9A-F]{{4}})-{GLOBAL_GUID}")


@dataclass(frozen=True)
class BootEntry:
    number: int
    description: str
    part_guid: uuid.UUID | None  # the GPT partition the entry's hard-drive node names
    path: str  # the file path node (\EFI\BOOT\BOOTX64.EFI), if any


class Firmware(Protocol):
    """The boot entries of the machine."""

    def entries(self) -> list[BootEntry]: ...

    def boot_order(self) -> list[int]: ...

    def create(self, disk: Path, partition: int, loader: str, label: str) -> int: ...

    def delete(self, number: int) -> None: ...

    def set_order(self, order: Sequence[int]) -> None: ...


def parse_load_option(data: bytes) -> tuple[str, uuid.UUID | None, str]:
    """``(description, partition GUID or None, file path)`` of an ``EFI_LOAD_OPTION``."""
    if len(data) < 6:
        raise ValueError("shorter than an EFI_LOAD_OPTION")
    _attrs, path_length = struct.unpack_from("<IH", data)
    end = 6
    while end + 1 < len(data) and data[end : end + 2] != b"\0\0":
        end += 2
    description = data[6:end].decode("utf-16-le", errors="replace")
    offset = end + 2
    limit = min(len(data), offset + path_length)
    part_guid: uuid.UUID | None = None
    file_path = ""
    while offset + 4 <= limit:
        kind, subtype, length = struct.unpack_from("<BBH", data, offset)
        if length < 4 or offset + length > limit:
            break
        node = data[offset + 4 : offset + length]
        if kind == 4 and subtype == 1 and len(node) >= 38 and node[37] == 2:  # hard drive, GPT signature
            part_guid = uuid.UUID(bytes_le=node[20:36])
        elif kind == 4 and subtype == 4:  # file path
            file_path += node.decode("utf-16-le", errors="replace").rstrip("\0")
        elif kind == 0x7F and subtype == 0xFF:  # end of the device path
            break
        offset += length
    return description, part_guid, file_path


@dataclass
class EfiVars:
    """The machine's firmware through efivarfs and efibootmgr."""

    efivars: Path = EFIVARS

    def _check(self) -> None:
        if not self.efivars.is_dir():
            raise ImagerError(
                Reason.boot_entry,
                f"{self.efivars} is not mounted: this machine did not boot through UEFI, or efivarfs is missing",
                hint="boot the server in UEFI mode (the imager sets UEFI boot entries only)",
            )

    def _read(self, name: str) -> bytes | None:
        try:
            with (self.efivars / name).open("rb") as fh:
                data = fh.read(MAX_VAR_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ImagerError(Reason.boot_entry, f"{self.efivars / name}: {exc.strerror}") from None
        return data[4:] if len(data) <= MAX_VAR_BYTES else None  # the first 4 bytes are the attributes

    def entries(self) -> list[BootEntry]:
        self._check()
        out = []
        for path in sorted(self.efivars.iterdir()):
            match = _BOOT_VAR.fullmatch(path.name)
            data = self._read(path.name) if match else None
            if match is None or data is None:
                continue
            try:
                description, part_guid, file_path = parse_load_option(data)
            except ValueError:
                continue
            out.append(BootEntry(int(match.group(1), 16), description, part_guid, file_path))
        return out

    def boot_order(self) -> list[int]:
        self._check()
        data = self._read(f"BootOrder-{GLOBAL_GUID}") or b""
        return [n for (n,) in struct.iter_unpack("<H", data[: len(data) // 2 * 2])]

    def create(self, disk: Path, partition: int, loader: str, label: str) -> int:
        before = {e.number for e in self.entries()}
        run(["efibootmgr", "-q", "-c", "-d", str(disk), "-p", str(partition), "-l", loader, "-L", label],
            reason=Reason.boot_entry, timeout=60, hint="check that efivarfs is writable (mounted rw)")  # fmt: skip
        added = [e.number for e in self.entries() if e.number not in before]
        if len(added) != 1:
            raise ImagerError(Reason.boot_entry, f"efibootmgr -c added {len(added)} boot entries, not one")
        return added[0]

    def delete(self, number: int) -> None:
        run(["efibootmgr", "-q", "-b", f"{number:04X}", "-B"], reason=Reason.boot_entry, timeout=60)

    def set_order(self, order: Sequence[int]) -> None:
        run(
            ["efibootmgr", "-q", "-o", ",".join(f"{n:04X}" for n in order)],
            reason=Reason.boot_entry,
            timeout=60,
        )


def remove_entries_for(firmware: Firmware, guids: set[uuid.UUID]) -> list[int]:
    """Delete every boot entry that points at one of the partitions ``guids``; returns their numbers."""
    removed = []
    for entry in firmware.entries():
        if entry.part_guid is not None and entry.part_guid in guids:
            firmware.delete(entry.number)
            removed.append(entry.number)
            log.info("removed boot entry Boot%04X (%s), which pointed at partition %s", entry.number,
                     entry.description, entry.part_guid)  # fmt: skip
    return removed


def set_first(firmware: Firmware, number: int) -> list[int]:
    """Put ``number`` first in BootOrder, keeping the others in their order; returns the new order."""
    order = [number, *(n for n in firmware.boot_order() if n != number)]
    firmware.set_order(order)
    return order
