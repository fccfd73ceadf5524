"""The deterministic disk: a GPT, a FAT EFI system partition and an ext4 root, made in one pass on this host.

Given the partition layout of the provisioned disk (:class:`Layout`), the identity of the lock
(:class:`imagebuilder.reproducible.Identity`) and the two trees the seal read (:mod:`imagebuilder.sealtree`),
:func:`assemble` writes a raw disk whose every byte follows from those inputs and the versions of
three host tools (e2fsprogs, dosfstools with mtools, util-linux' sfdisk), whatever the installer, the
block allocator of the build VM, the wall clock, the host's umask, privileges or configuration files:

1. **GPT** (``sfdisk``): the provisioned disk's partitions (start, size, type, name, attributes), the disk
   GUID and the partition GUIDs from the identity;
2. **ESP** (``mkfs.fat --invariant -i <volume id>`` at the partition's offset, then ``mmd`` and
   ``mcopy -m`` in name order): FAT32, times in UTC (``TZ=UTC``), every time mtools writes itself taken
   from ``SOURCE_DATE_EPOCH`` (mtools 4.0.32 reads it), each file's from its clamped mtime;
3. **root** (``mke2fs -d`` at the partition's offset): a pinned ``mke2fs.conf`` of this module
   (``MKE2FS_CONFIG``: the host's /etc/mke2fs.conf never counts), the identity's UUID and hash seed,
   ``E2FSPROGS_FAKE_TIME`` for every time e2fsprogs takes from the clock (superblock, journal, crtime),
   no extended attribute copied from the host (``no_copy_xattrs``). ``mke2fs -d`` walks the tree in
   ``alphasort`` order (scandir, ``LC_ALL=C``), so inode numbers and block placement depend on names, not on
   the order files were written; it copies the source's ctime, atime, mode and owner, which on this host
   are the build's, so then
4. **one debugfs batch** sets every inode's type and mode, owner, mtime (the archive's, clamped), atime,
   ctime and crtime (``SOURCE_DATE_EPOCH``), creates device nodes and FIFOs, and writes extended
   attributes (capabilities) from the archive; ``e2fsck -fn`` then checks the result.

Nothing is half-written: the disk is assembled under a temporary name beside ``out`` and renamed only
when every step passed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuilder.errors import BuildError, CommandError
from imagebuilder.reproducible import EARLIEST, Identity
from imagebuilder.run import run, tool_version
from imagebuilder.sealtree import Entry, Tree

log = logging.getLogger(__name__)

ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPES = frozenset({"0FC63DAF-8483-4772-8E79-3D69D8477DE4", "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"})
SECTOR = 512
BLOCK = 4096
#: The root file system's features: what e2fsprogs 1.47.0 (Debian 12, Ubuntu 24.04) makes by default for ext4
#: without orphan_file and metadata_csum_seed, which GRUB 2.06 cannot read. Pinned here, so that neither the
#: host's /etc/mke2fs.conf nor a newer e2fsprogs' defaults change the image.
MKE2FS_CONF = """\
[defaults]
\tbase_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
\tdefault_mntopts = acl,user_xattr
\tenable_periodic_fsck = 0
\tblocksize = 4096
\tinode_size = 256
\tinode_ratio = 16384
\treserved_ratio = 5.0
\tlazy_itable_init = false
\tlazy_journal_init = false

[fs_types]
\text4 = {
\t\tfeatures = has_journal,extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
\t}
"""
#: mtools reads its configuration files and these variables: pinned, so a host's ~/.mtoolsrc cannot change names.
MTOOLS_ENV = {
    "TZ": "UTC",
    "MTOOLSRC": "/dev/null",
    "MTOOLS_SKIP_CHECK": "1",
    "MTOOLS_LOWER_CASE": "0",
    "MTOOLS_NO_VFAT": "0",
    "MTOOLS_NAME_NUMERIC_TAIL": "1",
    "MTOOLS_FAT_COMPATIBILITY": "0",
}
_GUID = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}")
_PART_NAME = re.compile(r"[A-Za-z0-9 ._+-]{0,36}")
_ATTRS = re.compile(r"[A-Za-z0-9 :=,_-]{0,128}")
_EXT4_LABEL = re.compile(r"[A-Za-z0-9._+-]{0,16}")
_FAT_LABEL = re.compile(r"[A-Z0-9_-]{0,11}")
#: What ext4 needs beyond the file data, as a share of the partition (inode tables, journal, reserve, slack):
#: a tree whose data exceeds the rest is refused before mke2fs runs.
EXT4_OVERHEAD = 0.12


class AssemblyError(BuildError):
    """The deterministic disk could not be made from the trees; the message says which part and why."""


@dataclass(frozen=True)
class Partition:
    number: int
    start: int  # sectors
    size: int  # sectors
    type: str
    name: str = ""
    attrs: str = ""

    @property
    def offset(self) -> int:
        return self.start * SECTOR

    @property
    def bytes(self) -> int:
        return self.size * SECTOR


@dataclass(frozen=True)
class Layout:
    """The GPT of the provisioned disk, and which partition is the ESP and which the root."""

    disk_bytes: int
    first_lba: int
    last_lba: int
    partitions: tuple[Partition, ...]
    esp: int  # partition number
    root: int

    def part(self, number: int) -> Partition:
        return next(p for p in self.partitions if p.number == number)

    def to_json(self) -> dict[str, Any]:
        return {
            "disk_bytes": self.disk_bytes,
            "first_lba": self.first_lba,
            "last_lba": self.last_lba,
            "esp": self.esp,
            "root": self.root,
            "partitions": [p.__dict__ for p in self.partitions],
        }


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AssemblyError(f"the partition table's {what} is not a whole number: {value!r}")
    return value


def layout_from_sfdisk(
    table: Mapping[str, Any], disk_bytes: int, *, root_partition: int | None = None
) -> Layout:
    """The :class:`Layout` of ``sfdisk -J`` output: a GPT of 512-byte sectors with exactly one EFI system
    partition and one Linux root partition (``root_partition``, else the only Linux one), nothing else."""
    pt = table.get("partitiontable", table)
    if not isinstance(pt, Mapping) or pt.get("label") != "gpt":
        raise AssemblyError(
            "the provisioned disk has no GPT: the seal rebuilds UEFI disks with a GPT only",
            hint="firmware: uefi in the definition (a BIOS image cannot be sealed yet)",
        )
    if int(pt.get("sectorsize", SECTOR)) != SECTOR:
        raise AssemblyError(
            f"the provisioned disk has {pt.get('sectorsize')}-byte sectors; the seal takes 512"
        )
    parts: list[Partition] = []
    for raw in pt.get("partitions", []) or []:
        if not isinstance(raw, Mapping):
            raise AssemblyError("the partition table lists a partition that is not an object")
        node = str(raw.get("node", ""))
        number = int(m.group(1)) if (m := re.search(r"(\d+)$", node)) else len(parts) + 1
        ptype = str(raw.get("type", "")).upper()
        name, attrs = str(raw.get("name", "")), str(raw.get("attrs", ""))
        if not _GUID.fullmatch(ptype):
            raise AssemblyError(f"partition {number}: type {ptype!r} is not a GPT type GUID")
        if not _PART_NAME.fullmatch(name) or not _ATTRS.fullmatch(attrs):
            raise AssemblyError(f"partition {number}: name {name!r} or attributes {attrs!r} are not plain")
        parts.append(Partition(number, _int(raw.get("start"), "start"), _int(raw.get("size"), "size"),
                               ptype, name, attrs))  # fmt: skip
    esps = [p for p in parts if p.type == ESP_TYPE]
    linux = [p for p in parts if p.type in LINUX_TYPES]
    if root_partition is not None:
        linux = [p for p in linux if p.number == root_partition]
    if len(esps) != 1 or len(linux) != 1 or len(parts) != 2:
        listed = ", ".join(f"{p.number}: {p.type}" for p in parts) or "none"
        raise AssemblyError(
            f"the provisioned disk's partitions ({listed}) are not one EFI system partition and one Linux root",
            hint="the seal rebuilds the installer's direct layout (ESP + root, docs/reproducible.md); other layouts "
            "are not supported yet",
        )
    first, last = _int(pt.get("firstlba"), "first-lba"), _int(pt.get("lastlba"), "last-lba")
    for p in parts:
        if p.start < first or p.start + p.size - 1 > last or (last + 34) * SECTOR > disk_bytes:
            raise AssemblyError(
                f"partition {p.number} ({p.start}+{p.size}) lies outside the disk of {disk_bytes} bytes"
            )
    if esps[0].bytes < 34 * 2**20:
        raise AssemblyError(
            f"the EFI system partition has {esps[0].bytes >> 20} MiB; FAT32 needs at least 34 MiB"
        )
    return Layout(
        disk_bytes,
        first,
        last,
        tuple(sorted(parts, key=lambda p: p.number)),
        esps[0].number,
        linux[0].number,
    )


# -- the steps --------------------------------------------------------------------------------------------


def _sfdisk_script(layout: Layout, ident: Identity) -> str:
    lines = ["label: gpt", f"label-id: {ident.disk_guid.upper()}", "unit: sectors",
             f"first-lba: {layout.first_lba}", f"last-lba: {layout.last_lba}", "sector-size: 512", ""]  # fmt: skip
    for p in layout.partitions:
        uuid = ident.esp_partition_uuid if p.number == layout.esp else ident.root_partition_uuid
        fields = [f"start={p.start}", f"size={p.size}", f"type={p.type}", f"uuid={uuid.upper()}"]
        if p.name:
            fields.append(f'name="{p.name}"')
        if p.attrs:
            fields.append(f'attrs="{p.attrs}"')
        lines.append(", ".join(fields))
    return "\n".join(lines) + "\n"


def _partition_table(disk: Path, layout: Layout, ident: Identity) -> None:
    run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", "--wipe", "never", str(disk)],
        input_bytes=_sfdisk_script(layout, ident).encode(), hint="sfdisk could not write the sealed disk's GPT")  # fmt: skip


def _esp(disk: Path, part: Partition, tree: Tree, ident: Identity, label: str) -> None:
    if not _FAT_LABEL.fullmatch(label):
        raise AssemblyError(
            f"the EFI system partition's label {label!r} is not a FAT label (A-Z 0-9 _ -, 11)"
        )
    if tree.data_bytes > part.bytes * 0.95:
        raise AssemblyError(
            f"the EFI system partition's files ({tree.data_bytes >> 20} MiB) do not fit its {part.bytes >> 20} MiB",
            hint="stage less onto the ESP",
        )
    env = {**MTOOLS_ENV, "SOURCE_DATE_EPOCH": str(ident.source_date_epoch)}
    per_cluster = "8" if part.bytes >= 300 * 2**20 else "1"  # FAT32 needs at least 65525 clusters
    argv = ["mkfs.fat", "--invariant", "-i", ident.esp_volume_hex, "-F", "32", "-S", "512", "-s", per_cluster,
            "-h", str(part.start), f"--offset={part.start}", "--mbr=n"]  # fmt: skip
    if label:
        argv += ["-n", label]
    run([*argv, str(disk), str(part.bytes // 1024)], env=env, hint="mkfs.fat could not make the ESP")
    image = f"{disk}@@{part.offset}"
    dirs = [e.path for e in tree.entries if e.kind == "dir" and e.path != "/"]
    if dirs:
        run(
            ["mmd", "-i", image, *(f"::{d}" for d in sorted(dirs))],
            env=env,
            hint="mmd failed on the sealed ESP",
        )
    by_dir: dict[str, list[Entry]] = {}
    for e in tree.entries:
        if e.kind == "file":
            by_dir.setdefault(e.path.rsplit("/", 1)[0] or "/", []).append(e)
    for parent in sorted(by_dir):
        files = sorted(by_dir[parent], key=lambda e: e.path)
        for e in files:
            stamp = max(e.mtime, EARLIEST)
            os.utime(tree.host_path(e.path), (stamp, stamp))
        run(["mcopy", "-m", "-o", "-i", image, *(str(tree.host_path(e.path)) for e in files),
             "::" + (parent.rstrip("/") + "/")], env=env, hint="mcopy failed on the sealed ESP")  # fmt: skip


def _root_capacity(part: Partition, tree: Tree) -> None:
    usable = int(part.bytes * (1 - EXT4_OVERHEAD))
    blocks = sum(-(-e.size // BLOCK) for e in tree.entries if e.kind == "file") + sum(
        1 for e in tree.entries if e.kind == "dir"
    )
    if blocks * BLOCK > usable:
        raise AssemblyError(
            f"the root tree needs about {blocks * BLOCK >> 20} MiB ({len(tree.entries)} entries); the root partition "
            f"holds {part.bytes >> 20} MiB, of which about {usable >> 20} MiB take files",
            hint="raise disk_size in the definition (or stage less into the image)",
        )


def _quote(path: str) -> str:
    """A path as debugfs' command parser reads one argument (double quotes, a quote doubled)."""
    return '"' + path.replace('"', '""') + '"'


_TYPE_BITS = {"dir": 0o040000, "file": 0o100000, "symlink": 0o120000, "char": 0o020000, "block": 0o060000,
              "fifo": 0o010000}  # fmt: skip


def debugfs_batch(entries: Iterable[Entry], epoch: int, xattr_dir: Path) -> str:
    """The commands that give every inode its archive metadata and the build's time (one per line)."""
    lines: list[str] = []
    later: list[str] = []
    # in name order: devices and FIFOs get their inode numbers in the order they are made
    for n, e in enumerate(sorted(entries, key=lambda e: os.fsencode(e.path).split(b"/"))):
        q = _quote(e.path)
        if e.kind == "hardlink":
            continue  # the same inode as its target, which carries the metadata
        if e.kind in ("char", "block", "fifo"):
            # debugfs makes a special file in its working folder, under a plain name
            parent, _, name = e.path.rpartition("/")
            how = "p" if e.kind == "fifo" else f"{'c' if e.kind == 'char' else 'b'} {e.major} {e.minor}"
            lines += [f"cd {_quote(parent or '/')}", f"mknod {_quote(name)} {how}", "cd /"]
        later += [
            f"sif {q} mode 0{_TYPE_BITS[e.kind] | e.mode:o}",
            f"sif {q} uid {e.uid}",
            f"sif {q} gid {e.gid}",
            f"sif {q} mtime @{e.mtime}",
            f"sif {q} atime @{epoch}",
            f"sif {q} ctime @{epoch}",
            f"sif {q} crtime @{epoch}",
        ]
        for i, (name, value) in enumerate(e.xattrs):
            value_file = xattr_dir / f"{n}.{i}"
            value_file.write_bytes(value)
            later.append(f"ea_set -f {_quote(str(value_file))} {q} {name}")
    return "\n".join(lines + later) + "\n"


def _root(disk: Path, part: Partition, tree: Tree, ident: Identity, *, label: str, work: Path) -> None:
    if not _EXT4_LABEL.fullmatch(label):
        raise AssemblyError(
            f"the root file system's label {label!r} is not a plain ext4 label (16 characters)"
        )
    _root_capacity(part, tree)
    conf = work / "mke2fs.conf"
    conf.write_text(MKE2FS_CONF, encoding="utf-8")
    epoch = str(ident.source_date_epoch)
    env = {"MKE2FS_CONFIG": str(conf), "E2FSPROGS_FAKE_TIME": epoch, "SOURCE_DATE_EPOCH": epoch, "LC_ALL": "C",
           "MKE2FS_SYNC": "0", "MKE2FS_DEVICE_SECTSIZE": "512", "MKE2FS_DEVICE_PHYS_SECTSIZE": "512"}  # fmt: skip
    extended = (f"hash_seed={ident.root_hash_seed},offset={part.offset},no_copy_xattrs,root_owner=0:0,"
                "lazy_itable_init=0,lazy_journal_init=0,nodiscard")  # fmt: skip
    argv = ["mke2fs", "-q", "-F", "-t", "ext4", "-b", str(BLOCK), "-I", "256", "-i", "16384", "-m", "5",
            "-U", ident.root_fs_uuid, "-E", extended, "-d", str(tree.root)]  # fmt: skip
    if label:
        argv += ["-L", label]
    try:
        run([*argv, str(disk), f"{part.bytes // 1024}k"], env=env, timeout=3600)
    except CommandError as exc:
        # _root_capacity refused what cannot fit before mke2fs ran; a failure here is mke2fs's own, named as it is
        last = (exc.output.strip().splitlines() or [""])[-1]
        raise AssemblyError(
            f"mke2fs could not build the root file system of {part.bytes >> 20} MiB: {last}",
            hint="if it ran out of room, raise disk_size in the definition (or stage less into the image); "
            "otherwise keep the work directory (--keep-work) and report it",
        ) from exc
    device = f"{disk}?offset={part.offset}"
    xattrs = work / "xattrs"
    xattrs.mkdir()
    batch = work / "debugfs.batch"
    batch.write_bytes(os.fsencode(debugfs_batch(tree.entries, ident.source_date_epoch, xattrs)))
    done = run(["debugfs", "-w", "-f", str(batch), device], env=env, timeout=3600)
    problems = [line for line in done.stderr.decode(errors="replace").splitlines()
                if line.strip() and not line.startswith("debugfs ")]  # fmt: skip
    if problems:
        raise AssemblyError(
            f"debugfs could not set the root file system's metadata: {len(problems)} problem(s): "
            + "; ".join(problems[:5])
        )
    # libext2fs adds each read-write session's write statistics to s_kbytes_written when it closes the file
    # system; what mke2fs -d and the batch wrote is not the same to the kilobyte from run to run (dumpe2fs prints
    # it rounded to MB, so only the superblock's checksum showed it): a fixed 0, set by a session that writes
    # nothing before its own flush
    run(["debugfs", "-w", "-R", "ssv kbytes_written 0", device], env=env, timeout=600)
    checked = run(["e2fsck", "-fn", device], env=env, check=False, timeout=3600)
    if checked.returncode != 0:
        last = (checked.text.strip().splitlines() or [""])[-1]
        raise AssemblyError(
            f"the sealed root file system fails e2fsck -fn (status {checked.returncode}): {last}",
            hint="a bug of the seal: keep the work directory (--keep-work) and report it",
        )


@dataclass(frozen=True)
class Assembled:
    disk: Path
    root_used_bytes: int  # used blocks of the root file system, times its block size
    tools: dict[str, str]


def tool_versions() -> dict[str, str]:
    """The versions of the host tools whose behaviour the image's bytes depend on (recorded in the manifest)."""
    return {
        "mke2fs": tool_version("mke2fs", "-V"),
        "mkfs.fat": tool_version("mkfs.fat", "--help"),
        "mtools": tool_version("mcopy", "--version"),
        "sfdisk": tool_version("sfdisk", "--version"),
    }


def _used_bytes(disk: Path, part: Partition) -> int:
    text = run(["dumpe2fs", "-h", f"{disk}?offset={part.offset}"], timeout=600).text
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        total, free = int(fields["Block count"]), int(fields["Free blocks"])
        size = int(fields["Block size"])
    except (KeyError, ValueError) as exc:
        raise AssemblyError(f"dumpe2fs did not report the sealed root's size: {exc}") from exc
    return (total - free) * size


def assemble(
    out: Path,
    layout: Layout,
    ident: Identity,
    *,
    esp: Tree,
    root: Tree,
    esp_label: str,
    root_label: str,
    work: Path,
) -> Assembled:
    """Write the raw disk ``out`` from ``layout``, ``ident`` and the two trees (see the module's docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.partial")
    temp.unlink(missing_ok=True)
    try:
        with temp.open("wb") as fh:
            fh.truncate(layout.disk_bytes)
        _partition_table(temp, layout, ident)
        _esp(temp, layout.part(layout.esp), esp, ident, esp_label)
        _root(temp, layout.part(layout.root), root, ident, label=root_label, work=work)
        used = _used_bytes(temp, layout.part(layout.root))
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work / "xattrs", ignore_errors=True)
    log.info("seal: assembled %s (root file system %d MiB used)", out.name, used >> 20)
    return Assembled(out, used, tool_versions())
