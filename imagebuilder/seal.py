"""The seal: the provisioned image's file systems exported from the build VM, assembled again deterministically.

The provisioning boot ends with the staging plan's ``seal`` step (cloud-init/stage.sh): inside the
guest, where owners, modes and capabilities are what the image holds, it writes one POSIX tar archive of
the finished root file system (a bind mount of ``/``: nothing mounted over it) and of the EFI system
partition onto a raw disk of its own (serial :data:`SERIAL`), and at its start a header
(:class:`Header`): the provisioned disk's size and GPT (``sfdisk -J``), which partitions are the root
and the ESP, their labels, and the identifiers the installer gave the disk, which the image must no
longer name. :func:`seal` reads it on the host (:mod:`imagebuilder.sealtree`: every member checked;
content on the host, metadata kept) and writes the image's raw disk in one pass
(:mod:`imagebuilder.assemble`) with the lock's identifiers and ``SOURCE_DATE_EPOCH``
(:mod:`imagebuilder.reproducible`). The result does not depend on which installer ran, how the build VM
placed blocks, or when: docs/reproducible.md.

Seal disk layout::

    0        "NODETRUST-SEAL 1\\n" + one line of JSON (the header) + "\\n", zero-padded
    1 MiB    the archive: root/... (the root file system) then esp/... (the EFI system partition)

Two further jobs happen here because the seal reads every byte of the image anyway: the archive
is searched for the installer's identifiers (a file that still names them would make the image differ
from build to build, and name a file system that no longer exists) and for the build's credentials
(:data:`SCRUB` removes what normally holds them); either fails the build, naming the files.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder.assemble import Assembled, Layout, assemble, layout_from_sfdisk
from imagebuilder.errors import BuildError
from imagebuilder.reproducible import Identity
from imagebuilder.sealtree import Tree, read_archive

log = logging.getLogger(__name__)

#: The serial of the raw disk the provisioning boot writes the seal archive to.
SERIAL = "nodetrust-seal"
MAGIC = b"NODETRUST-SEAL 1\n"
ARCHIVE_OFFSET = 1 << 20
HEADER_LIMIT = ARCHIVE_OFFSET
#: The seal disk is larger than the image's disk by this much (a tar archive's headers and padding).
SLACK = 1 << 30
_UUID = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}")
_VOLID = re.compile(r"[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}")
_DEVICE = re.compile(r"/dev/[a-z0-9]+?p?(\d+)")

#: What the staging plan removes from the image before the seal (plan entries ``remove`` and ``empty``,
#: in this order). The installer's logs carry the autoinstall user-data with the build's webhook token;
#: the rest are build records and caches whose bytes depend on the time or the order of the build.
SCRUB: tuple[tuple[str, str], ...] = (
    ("remove", "/var/log/installer"),  # the installer's logs, journal and copy of the autoinstall user-data
    ("remove", "/var/log/journal/*"),  # journals of the build VMs, in folders named by their machine ids
    ("empty", "/var/log"),  # every log file (dpkg, apt, cloud-init, alternatives...): the folders stay
    ("remove", "/var/cache/apt/*.bin"),  # apt's binary caches: they hold the mtimes of the lists
    ("remove", "/var/cache/ldconfig/aux-cache"),  # ldconfig's: inode numbers and ctimes of the libraries
    ("remove", "/var/cache/debconf/*-old"),  # debconf's backups of its own database
    ("remove", "/var/lib/dpkg/*-old"),  # dpkg's copies of its status before the last run
    ("remove", "/var/backups/*"),
    ("remove", "/root/.cache"),
    ("remove", "/tmp/*"),  # noqa: S108 - a path in the image: hidden under the build VM's tmpfs, not the image's
    ("remove", "/var/tmp/*"),  # noqa: S108 - a path in the image
)


@dataclass(frozen=True)
class PartInfo:
    number: int
    label: str
    uuid: str  # the file system's UUID (a FAT volume ID for the ESP) as the installer made it
    partuuid: str


@dataclass(frozen=True)
class Header:
    disk_bytes: int
    table: dict[str, Any]
    root: PartInfo
    esp: PartInfo
    disk_guid: str
    archive_bytes: int

    def layout(self) -> Layout:
        return layout_from_sfdisk(self.table, self.disk_bytes, root_partition=self.root.number)

    def old_identifiers(self) -> dict[str, bytes]:
        """What the image must no longer name: the installer's random identifiers (label -> bytes)."""
        return {
            "the installer's root file system UUID": self.root.uuid.encode(),
            "the installer's EFI system partition volume ID": self.esp.uuid.encode(),
            "the installer's root partition GUID": self.root.partuuid.encode(),
            "the installer's EFI system partition GUID": self.esp.partuuid.encode(),
            "the installer's disk GUID": self.disk_guid.encode(),
        }


class SealError(BuildError):
    """The seal disk is missing, unreadable, or holds what the image must not."""


def _part(data: object, what: str) -> PartInfo:
    if not isinstance(data, dict):
        raise SealError(f"the seal header's {what} is not an object")
    device = str(data.get("partition", ""))
    match = _DEVICE.fullmatch(device)
    label, uuid, partuuid = (str(data.get(k, "")) for k in ("label", "uuid", "partuuid"))
    problems = []
    if match is None:
        problems.append(f"partition {device!r} is not a partition device")
    if not (_UUID.fullmatch(uuid) or _VOLID.fullmatch(uuid)):
        problems.append(f"uuid {uuid!r}")
    if not _UUID.fullmatch(partuuid):
        problems.append(f"partuuid {partuuid!r}")
    if not re.fullmatch(r"[A-Za-z0-9._+ -]{0,16}", label):
        problems.append(f"label {label!r}")
    if problems or match is None:
        raise SealError(f"the seal header's {what}: " + ", ".join(problems))
    return PartInfo(int(match.group(1)), label.strip(), uuid, partuuid)


def read_header(raw: Path) -> Header:
    """The header of the seal disk ``raw``: what the provisioning boot's seal step wrote before its archive."""
    try:
        with raw.open("rb") as fh:
            head = fh.read(HEADER_LIMIT)
    except OSError as exc:
        raise SealError(f"cannot read the seal disk {raw}: {exc.strerror}") from exc
    if not head.startswith(MAGIC):
        raise SealError(
            "the provisioning boot wrote no seal (the seal disk has no NODETRUST-SEAL header)",
            hint="the staging plan's seal step did not run or failed: see the console log around `seal`",
        )
    line = head[len(MAGIC) :].split(b"\n", 1)[0]
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise SealError(f"the seal header is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SealError("the seal header is not a JSON object")
    disk_bytes, archive = data.get("disk_bytes"), data.get("archive")
    table, guid = data.get("table"), str(data.get("disk_guid", ""))
    if not isinstance(disk_bytes, int) or disk_bytes <= 0 or not isinstance(table, dict):
        raise SealError("the seal header has no disk size or partition table")
    if not isinstance(archive, dict) or not isinstance(archive.get("bytes"), int) or archive["bytes"] <= 0:
        raise SealError("the seal header does not say how long the archive is")
    if archive.get("offset", ARCHIVE_OFFSET) != ARCHIVE_OFFSET:
        raise SealError(
            f"the seal archive is expected at {ARCHIVE_OFFSET}, the header says {archive.get('offset')}"
        )
    if not _UUID.fullmatch(guid):
        raise SealError(f"the seal header's disk_guid {guid!r} is not a GUID")
    return Header(disk_bytes, table, _part(data.get("root"), "root"), _part(data.get("esp"), "esp"), guid,
                  int(archive["bytes"]))  # fmt: skip


@dataclass
class Sealed:
    """What the seal made and what it took."""

    disk: Path
    header: Header
    assembled: Assembled
    entries: int
    archive_bytes: int
    timings: dict[str, float] = field(default_factory=dict)


def _refuse_findings(trees: Mapping[str, Tree], credentials: Mapping[str, bytes]) -> None:
    problems: list[str] = []
    leaked = False
    for name, tree in trees.items():
        for label, paths in sorted(tree.found.items()):
            where = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
            problems.append(f"{label} in the {name} tree: {where}")
            leaked = leaked or label in credentials
    if not problems:
        return
    if leaked:
        raise SealError(
            "the image would carry a credential of the build: " + "; ".join(problems),
            hint="the staging plan's scrub list (imagebuilder.seal.SCRUB) must remove the files that hold it",
        )
    raise SealError(
        "the image still names identifiers the installer chose at random: " + "; ".join(problems),
        hint="the staging plan's identify step rewrites /etc, /boot and the ESP; a file elsewhere that names the "
        "disk by its old identifiers must be rewritten there too (docs/reproducible.md)",
    )


def seal(
    seal_disk: Path,
    out: Path,
    ident: Identity,
    *,
    work: Path,
    credentials: Mapping[str, bytes] | None = None,
) -> Sealed:
    """Read ``seal_disk`` and write the image's raw disk ``out`` (module docstring). ``credentials`` maps a
    label (never the secret itself) to a byte string the image must not hold."""
    started = time.monotonic()
    header = read_header(seal_disk)
    layout = header.layout()
    if layout.disk_bytes != header.disk_bytes:
        raise SealError("the seal header's disk size and partition table disagree")
    needles = {k: v for k, v in header.old_identifiers().items() if v.lower() not in _new_ids(ident)}
    needles.update(credentials or {})
    trees_dir = work / "trees"
    trees_dir.mkdir(parents=True, exist_ok=True)
    try:
        with seal_disk.open("rb") as fh:
            trees = read_archive(
                fh,
                offset=ARCHIVE_OFFSET,
                length=header.archive_bytes,
                trees={
                    "root": (trees_dir / "root", "root", layout.part(layout.root).bytes),
                    "esp": (trees_dir / "esp", "esp", layout.part(layout.esp).bytes),
                },
                epoch=ident.source_date_epoch,
                needles=needles,
            )
        read_s = time.monotonic() - started
        _refuse_findings(trees, credentials or {})
        assembled = assemble(out, layout, ident, esp=trees["esp"], root=trees["root"], esp_label=header.esp.label,
                             root_label=header.root.label, work=work / "assemble")  # fmt: skip
    finally:
        shutil.rmtree(trees_dir, ignore_errors=True)
    entries = sum(len(t.entries) for t in trees.values())
    total = time.monotonic() - started
    log.info("seal: %d entries, %d MiB of archive read in %.1f s; disk assembled in %.1f s", entries,
             header.archive_bytes >> 20, read_s, total - read_s)  # fmt: skip
    return Sealed(out, header, assembled, entries, header.archive_bytes,
                  {"read_s": round(read_s, 1), "assemble_s": round(total - read_s, 1)})  # fmt: skip


def _new_ids(ident: Identity) -> set[bytes]:
    values = (ident.disk_guid, ident.esp_partition_uuid, ident.root_partition_uuid, ident.root_fs_uuid,
              ident.esp_volume_id)  # fmt: skip
    return {v.lower().encode() for v in values}


@dataclass(frozen=True)
class PlanLines:
    """The staging plan's lines for a sealed image (cloud-init/stage.sh), by where they go."""

    first: list[
        str
    ]  # ``epoch``: SOURCE_DATE_EPOCH for every tool of the plan (pip's bytecode: source hashes)
    before_bootloader: list[str]  # ``identify``: /etc, /boot and the ESP name the lock's identifiers
    last: list[
        str
    ]  # the scrub list, ``shadow`` (password ages clamped), ``seal`` (after the plan's clean-up)


def plan_lines(ident: Identity) -> PlanLines:
    return PlanLines(
        first=[f"epoch\t{ident.source_date_epoch}"],
        before_bootloader=[
            f"identify\t{ident.root_fs_uuid}\t{ident.esp_volume_id}\t{ident.disk_guid}\t"
            f"{ident.root_partition_uuid}\t{ident.esp_partition_uuid}"
        ],
        last=[
            *(f"{kind}\t{path}" for kind, path in SCRUB),
            f"shadow\t{ident.source_date_epoch}",
            f"seal\t{SERIAL}",
        ],
    )
