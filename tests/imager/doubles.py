"""Test doubles for what a development machine does not have, behind the imager's own interfaces.

* :class:`FirmwareDouble`: UEFI boot entries in memory, behind :class:`imager.efi.Firmware`. A
  development machine has no UEFI firmware of its own (no efivarfs); the VM test exercises the
  real OVMF NVRAM through efibootmgr.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from imager.efi import BootEntry
from imager.gpt import read_gpt


@dataclass
class FirmwareDouble:
    """Boot entries and BootOrder, as a firmware keeps them; ``create`` reads the disk's GPT for the
    partition GUID, as efibootmgr does."""

    boot: dict[int, BootEntry] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def entries(self) -> list[BootEntry]:
        return [self.boot[n] for n in sorted(self.boot)]

    def boot_order(self) -> list[int]:
        return list(self.order)

    def create(self, disk: Path, partition: int, loader: str, label: str) -> int:
        entry = next(e for e in read_gpt(disk).entries if e.number == partition)
        number = next(n for n in range(0x10000) if n not in self.boot)
        self.boot[number] = BootEntry(number, label, entry.part_guid, loader)
        self.order.insert(0, number)
        self.log.append(f"create {number:04X}")
        return number

    def delete(self, number: int) -> None:
        del self.boot[number]
        self.order = [n for n in self.order if n != number]
        self.log.append(f"delete {number:04X}")

    def set_order(self, order: Sequence[int]) -> None:
        self.order = list(order)
        self.log.append("order " + ",".join(f"{n:04X}" for n in order))

    def add(self, description: str, part_guid: uuid.UUID | None, path: str = "") -> int:
        """An entry that was there before the imager ran (PXE, an old install)."""
        number = next(n for n in range(0x10000) if n not in self.boot)
        self.boot[number] = BootEntry(number, description, part_guid, path)
        self.order.append(number)
        return number
