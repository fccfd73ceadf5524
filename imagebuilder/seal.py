"""The seal: the provisioned image's file systems assembled again, deterministically, on this host.

After the provisioning boot powered off, the ``seal`` phase reads its disk offline (the build's overlay
of the installed base: :func:`read_provisioned`): the GPT and the two file systems' labels and
identifiers, the root file system (ext4, its journal replayed on a copy) and the EFI system partition
(FAT) as trees (:mod:`imagebuilder.disktree`: content on this host, every member's metadata kept,
mtimes clamped to ``SOURCE_DATE_EPOCH``). :func:`seal` then writes the image's raw disk in one pass
(:mod:`imagebuilder.assemble`) with the lock's identifiers and time (:mod:`imagebuilder.reproducible`).
The result does not depend on which installer ran, how the build VM placed blocks, or when:
docs/reproducible.md.

The same assembly takes a tar archive of the two trees (:func:`source_from_archive`,
:mod:`imagebuilder.sealtree`: every member checked), for trees that do not come from a VM.

Two further jobs happen here because the seal reads every byte of the image anyway: every file,
symbolic link target and extended attribute is searched for the installer's identifiers (a file that
still names them would make the image differ from build to build, and name a file system that no
longer exists) and for the build's credentials (:data:`SCRUB` removes what normally holds them);
either fails the build, naming the files, never the secret.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from imagebuilder.assemble import Assembled, Layout, assemble, layout_from_sfdisk
from imagebuilder.disktree import read_ext4, read_fat
from imagebuilder.errors import BuildError, CommandError
from imagebuilder.reproducible import Identity, TimeClamp
from imagebuilder.run import run
from imagebuilder.sealtree import Tree, read_archive

log = logging.getLogger(__name__)

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


#: Folders whose bbolt databases the staging plan rewrites canonically (plan entry ``bolt``,
#: imagebuilder/guest/boltcanon.py): containerd's, after the build imported the node's images.
BOLT_DIRS = ("/var/lib/containerd",)
#: The rewriting script, on the staging medium.
BOLT_SCRIPT = "boltcanon.py"


class SealError(BuildError):
    """The provisioned disk cannot be read, or holds what the image must not."""


@dataclass
class Source:
    """What the seal assembles: the provisioned disk's layout, labels and identifiers, and its two trees."""

    layout: Layout
    root_label: str
    esp_label: str
    old_ids: dict[
        str, bytes
    ]  # the installer's random identifiers (label -> bytes): the image must not name them
    trees: dict[str, Tree]  # root, esp
    timings: dict[str, float] = field(default_factory=dict)


def _probe(raw: Path, offset: int) -> dict[str, str]:
    out = run(["blkid", "-p", "-O", str(offset), "-o", "export", str(raw)], check=False, timeout=120).text
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _copy_range(source: Path, dest: Path, offset: int, size: int) -> None:
    """``size`` bytes of ``source`` from ``offset`` into the new file ``dest``, its holes kept."""
    with source.open("rb") as src, dest.open("wb") as out:
        out.truncate(size)
        fd, pos, end = src.fileno(), offset, offset + size
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            if data >= end:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            out.seek(data - offset)
            src.seek(data)
            left = hole - data
            while left > 0:
                chunk = src.read(min(left, 16 << 20))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
            pos = hole


def read_provisioned(
    disk: Path, work: Path, *, clamp: TimeClamp, needles: Mapping[str, bytes] | None = None
) -> Source:
    """The provisioned disk ``disk`` (a QCOW2, its backing chain included), read offline into ``work``; every
    time stamp through ``clamp``."""
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "provisioned.raw"
    image = work / "root.ext4"
    try:
        run(["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(disk), str(raw)], timeout=3600,
            hint="qemu-img could not read the provisioned disk")  # fmt: skip
        try:
            table = json.loads(run(["sfdisk", "-J", str(raw)], timeout=120).stdout)
        except (ValueError, CommandError) as exc:
            raise SealError(f"the provisioned disk has no readable partition table: {exc}") from exc
        layout = layout_from_sfdisk(table, raw.stat().st_size)
        root_part, esp_part = layout.part(layout.root), layout.part(layout.esp)
        root, esp = _probe(raw, root_part.offset), _probe(raw, esp_part.offset)
        if root.get("TYPE") != "ext4" or esp.get("TYPE") != "vfat":
            raise SealError(
                f"the provisioned root file system is {root.get('TYPE') or 'unknown'} and the ESP "
                f"{esp.get('TYPE') or 'unknown'}: the seal reads an ext4 root and a FAT ESP",
                hint="the installer's direct layout makes both (docs/reproducible.md, Limits)",
            )
        pt = table.get("partitiontable", {})
        parts = {
            int(m[1]): p
            for p in pt.get("partitions", [])
            if (m := re.search(r"(\d+)$", str(p.get("node", ""))))
        }
        old_ids = {
            "the installer's root file system UUID": root.get("UUID", "").encode(),
            "the installer's EFI system partition volume ID": esp.get("UUID", "").encode(),
            "the installer's root partition GUID": str(parts.get(layout.root, {}).get("uuid", "")).encode(),
            "the installer's EFI system partition GUID": str(
                parts.get(layout.esp, {}).get("uuid", "")
            ).encode(),
            "the installer's disk GUID": str(pt.get("id", "")).encode(),
        }
        all_needles = {**{k: v for k, v in old_ids.items() if v}, **(needles or {})}
        _copy_range(raw, image, root_part.offset, root_part.bytes)
        fsck = run(["e2fsck", "-fy", str(image)], check=False, timeout=3600)
        if fsck.returncode not in (0, 1):
            raise SealError(
                f"the provisioned root file system fails e2fsck (status {fsck.returncode}): "
                + (fsck.text.strip().splitlines() or [""])[-1],
                hint="see the console log of the provisioning boot (did it power off cleanly?)",
            )
        copied = time.monotonic()
        trees = {
            "root": read_ext4(image, work / "root", clamp=clamp, needles=all_needles, work=work / "debugfs"),
            "esp": read_fat(raw, esp_part.offset, work / "esp", clamp=clamp, needles=all_needles),
        }
    finally:
        raw.unlink(missing_ok=True)
        image.unlink(missing_ok=True)
    done = time.monotonic()
    return Source(layout, root.get("LABEL", ""), esp.get("LABEL", ""), old_ids, trees,
                  {"copy_s": round(copied - started, 1), "read_s": round(done - copied, 1)})  # fmt: skip


def source_from_archive(
    fh: IO[bytes], length: int, layout: Layout, work: Path, *, epoch: int, labels: tuple[str, str] = ("", ""),
    old_ids: Mapping[str, bytes] | None = None, needles: Mapping[str, bytes] | None = None,
) -> Source:  # fmt: skip
    """A :class:`Source` from a tar archive of ``root/...`` and ``esp/...`` (:func:`imagebuilder.sealtree.read_archive`)
    for ``layout``; ``labels`` are the root's and the ESP's."""
    trees = read_archive(
        fh, offset=0, length=length, epoch=epoch, needles={**(old_ids or {}), **(needles or {})},
        trees={"root": (work / "root", "root", layout.part(layout.root).bytes),
               "esp": (work / "esp", "esp", layout.part(layout.esp).bytes)},
    )  # fmt: skip
    return Source(layout, labels[0], labels[1], dict(old_ids or {}), trees)


@dataclass
class Sealed:
    """What the seal made and what it took."""

    disk: Path
    layout: Layout
    assembled: Assembled
    entries: int
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
    source: Source,
    out: Path,
    ident: Identity,
    *,
    work: Path,
    credentials: Mapping[str, bytes] | None = None,
) -> Sealed:
    """Write the image's raw disk ``out`` from ``source`` (module docstring). ``credentials`` maps a label (never
    the secret itself) to a byte string the image must not hold: a tree that holds one, or still names one of the
    installer's identifiers, is refused. The trees' folders are removed either way."""
    started = time.monotonic()
    try:
        _refuse_findings(source.trees, credentials or {})
        assembled = assemble(out, source.layout, ident, esp=source.trees["esp"], root=source.trees["root"],
                             esp_label=source.esp_label, root_label=source.root_label, work=work / "assemble")  # fmt: skip
    finally:
        for tree in source.trees.values():
            shutil.rmtree(tree.root, ignore_errors=True)
    entries = sum(len(t.entries) for t in source.trees.values())
    timings = {**source.timings, "assemble_s": round(time.monotonic() - started, 1)}
    log.info("seal: %d entries; %s", entries, ", ".join(f"{k} {v} s" for k, v in timings.items()))
    return Sealed(out, source.layout, assembled, entries, timings)


def _new_ids(ident: Identity) -> set[bytes]:
    values = (ident.disk_guid, ident.esp_partition_uuid, ident.root_partition_uuid, ident.root_fs_uuid,
              ident.esp_volume_id)  # fmt: skip
    return {v.lower().encode() for v in values}


@dataclass(frozen=True)
class PlanLines:
    """The staging plan's lines for a sealed image (cloud-init/stage.sh), by where they go."""

    #: ``epoch``: SOURCE_DATE_EPOCH for every tool of the plan (pip's bytecode then holds source hashes)
    first: list[str]
    #: ``identify``: /etc, /boot and the ESP name the lock's identifiers
    before_bootloader: list[str]
    #: ``bolt`` (containerd's databases), the scrub list, ``shadow`` (password ages)
    last: list[str]


def plan_lines(ident: Identity) -> PlanLines:
    return PlanLines(
        first=[f"epoch\t{ident.source_date_epoch}"],
        before_bootloader=[
            f"identify\t{ident.root_fs_uuid}\t{ident.esp_volume_id}\t{ident.disk_guid}\t"
            f"{ident.root_partition_uuid}\t{ident.esp_partition_uuid}"
        ],
        last=[
            *(f"bolt\t{path}" for path in BOLT_DIRS),
            *(f"{kind}\t{path}" for kind, path in SCRUB),
            f"shadow\t{ident.source_date_epoch}",
        ],
    )
