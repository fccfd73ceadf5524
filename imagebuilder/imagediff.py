"""What differs between two images of one lock: the partition table, the file systems' metadata, the files.

``imagebuilder rebuild`` calls :func:`diff_images` when the rebuilt image's digest is not the published
one. Both QCOW2 files are converted to sparse raw files (the format named, never probed) and read
offline, nothing mounted:

* **partition table** (``sfdisk -J``): the disk GUID, and each partition's start, size, type, GUID,
  name and attributes;
* **file-system metadata**: every field of the root file system's superblock (``dumpe2fs -h``: UUID,
  hash seed, times, feature flags, counts) and the ESP's volume ID, label and boot sector;
* **files**: both root file systems dumped (``debugfs rdump``) and the ESPs copied out (``mcopy -s``),
  then every path compared: present on one side only, type, mode, owner, mtime, size, symbolic link
  target, content (a ``.pyc`` whose difference is in its 16-byte header says so: the source's mtime or
  hash). When no file differs, the difference is in what a file listing does not show: block placement,
  inode numbers, other time stamps, extended attributes.

Owners are compared only when this runs as root (``rdump`` can set them only then).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder.errors import CommandError, OutputError
from imagebuilder.run import run

log = logging.getLogger(__name__)

ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPES = {"0FC63DAF-8483-4772-8E79-3D69D8477DE4", "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"}
#: Differing files listed per kind of change (all are counted): a thousand files that differ only in mtime must
#: not hide the one file that is on one side only.
MAX_FILES = 200
#: The order a reader needs them in: what is there, what it holds, then its metadata.
ORDER = (
    "only in published",
    "only in rebuilt",
    "type",
    "size",
    "content",
    "target",
    "mode",
    "owner",
    "mtime",
)
#: blkid fields that name the probe, not the file system
_PROBE_NOISE = frozenset({"DEVNAME"})
MTOOLS_ENV = {"TZ": "UTC", "MTOOLS_SKIP_CHECK": "1", "MTOOLSRC": "/dev/null"}


@dataclass(frozen=True)
class FileChange:
    tree: str  # root | esp
    path: str
    change: (
        str  # only in published | only in rebuilt | type | mode | owner | mtime | size | content | target
    )
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"tree": self.tree, "path": self.path, "change": self.change, "detail": self.detail}


@dataclass
class ImageDiff:
    partition_table: list[str] = field(default_factory=list)
    file_systems: list[str] = field(default_factory=list)
    files: list[FileChange] = field(default_factory=list)  # up to MAX_FILES of each kind, in ORDER
    counts: Counter[str] = field(default_factory=Counter)  # every differing file, by kind of change
    files_compared: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        parts = []
        if self.partition_table:
            parts.append(f"partition table: {len(self.partition_table)} difference(s)")
        if self.file_systems:
            parts.append(f"file-system metadata: {len(self.file_systems)} field(s)")
        if self.counts:
            parts.append(
                f"files: {sum(self.counts.values())} changes "
                f"({', '.join(f'{self.counts[k]} {k}' for k in ORDER if self.counts[k])})"
            )
        elif self.files_compared:
            parts.append(f"files: none of {self.files_compared} differ (so: block placement, inode numbers, other "
                         "time stamps or extended attributes)")  # fmt: skip
        return (
            "; ".join(parts) or "no difference found in the partition table, the file systems or the files"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "partition_table": self.partition_table,
            "file_systems": self.file_systems,
            "files": [f.to_json() for f in self.files],
            "counts": {k: self.counts[k] for k in ORDER if self.counts[k]},
            "files_compared": self.files_compared,
            "notes": self.notes,
        }

    def render(self, limit: int = 60) -> str:
        lines = [f"image differences: {self.summary}"]
        lines += [f"  partition table: {d}" for d in self.partition_table]
        lines += [f"  file system: {d}" for d in self.file_systems]
        for f in self.files[:limit]:
            lines.append(f"  {f.tree}:{f.path}: {f.change}" + (f" ({f.detail})" if f.detail else ""))
        if sum(self.counts.values()) > limit:
            lines.append(
                f"  ... and {sum(self.counts.values()) - limit} more (--json lists up to {MAX_FILES} of each kind)"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Disk:
    raw: Path
    table: dict[str, Any]
    esp: int  # byte offsets
    root: int


def _open(qcow2: Path, raw: Path) -> _Disk:
    run(["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(qcow2), str(raw)], timeout=1800,
        hint="qemu-img could not read the image")  # fmt: skip
    try:
        table = json.loads(run(["sfdisk", "-J", str(raw)], timeout=120).stdout)["partitiontable"]
    except (ValueError, KeyError, CommandError) as exc:
        raise OutputError(f"{qcow2.name}: no readable partition table: {exc}") from exc
    sector = int(table.get("sectorsize", 512))
    esp = root = -1
    for p in table.get("partitions", []):
        ptype = str(p.get("type", "")).upper()
        if ptype == ESP_TYPE:
            esp = int(p["start"]) * sector
        elif ptype in LINUX_TYPES and root < 0:
            root = int(p["start"]) * sector
    return _Disk(raw, table, esp, root)


def _table_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    out = []
    for key in ("label", "id", "firstlba", "lastlba", "sectorsize"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)} -> {b.get(key)}")
    pa, pb = a.get("partitions", []), b.get("partitions", [])
    if len(pa) != len(pb):
        out.append(f"{len(pa)} partitions -> {len(pb)}")
    for n, (x, y) in enumerate(zip(pa, pb, strict=False), 1):
        for key in ("start", "size", "type", "uuid", "name", "attrs"):
            if x.get(key) != y.get(key):
                out.append(f"partition {n} {key}: {x.get(key)} -> {y.get(key)}")
    return out


def _superblock(disk: _Disk) -> dict[str, str]:
    if disk.root < 0:
        return {}
    text = run(["dumpe2fs", "-h", f"{disk.raw}?offset={disk.root}"], check=False, timeout=300).text
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)}


def _esp_probe(disk: _Disk) -> dict[str, str]:
    if disk.esp < 0:
        return {}
    out = run(
        ["blkid", "-p", "-O", str(disk.esp), "-o", "export", str(disk.raw)], check=False, timeout=60
    ).text
    probe = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    with disk.raw.open("rb") as fh:
        fh.seek(disk.esp)
        probe["boot sector sha256"] = hashlib.sha256(fh.read(512)).hexdigest()[:16]
    return probe


def _dump(disk: _Disk, dest: Path) -> None:
    dest.mkdir(parents=True)
    if disk.root >= 0:
        (dest / "root").mkdir()
        run(["debugfs", "-R", f"rdump / {dest / 'root'}", f"{disk.raw}?offset={disk.root}"], timeout=3600)
    if disk.esp >= 0:
        (dest / "esp").mkdir()
        run(["mcopy", "-s", "-n", "-m", "-Q", "-i", f"{disk.raw}@@{disk.esp}", "::/*", str(dest / "esp")],
            env=MTOOLS_ENV, check=False, timeout=600)  # fmt: skip


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _kind(mode: int) -> str:
    return (
        "directory"
        if stat.S_ISDIR(mode)
        else "symlink"
        if stat.S_ISLNK(mode)
        else "file"
        if stat.S_ISREG(mode)
        else "other"
    )


def _content_detail(a: Path, b: Path) -> str:
    if a.suffix == ".pyc" and a.stat().st_size == b.stat().st_size:
        with a.open("rb") as fa, b.open("rb") as fb:
            ha, hb = fa.read(16), fb.read(16)
            if fa.read() == fb.read() and ha[:8] == hb[:8]:
                return ".pyc header only (the source's mtime or hash, bytes 8-15)"
    return f"sha256 {_digest(a)[:12]} -> {_digest(b)[:12]}"


def _compare_tree(tree: str, a: Path, b: Path, owners: bool) -> tuple[list[FileChange], int]:
    def listing(root: Path) -> dict[str, os.stat_result]:
        out = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                full = Path(dirpath) / name
                out["/" + full.relative_to(root).as_posix()] = full.lstat()
        return out

    la, lb = listing(a), listing(b)
    changes: list[FileChange] = []
    for path in sorted(set(la) | set(lb)):
        sa, sb = la.get(path), lb.get(path)
        if sa is None or sb is None:
            changes.append(FileChange(tree, path, "only in rebuilt" if sa is None else "only in published"))
            continue
        ka, kb = _kind(sa.st_mode), _kind(sb.st_mode)
        if ka != kb:
            changes.append(FileChange(tree, path, "type", f"{ka} -> {kb}"))
            continue
        pa, pb = a / path.lstrip("/"), b / path.lstrip("/")
        if ka == "symlink":
            if os.readlink(pa) != os.readlink(pb):
                changes.append(FileChange(tree, path, "target", f"{os.readlink(pa)} -> {os.readlink(pb)}"))
            continue
        if stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode) and tree == "root":
            changes.append(
                FileChange(
                    tree, path, "mode", f"{stat.S_IMODE(sa.st_mode):04o} -> {stat.S_IMODE(sb.st_mode):04o}"
                )
            )
        if owners and tree == "root" and (sa.st_uid, sa.st_gid) != (sb.st_uid, sb.st_gid):
            changes.append(
                FileChange(tree, path, "owner", f"{sa.st_uid}:{sa.st_gid} -> {sb.st_uid}:{sb.st_gid}")
            )
        if int(sa.st_mtime) != int(sb.st_mtime) and ka == "file":
            changes.append(FileChange(tree, path, "mtime", f"{int(sa.st_mtime)} -> {int(sb.st_mtime)}"))
        if ka == "file":
            if sa.st_size != sb.st_size:
                changes.append(FileChange(tree, path, "size", f"{sa.st_size} -> {sb.st_size}"))
            elif _digest(pa) != _digest(pb):
                changes.append(FileChange(tree, path, "content", _content_detail(pa, pb)))
    return changes, len(set(la) | set(lb))


def diff_images(published: Path, rebuilt: Path, work: Path) -> ImageDiff:
    """Compare two images of one lock (module docstring); ``work`` holds the raw copies and dumps, removed after."""
    work.mkdir(parents=True, exist_ok=True)
    result = ImageDiff()
    try:
        a = _open(published, work / "published.raw")
        b = _open(rebuilt, work / "rebuilt.raw")
        result.partition_table = _table_diff(a.table, b.table)
        sa, sb = _superblock(a), _superblock(b)
        result.file_systems += [f"root {k}: {sa.get(k)} -> {sb.get(k)}" for k in sorted(set(sa) | set(sb))
                                if sa.get(k) != sb.get(k)]  # fmt: skip
        ea, eb = _esp_probe(a), _esp_probe(b)
        result.file_systems += [f"ESP {k}: {ea.get(k)} -> {eb.get(k)}" for k in sorted(set(ea) | set(eb))
                                if ea.get(k) != eb.get(k) and k not in _PROBE_NOISE]  # fmt: skip
        _dump(a, work / "published")
        _dump(b, work / "rebuilt")
        owners = os.geteuid() == 0
        if not owners:
            result.notes.append("owners not compared: dumping them needs root")
        changes: list[FileChange] = []
        for tree in ("root", "esp"):
            ta, tb = work / "published" / tree, work / "rebuilt" / tree
            if ta.is_dir() and tb.is_dir():
                found, compared = _compare_tree(tree, ta, tb, owners)
                changes += found
                result.files_compared += compared
        result.counts.update(f.change for f in changes)
        for kind in ORDER:
            result.files += [f for f in changes if f.change == kind][:MAX_FILES]
        unlisted = {k: n - MAX_FILES for k, n in result.counts.items() if n > MAX_FILES}
        if unlisted:
            result.notes.append(
                "not listed (counted): " + ", ".join(f"{n} more {k}" for k, n in unlisted.items())
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result
