"""A file-system tree from a tar stream, checked member by member, for the deterministic disk assembly.

The seal (:mod:`imagebuilder.seal`) receives the finished root and EFI system partition of the
provisioning boot as two POSIX tar streams written inside the guest (where owners, modes, capabilities
and other extended attributes are what the image holds). :func:`read_tree` reads one stream and

* refuses any member that could write outside the tree or that the file system cannot hold: an
  absolute name, a ``.``/``..``/empty component, a control character, a member under one of the
  archive's own symbolic links, a hard link to anything but an earlier regular file, a name given
  twice, a member before its directory, POSIX ACL records (not supported); in an EFI system partition
  (``kind="esp"``) anything but directories and regular files, and names FAT or mtools cannot take;
* writes the **content** only into a fresh folder of this host (directories, regular files, symbolic
  links, hard links), as the build's own user: no owner, mode, device or extended attribute is applied
  on the host, so the result depends neither on the host's privileges, umask or file system nor on
  the order or the time things were written;
* returns every member's **metadata** (:class:`Entry`: type, mode, owner, mtime clamped to
  ``SOURCE_DATE_EPOCH``, device numbers, extended attributes), which the assembly applies to the
  final file system itself (:mod:`imagebuilder.assemble`);
* looks for forbidden byte strings (the installer's random identifiers that the image must no longer
  name, the build's credentials) in every file, symbolic link target and extended attribute, and
  reports where each was found.

Nothing is left half-written: on any error the folder is removed.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from imagebuilder.errors import BuildError
from imagebuilder.reproducible import TimeClamp

Kind = Literal["dir", "file", "symlink", "hardlink", "char", "block", "fifo"]
TreeKind = Literal["root", "esp"]

MAX_MEMBERS = 5_000_000
MAX_PATH_BYTES = 4000  # well under PATH_MAX: the assembly hands absolute paths to debugfs
MAX_NAME_BYTES = 255
MAX_LINK_BYTES = 4095
MAX_XATTR_BYTES = 3800  # one ext4 block (4 KiB) holds every attribute of an inode beyond the in-inode space
MAX_FAT_FILE = (1 << 32) - 1
_CHUNK = 1 << 20
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# FAT long names: no control characters and none of "*/:<>?\| ; mtools treats [ ] as patterns too
_FAT_BAD = re.compile(r'[\x00-\x1f\x7f"*/:<>?\\|\[\]]')
_TYPES: dict[bytes, Kind] = {
    tarfile.DIRTYPE: "dir",
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}
_XATTR = "SCHILY.xattr."
_ACL = "SCHILY.acl."


class TreeError(BuildError):
    """A seal archive holds something the deterministic assembly refuses; the message names the member."""


@dataclass(frozen=True)
class Entry:
    """One member: ``path`` is absolute in the file system (``/`` is its root directory)."""

    path: str
    kind: Kind
    mode: int  # permission bits, set-id and sticky bits (0o7777)
    uid: int
    gid: int
    mtime: int  # clamped to SOURCE_DATE_EPOCH
    size: int = 0
    target: str = ""  # a symbolic link's target, or the path a hard link names
    major: int = 0
    minor: int = 0
    xattrs: tuple[tuple[str, bytes], ...] = ()


@dataclass
class Tree:
    """The content of one tree on this host (``root``) and the metadata of every member, in archive order."""

    root: Path
    kind: TreeKind
    entries: list[Entry]
    data_bytes: int = 0  # the regular files' sizes
    found: dict[str, list[str]] = field(default_factory=dict)  # forbidden string's label -> paths holding it
    archive_bytes: int = 0  # how much of the stream the archive took

    def host_path(self, path: str) -> Path:
        return self.root / path.lstrip("/") if path != "/" else self.root


class _Window:
    """A read-only view of ``length`` bytes of ``fh`` from ``offset``: the archive cannot read past it."""

    def __init__(self, fh: IO[bytes], offset: int, length: int) -> None:
        self._fh = fh
        self._offset = offset
        self._end = offset + length
        self._pos = offset
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        left = self._end - self._pos
        if left <= 0:
            return b""
        want = left if size is None or size < 0 else min(size, left)
        self._fh.seek(self._pos)
        data = self._fh.read(want)
        self._pos += len(data)
        self.read_bytes += len(data)
        return data


class _Scanner:
    """Finds forbidden byte strings in a stream of chunks (a match may straddle two chunks)."""

    def __init__(self, needles: Mapping[str, bytes]) -> None:
        self.needles = {label: n.lower() for label, n in needles.items() if n}
        self.keep = max((len(n) for n in self.needles.values()), default=1) - 1
        self.hits: set[str] = set()
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if not self.needles:
            return
        data = (self._tail + chunk).lower()
        for label, needle in self.needles.items():
            if label not in self.hits and needle in data:
                self.hits.add(label)
        self._tail = data[-self.keep :] if self.keep else b""


def _component_problem(part: str) -> str:
    if part in ("", ".", ".."):
        return f"has a {part or 'empty'!r} component"
    if len(os.fsencode(part)) > MAX_NAME_BYTES:
        return f"has a name longer than {MAX_NAME_BYTES} bytes"
    return ""


def _normalise(name: str, kind: TreeKind) -> str:
    """The member's absolute path in the file system, or :class:`TreeError` saying what is wrong with it."""
    if name in (".", "./"):
        return "/"
    if name.startswith("/"):
        raise TreeError(f"member {name!r} has an absolute name: refused")
    if _CONTROL.search(name):
        raise TreeError(f"member {name!r} has a control character in its name: refused")
    rel = name[2:] if name.startswith("./") else name
    rel = rel[:-1] if rel.endswith("/") else rel
    parts = rel.split("/")
    for part in parts:
        why = _component_problem(part)
        if why:
            raise TreeError(f"member {name!r} {why}: refused")
    if len(os.fsencode(rel)) > MAX_PATH_BYTES:
        raise TreeError(f"member {name[:80]!r}... has a path longer than {MAX_PATH_BYTES} bytes: refused")
    if kind == "esp":
        bad = [
            p for p in parts if _FAT_BAD.search(p) or not p.isascii() or p != p.strip() or p.endswith(".")
        ]
        if bad:
            raise TreeError(
                f"EFI system partition member {name!r}: {bad[0]!r} is not a name FAT and mtools take as it is",
                hint='an ESP holds printable ASCII names without "*/:<>?\\|[] and without leading or trailing '
                "spaces or trailing dots",
            )
    return "/" + rel


def _xattrs(member: tarfile.TarInfo, path: str) -> tuple[tuple[str, bytes], ...]:
    out: list[tuple[str, bytes]] = []
    for key, value in member.pax_headers.items():
        if key.startswith(_ACL):
            raise TreeError(
                f"member {path!r} carries a POSIX ACL ({key}): the seal does not carry ACLs yet: refused",
                hint="remove the ACL in the staging plan (setfacl -b), or extend imagebuilder.sealtree",
            )
        if key.startswith(_XATTR):
            name = key[len(_XATTR) :]
            raw = value.encode("utf-8", "surrogateescape")
            if not name or _CONTROL.search(name) or " " in name or '"' in name:
                raise TreeError(f"member {path!r}: extended attribute name {name!r}: refused")
            if len(raw) > MAX_XATTR_BYTES:
                raise TreeError(
                    f"member {path!r}: extended attribute {name} is {len(raw)} bytes (at most {MAX_XATTR_BYTES})"
                )
            out.append((name, raw))
    return tuple(sorted(out))


def _entry(member: tarfile.TarInfo, path: str, kind: Kind, epoch: int) -> Entry:
    mtime = TimeClamp.of(epoch)(max(math.floor(float(member.mtime)), 0))  # an archive has no installer run
    return Entry(
        path=path,
        kind=kind,
        mode=member.mode & 0o7777,
        uid=int(member.uid),
        gid=int(member.gid),
        mtime=mtime,
        size=int(member.size) if kind == "file" else 0,
        target=member.linkname if kind in ("symlink", "hardlink") else "",
        major=int(member.devmajor) if kind in ("char", "block") else 0,
        minor=int(member.devminor) if kind in ("char", "block") else 0,
        xattrs=_xattrs(member, path),
    )


class _Reader:
    def __init__(
        self, dest: Path, kind: TreeKind, epoch: int, needles: Mapping[str, bytes], max_bytes: int
    ) -> None:
        self.tree = Tree(root=dest, kind=kind, entries=[])
        self.epoch = epoch
        self.needles = needles
        self.max_bytes = max_bytes
        self.kinds: dict[str, Kind] = {}

    def _found(self, scanner: _Scanner, path: str) -> None:
        for label in sorted(scanner.hits):
            self.tree.found.setdefault(label, []).append(path)

    def _scan_bytes(self, data: bytes, path: str) -> None:
        scanner = _Scanner(self.needles)
        scanner.feed(data)
        self._found(scanner, path)

    def _check_place(self, path: str, name: str) -> None:
        """A new name, under a directory of the archive (whose own ancestors were checked when it came)."""
        if path in self.kinds:
            raise TreeError(f"member {name!r} appears twice in the archive: refused")
        if path == "/":
            return
        parent = path.rsplit("/", 1)[0] or "/"
        seen = self.kinds.get(parent)
        if seen == "symlink":
            raise TreeError(
                f"member {name!r} lies under the symbolic link {parent!r} of the archive: refused"
            )
        if seen is None:
            raise TreeError(f"member {name!r} comes before its directory {parent!r}: refused")
        if seen != "dir":
            raise TreeError(f"member {name!r} lies under {parent!r}, which is not a directory: refused")

    def member(self, archive: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        if len(self.tree.entries) >= MAX_MEMBERS:
            raise TreeError(f"the archive has more than {MAX_MEMBERS} members: refused")
        kind = _TYPES.get(member.type)
        path = _normalise(member.name, self.tree.kind)
        if kind is None:
            raise TreeError(
                f"member {member.name!r} is of tar type {member.type!r}, which the seal does not take"
            )
        if self.tree.kind == "esp" and kind not in ("dir", "file"):
            raise TreeError(
                f"EFI system partition member {member.name!r} is a {kind}: FAT holds directories and files only"
            )
        if path == "/" and kind != "dir":
            raise TreeError(f"the archive's root {member.name!r} is not a directory: refused")
        self._check_place(path, member.name)
        entry = _entry(member, path, kind, self.epoch)
        if kind == "hardlink":
            target = _normalise(member.linkname, self.tree.kind)
            if self.kinds.get(target) != "file":
                raise TreeError(
                    f"member {member.name!r} is a hard link to {member.linkname!r}, which is not an earlier "
                    "regular file of the archive: refused"
                )
            entry = Entry(**{**entry.__dict__, "target": target})
        if kind == "symlink":
            raw = os.fsencode(member.linkname)
            if not raw or len(raw) > MAX_LINK_BYTES or b"\0" in raw:
                raise TreeError(
                    f"member {member.name!r}: a symbolic link target of {len(raw)} bytes: refused"
                )
            self._scan_bytes(raw, path)
        for _, value in entry.xattrs:
            self._scan_bytes(value, path)
        if kind == "file" and self.tree.kind == "esp" and entry.size > MAX_FAT_FILE:
            raise TreeError(f"EFI system partition member {member.name!r} is larger than FAT allows")
        self.tree.data_bytes += entry.size
        if self.tree.data_bytes > self.max_bytes:
            raise TreeError(
                f"the {self.tree.kind} tree holds more than {self.max_bytes >> 20} MiB of file data: it cannot fit "
                "its partition",
                hint="raise disk_size in the definition (or stage less into the image)",
            )
        self._write(archive, member, entry)
        self.kinds[path] = kind
        self.tree.entries.append(entry)

    def _write(self, archive: tarfile.TarFile, member: tarfile.TarInfo, entry: Entry) -> None:
        host = self.tree.host_path(entry.path)
        if entry.kind == "dir":
            if entry.path != "/":
                os.mkdir(host, 0o700)
        elif entry.kind == "file":
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            scanner = _Scanner(self.needles)
            with os.fdopen(fd, "wb") as out:
                source = archive.extractfile(member)
                if source is not None:
                    while chunk := source.read(_CHUNK):
                        scanner.feed(chunk)
                        out.write(chunk)
                if out.tell() != entry.size:
                    raise TreeError(f"member {member.name!r} ended after {out.tell()} of {entry.size} bytes")
            self._found(scanner, entry.path)
        elif entry.kind == "symlink":
            os.symlink(entry.target, host)
        elif entry.kind == "hardlink":
            os.link(self.tree.host_path(entry.target), host, follow_symlinks=False)
        # char, block and fifo: made in the file system by the assembly (no device node on this host)


def _split(name: str, prefixes: Mapping[str, object]) -> tuple[str, str]:
    """``(prefix, name within its tree)`` of a member of a combined archive (``root/etc`` -> ``root``, ``etc``)."""
    plain = name[2:] if name.startswith("./") else name
    head, _, rest = plain.partition("/")
    if head not in prefixes:
        raise TreeError(
            f"member {name!r} belongs to none of the archive's trees ({', '.join(sorted(prefixes))}): refused"
        )
    return head, (rest or ".")


def read_archive(
    fh: IO[bytes],
    *,
    offset: int,
    length: int,
    trees: Mapping[str, tuple[Path, TreeKind, int]],
    epoch: int,
    needles: Mapping[str, bytes] | None = None,
) -> dict[str, Tree]:
    """Read the tar archive at ``offset`` of ``fh`` (at most ``length`` bytes) into new folders.

    ``trees`` maps the archive's top-level names (``root``, ``esp``) to ``(folder, kind, max_bytes)``: each
    member belongs to the tree its first component names (``root/etc/fstab`` is ``/etc/fstab`` of the
    ``root`` tree), and ``max_bytes`` bounds that tree's file data (its partition's size: a larger tree is
    refused while it is read). ``needles`` maps a label to a byte string that no file may hold (compared
    without regard to ASCII case); :attr:`Tree.found` names the paths that hold each. On any error every
    folder is removed."""
    readers: dict[str, _Reader] = {}
    window = _Window(fh, offset, length)
    try:
        for prefix, (dest, kind, max_bytes) in trees.items():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.mkdir(mode=0o700)
            readers[prefix] = _Reader(dest, kind, epoch, needles or {}, max_bytes)
        count = 0
        try:
            with tarfile.open(fileobj=window, mode="r|", errorlevel=2) as archive:  # type: ignore[call-overload]
                for member in archive:
                    count += 1
                    prefix, member.name = _split(member.name, trees)
                    if member.type == tarfile.LNKTYPE:
                        target_prefix, member.linkname = _split(member.linkname, trees)
                        if target_prefix != prefix:
                            raise TreeError(
                                f"member {prefix}/{member.name}: a hard link into another tree: refused"
                            )
                    readers[prefix].member(archive, member)
        except tarfile.TarError as exc:
            raise TreeError(
                f"the seal archive is not a readable tar stream ({exc}) after {count} members",
                hint="the provisioning boot's seal step writes it; see the console log around `seal`",
            ) from exc
        except OSError as exc:
            raise TreeError(f"cannot write the sealed trees on this host: {exc}") from exc
        for prefix, reader in readers.items():
            if not reader.tree.entries or reader.tree.entries[0].path != "/":
                raise TreeError(f"the seal archive does not start its {prefix} tree with {prefix}/ itself")
    except BaseException:
        for dest, _, _ in trees.values():
            shutil.rmtree(dest, ignore_errors=True)
        raise
    for reader in readers.values():
        reader.tree.archive_bytes = window.read_bytes
    return {prefix: reader.tree for prefix, reader in readers.items()}


def write_tar(out: IO[bytes], trees: Mapping[str, Path]) -> None:
    """A seal archive of folders of this host, as the guest writes one: each folder under its top-level name
    (``root/...``, ``esp/...``), names sorted, numeric owners, extended attributes as pax records. For tests,
    and for sealing trees that do not come from a VM."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for prefix, tree_dir in trees.items():
            for path in [
                tree_dir,
                *sorted(tree_dir.rglob("*"), key=lambda p: p.relative_to(tree_dir).parts),
            ]:
                rel = path.relative_to(tree_dir).as_posix()
                name = prefix if rel == "." else f"{prefix}/{rel}"
                info = archive.gettarinfo(str(path), arcname=name)
                info.uname = info.gname = ""
                headers = {}
                try:
                    for attr in os.listxattr(path, follow_symlinks=False):
                        value = os.getxattr(path, attr, follow_symlinks=False)
                        headers[_XATTR + attr] = value.decode("utf-8", "surrogateescape")
                except OSError:
                    pass
                info.pax_headers = headers
                if stat.S_ISREG(path.lstat().st_mode) and info.type == tarfile.REGTYPE:
                    with path.open("rb") as fh:
                        archive.addfile(info, fh)
                else:
                    archive.addfile(info)
