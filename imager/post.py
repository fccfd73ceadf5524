"""After the write: repair the backup GPT, check the table, and check the image's partitions resolve
on the target disk and nowhere else.

* :func:`relocate_backup`: an image smaller than the disk leaves its backup GPT in the middle of
  the disk; ``sfdisk --relocate gpt-bak-std`` moves it to the last sector and extends the usable
  range (what ``sgdisk -e`` does).
* :func:`check_table`: our own reader (:mod:`imager.gpt`) must then find a valid primary and
  backup GPT in place, the partitions inside the usable range, exactly one EFI system partition
  and a root partition.
* :func:`check_unique`: the EFI system partition and the root partition are found at boot by
  PARTUUID (the boot entry), file-system UUID and label (``/etc/fstab``, ``root=`` in GRUB): if
  another disk of the machine carries any of them (an old copy of the same image, a clone), the
  node could boot or mount the wrong disk. Every other block device is read (its GPT by our reader,
  its file systems by ``blkid -p`` at their offsets, and udev's properties); a clash is refused
  naming the other disk, and the operator wipes it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from imager.errors import ImagerError, Reason
from imager.gpt import Entry, Gpt, read_gpt
from imager.inventory import Disk
from imager.run import run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ident:
    """One way a partition can be found at boot."""

    kind: str  # "PARTUUID", "UUID" or "LABEL"
    value: str
    what: str  # "EFI system partition", "root partition", "seed"

    def key(self) -> tuple[str, str]:
        return self.kind, self.value.lower() if self.kind != "LABEL" else self.value


def relocate_backup(path: Path) -> None:
    run(["sfdisk", "--relocate", "gpt-bak-std", str(path)], reason=Reason.gpt, timeout=120,
        hint="the written image has no GPT sfdisk can read: rebuild the image")  # fmt: skip


def check_table(path: Path) -> tuple[Gpt, Entry, Entry]:
    """The disk's GPT, its EFI system partition and its root partition; ImagerError(gpt) otherwise."""
    table = read_gpt(path)
    if table.problems:
        raise ImagerError(
            Reason.gpt,
            f"{path}: the partition table is not sound after writing: {'; '.join(table.problems)}",
        )
    esp, root = table.esp(), table.root()
    if esp is None:
        raise ImagerError(
            Reason.gpt,
            f"{path}: the image has no single EFI system partition",
            hint="rebuild the image for UEFI",
        )
    if root is None:
        raise ImagerError(Reason.gpt, f"{path}: the image has no Linux root partition")
    return table, esp, root


def probe(path: Path, offset: int, size: int) -> dict[str, str]:
    """``blkid -p`` of the file system at ``offset`` of ``path`` (KEY=VALUE export format); {} if none."""
    result = run(["blkid", "-p", "-o", "export", "--offset", str(offset), "--size", str(size), str(path)],
                 reason=Reason.gpt, check=False, timeout=60)  # fmt: skip
    if result.returncode not in (0, 2):  # 2: nothing found
        log.warning("blkid on %s at %d exited %d", path, offset, result.returncode)
    out: dict[str, str] = {}
    for line in result.text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


def identities(path: Path, entries: Iterable[tuple[Entry, str]]) -> list[Ident]:
    found: list[Ident] = []
    for entry, what in entries:
        found.append(Ident("PARTUUID", str(entry.part_guid), what))
        fs = probe(path, entry.offset, entry.size)
        if fs.get("UUID"):
            found.append(Ident("UUID", fs["UUID"], what))
        if fs.get("LABEL"):
            found.append(Ident("LABEL", fs["LABEL"], what))
    return found


def _elsewhere(disk: Disk) -> list[tuple[str, str]]:
    """Every (kind, value) by which a partition of ``disk`` can be found."""
    found: list[tuple[str, str]] = []
    for part in disk.partitions:
        found += [
            (k, v)
            for k, v in (("PARTUUID", part.part_uuid), ("UUID", part.fs_uuid), ("LABEL", part.fs_label))
            if v
        ]
    if disk.kind in ("ram", "zram", "optical") or disk.size == 0:
        return found
    try:
        table = read_gpt(disk.devnode)
    except ImagerError:
        return found  # no GPT (or unreadable): udev's view above is all there is
    for entry in table.entries:
        found.append(("PARTUUID", str(entry.part_guid)))
        fs = probe(disk.devnode, entry.offset, entry.size)
        found += [(k, fs[k]) for k in ("UUID", "LABEL") if fs.get(k)]
    return found


def check_unique(target: Disk, wanted: Sequence[Ident], disks: Sequence[Disk]) -> None:
    """Refuse if any identity of ``wanted`` also resolves on a disk other than ``target``."""
    keys = {ident.key(): ident for ident in wanted}
    clashes: list[str] = []
    for disk in disks:
        if disk.major_minor == target.major_minor or disk.devnode == target.devnode:
            continue
        for kind, value in _elsewhere(disk):
            ident = keys.get((kind, value.lower() if kind != "LABEL" else value))
            if ident is not None:
                clashes.append(f"{ident.what} {ident.kind}={ident.value} also on {disk.describe()}")
    if clashes:
        raise ImagerError(
            Reason.partition_elsewhere,
            "the image's partitions would not resolve to this disk only: " + "; ".join(sorted(set(clashes))),
            hint="wipe the other disk's old copy (wipefs -a on it) or remove it, then image again",
            details={"clashes": sorted(set(clashes))},
        )
