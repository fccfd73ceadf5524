"""The provisioned disk's file systems read offline, as trees for the deterministic assembly.

After the provisioning boot powered off, the seal (:mod:`imagebuilder.seal`) reads what the staging plan
left, on this host, from the build's own overlay (nothing is mounted, no loop device, no root needed):

* the root file system (ext4), copied out of the raw disk and its journal replayed (``e2fsck -fy`` on
  the copy: the provisioning boot's last remount may leave ``needs_recovery``), then read with debugfs:
  ``rdump /`` for the content (directories, regular files, symbolic links), ``ls -p`` level by level
  for every name with its inode, type, mode, owner and size, ``stat`` of every inode for its mtime,
  device numbers and the names of its extended attributes, and ``ea_get`` of each attribute (ACLs come
  back in the Linux ``system.posix_acl_*`` format, capabilities as they are): the same view the
  image's own kernel has, minus what was mounted over it during the build;
* the EFI system partition (FAT), copied out with ``mcopy -s -m`` (names and mtimes; FAT has nothing
  else).

Both become :class:`imagebuilder.sealtree.Tree` objects: the content on this host, every member's
metadata kept (mtime clamped to ``SOURCE_DATE_EPOCH``), names checked as :mod:`imagebuilder.sealtree`
checks an archive's, hard links found by their inode and made again on the host, and the content
searched for the strings the image must not hold.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.errors import CommandError
from imagebuilder.reproducible import TimeClamp
from imagebuilder.run import run
from imagebuilder.sealtree import (
    _CONTROL,
    _FAT_BAD,
    MAX_LINK_BYTES,
    MAX_MEMBERS,
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    MAX_XATTR_BYTES,
    Entry,
    Kind,
    Tree,
    TreeError,
    _Scanner,
)

log = logging.getLogger(__name__)

_LS = re.compile(r"/(\d+)/([0-7]+)/(\d+)/(\d+)/(.*)/(\d*)/")
_ECHO = "debugfs: "
_KINDS: dict[int, Kind] = {
    stat.S_IFDIR: "dir",
    stat.S_IFREG: "file",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
    stat.S_IFIFO: "fifo",
}
_CHUNK = 1 << 20
TIMEOUT = 3600


def _quote(path: str) -> str:
    return '"' + path.replace('"', '""') + '"'


def _batch(image: Path, commands: list[str], work: Path) -> dict[str, list[str]]:
    """Run ``commands`` in one debugfs session; each command's output lines, by the command."""
    out: dict[str, list[str]] = {}
    for start in range(0, len(commands), 50_000):
        part = commands[start : start + 50_000]
        script = work / "debugfs.requests"
        script.write_bytes(os.fsencode("\n".join(part) + "\n"))
        text = run(["debugfs", "-f", str(script), str(image)], timeout=TIMEOUT).text
        current: list[str] | None = None
        for line in text.splitlines():
            if line.startswith(_ECHO):
                current = out.setdefault(line[len(_ECHO) :], [])
            elif current is not None:
                current.append(line)
    return out


@dataclass(frozen=True)
class _Name:
    path: str
    inode: int
    mode: int
    uid: int
    gid: int
    size: int


def _check_name(name: str, parent: str) -> None:
    if not name or name in (".", "..") or "/" in name:
        raise TreeError(f"{parent}: a directory entry named {name!r}: refused")
    if _CONTROL.search(name):
        raise TreeError(
            f"{parent}/{name!r} has a control character in its name: refused (debugfs reads one command a line)"
        )
    if len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise TreeError(f"{parent}/{name[:40]}...: a name longer than {MAX_NAME_BYTES} bytes")


def _listing(image: Path, work: Path) -> tuple[_Name, list[_Name]]:
    """The root folder and every name of the file system, parents before children, by ``ls -p`` of each folder
    (one debugfs run per level)."""
    names: list[_Name] = []
    root: _Name | None = None
    level = ["/"]
    while level:
        commands = [f"ls -p {_quote(d)}" for d in level]
        found = _batch(image, commands, work)
        nxt: list[str] = []
        for folder, command in zip(level, commands, strict=True):
            if command not in found:
                raise TreeError(f"debugfs did not list {folder!r}")
            for line in found[command]:
                m = _LS.fullmatch(line.strip())
                if m is None:
                    continue
                name = m[5]
                if m[1] == "0":  # an unused slot (lost+found is made with empty blocks)
                    continue
                if name == "." and folder == "/":
                    root = _Name("/", int(m[1]), int(m[2], 8), int(m[3]), int(m[4]), 0)
                if name in (".", ".."):
                    continue
                _check_name(name, folder)
                path = (folder.rstrip("/") + "/" + name) if folder != "/" else "/" + name
                mode = int(m[2], 8)
                entry = _Name(path, int(m[1]), mode, int(m[3]), int(m[4]), int(m[6] or 0))
                names.append(entry)
                if stat.S_ISDIR(mode):
                    nxt.append(path)
                if len(names) > MAX_MEMBERS:
                    raise TreeError(f"the file system has more than {MAX_MEMBERS} names: refused")
        level = nxt
    if root is None:
        raise TreeError("debugfs did not list the root folder itself")
    return root, names


@dataclass
class _Inode:
    mtime: int = 0
    major: int = 0
    minor: int = 0
    link: str | None = None
    xattrs: tuple[str, ...] = ()


_MTIME = re.compile(r"\s*mtime: 0x([0-9a-f]+)(?::([0-9a-f]+))?")
_DEVICE = re.compile(r"Device major/minor number: ([0-9]+):([0-9]+)")
_FAST = re.compile(r'Fast link dest: "(.*)"$')
_XATTR = re.compile(r"  ([^ ]+) \((\d+)\)")


def _inodes(image: Path, numbers: list[int], work: Path) -> dict[int, _Inode]:
    found = _batch(image, [f"stat <{n}>" for n in numbers], work)
    out: dict[int, _Inode] = {}
    for n in numbers:
        lines = found.get(f"stat <{n}>")
        if not lines:
            raise TreeError(f"debugfs could not stat inode {n}")
        info, in_xattrs, names = _Inode(), False, []
        for line in lines:
            if (m := _MTIME.match(line)) is not None:
                seconds = int(m[1], 16)
                if m[2] is not None:  # the extra field's two low bits extend the seconds (dates after 2038)
                    seconds += (int(m[2], 16) & 3) << 32
                info.mtime = seconds
            elif (m := _DEVICE.search(line)) is not None:
                info.major, info.minor = int(m[1]), int(m[2])
            elif (m := _FAST.search(line)) is not None:
                info.link = m[1]
            elif line.startswith("Extended attributes:"):
                in_xattrs = True
            elif in_xattrs and (m := _XATTR.match(line)) is not None:
                names.append(m[1])
            elif in_xattrs and not line.startswith("  "):
                in_xattrs = False
        info.xattrs = tuple(n for n in names if n != "system.data")
        out[n] = info
    return out


def _xattr_values(image: Path, wanted: list[tuple[int, str]], work: Path) -> dict[tuple[int, str], bytes]:
    if not wanted:
        return {}
    folder = work / "xattrs"
    folder.mkdir(exist_ok=True)
    commands = [
        f"ea_get -f {_quote(str(folder / str(i)))} <{ino}> {name}" for i, (ino, name) in enumerate(wanted)
    ]
    _batch(image, commands, work)
    values = {}
    for i, key in enumerate(wanted):
        path = folder / str(i)
        if not path.is_file():
            raise TreeError(f"debugfs could not read the extended attribute {key[1]} of inode {key[0]}")
        data = path.read_bytes()
        if len(data) > MAX_XATTR_BYTES:
            raise TreeError(
                f"inode {key[0]}: extended attribute {key[1]} is {len(data)} bytes (at most {MAX_XATTR_BYTES})"
            )
        values[key] = data
    shutil.rmtree(folder)
    return values


def _scan_file(path: Path, scanner: _Scanner) -> None:
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            scanner.feed(chunk)


def read_ext4(
    image: Path, dest: Path, *, clamp: TimeClamp, needles: Mapping[str, bytes], work: Path
) -> Tree:
    """The tree of the ext4 file system in the file ``image`` (journal already replayed), its content in the new
    folder ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.mkdir(mode=0o700)
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _read_ext4(image, dest, clamp=clamp, needles=needles, work=work)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _read_ext4(
    image: Path, dest: Path, *, clamp: TimeClamp, needles: Mapping[str, bytes], work: Path
) -> Tree:
    dumped = run(["debugfs", "-R", f"rdump / {_quote(str(dest))}", str(image)], timeout=TIMEOUT)
    problems = [
        ln
        for ln in dumped.stderr.decode(errors="replace").splitlines()
        if ln and not ln.startswith("debugfs ")
    ]
    if problems:
        raise TreeError(f"debugfs could not copy the root file system out: {'; '.join(problems[:5])}")
    root, names = _listing(image, work)
    inodes = _inodes(image, sorted({root.inode, *(n.inode for n in names)}), work)
    wanted = sorted({(ino, x) for ino, info in inodes.items() for x in info.xattrs})
    values = _xattr_values(image, wanted, work)
    tree = Tree(root=dest, kind="root", entries=[])

    def xattrs_of(ino: int) -> tuple[tuple[str, bytes], ...]:
        return tuple(sorted((name, values[(ino, name)]) for name in inodes[ino].xattrs))

    tree.entries.append(Entry("/", "dir", root.mode & 0o7777, root.uid, root.gid, clamp(inodes[root.inode].mtime),
                              xattrs=xattrs_of(root.inode)))  # fmt: skip
    first_path: dict[int, str] = {}
    for name in names:
        kind = _KINDS.get(stat.S_IFMT(name.mode))
        if kind is None:
            raise TreeError(
                f"{name.path} is a {'socket' if stat.S_ISSOCK(name.mode) else f'file of mode {name.mode:o}'}: "
                "the seal does not carry it",
                hint="a socket belongs in /run, not in the image: remove it in the staging plan",
            )
        if len(os.fsencode(name.path)) > MAX_PATH_BYTES:
            raise TreeError(f"{name.path[:80]}...: a path longer than {MAX_PATH_BYTES} bytes")
        info = inodes[name.inode]
        host = tree.host_path(name.path)
        scanner = _Scanner(needles)
        if kind == "file" and name.inode in first_path:
            os.unlink(host)  # rdump wrote a copy: make it the hard link it is
            os.link(tree.host_path(first_path[name.inode]), host)
            tree.entries.append(Entry(name.path, "hardlink", 0, 0, 0, 0, target=first_path[name.inode]))
            continue
        target = ""
        if kind == "symlink":
            target = info.link if info.link is not None else os.readlink(host)
            raw = os.fsencode(target)
            if not raw or len(raw) > MAX_LINK_BYTES:
                raise TreeError(f"{name.path}: a symbolic link target of {len(raw)} bytes")
            scanner.feed(raw)
        if kind == "file":
            if not host.is_file() or host.is_symlink() or host.stat().st_size != name.size:
                raise TreeError(f"{name.path}: debugfs's copy is missing or not {name.size} bytes")
            first_path[name.inode] = name.path
            _scan_file(host, scanner)
            tree.data_bytes += name.size
        xattrs = xattrs_of(name.inode)
        for _, value in xattrs:
            scanner.feed(value)
        for label in sorted(scanner.hits):
            tree.found.setdefault(label, []).append(name.path)
        tree.entries.append(Entry(name.path, kind, name.mode & 0o7777, name.uid, name.gid, clamp(info.mtime),
                                  size=name.size if kind == "file" else 0, target=target, major=info.major,
                                  minor=info.minor, xattrs=xattrs))  # fmt: skip
    _check_host_copy(dest, {e.path for e in tree.entries})
    tree.entries.sort(key=lambda e: os.fsencode(e.path).split(b"/"))  # not the listing's (hash) order
    return tree


def _check_host_copy(dest: Path, listed: set[str]) -> None:
    """Nothing on the host that the listing does not name (debugfs's copy and its listing agree)."""
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in dirnames + filenames:
            path = "/" + (Path(dirpath) / name).relative_to(dest).as_posix()
            if path not in listed:
                raise TreeError(f"{path} was copied out of the root file system but is not in its listing")


MTOOLS_ENV = {"TZ": "UTC", "MTOOLS_SKIP_CHECK": "1", "MTOOLSRC": "/dev/null"}


def read_fat(raw: Path, offset: int, dest: Path, *, clamp: TimeClamp, needles: Mapping[str, bytes]) -> Tree:
    """The tree of the FAT file system at ``offset`` of ``raw`` (mtools), its content in the new folder ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.mkdir(mode=0o700)
    try:
        try:
            run(
                ["mcopy", "-s", "-n", "-m", "-i", f"{raw}@@{offset}", "::/", f"{dest}/"],
                env=MTOOLS_ENV,
                timeout=TIMEOUT,
            )
        except CommandError as exc:
            raise TreeError(
                f"mtools could not copy the EFI system partition out: {exc.output[-300:]}"
            ) from exc
        tree = Tree(root=dest, kind="esp", entries=[Entry("/", "dir", 0o755, 0, 0, clamp.epoch)])
        for dirpath, dirnames, filenames in sorted(os.walk(dest)):
            for name in sorted(dirnames) + sorted(filenames):
                host = Path(dirpath) / name
                path = "/" + host.relative_to(dest).as_posix()
                if _FAT_BAD.search(name) or not name.isascii():
                    raise TreeError(
                        f"EFI system partition member {path!r}: not a name the seal copies as it is"
                    )
                st = host.lstat()
                mtime = clamp(int(st.st_mtime))
                if stat.S_ISDIR(st.st_mode):
                    tree.entries.append(Entry(path, "dir", 0o755, 0, 0, mtime))
                elif stat.S_ISREG(st.st_mode):
                    scanner = _Scanner(needles)
                    _scan_file(host, scanner)
                    for label in sorted(scanner.hits):
                        tree.found.setdefault(label, []).append(path)
                    tree.entries.append(Entry(path, "file", 0o644, 0, 0, mtime, size=st.st_size))
                    tree.data_bytes += st.st_size
        tree.entries.sort(key=lambda e: e.path.split("/"))
        return tree
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
