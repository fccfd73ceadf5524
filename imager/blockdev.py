"""The target disk at the byte level: open it exclusively, learn its size, write, flush, re-read, wipe.

The target is a block device on a server and a regular file (a file-backed disk) in the tests; the
same code handles both. A block device is opened with ``O_EXCL``, which the kernel refuses while a
file system on it is mounted or a device-mapper or md device holds it: a second guard after
:mod:`imager.select`. Aligned buffers come from ``mmap`` (page-aligned, as ``O_DIRECT`` needs).

:func:`wipe` is what makes a disk unbootable: it zeroes the first and last :data:`WIPE_BYTES` of the
disk (the protective MBR and primary GPT; the backup GPT and the md, ZFS and LVM metadata at the
end) and, when given, the end of the image's extent (where a half-written image keeps its own
backup GPT), then flushes and asks the kernel to re-read the (now empty) partition table.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from imager.errors import ImagerError, Reason

log = logging.getLogger(__name__)

WIPE_BYTES = 1 << 20
BLKRRPART = 0x125F
BLKFLSBUF = 0x1261
ALIGN = 4096


@dataclass
class Target:
    """An open target: ``fd`` for writing (``O_DIRECT`` when the device allows it)."""

    path: Path
    fd: int
    size: int
    is_block: bool
    direct: bool

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_flags(is_block: bool, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC
    if is_block:
        flags |= os.O_EXCL
    if direct:
        flags |= os.O_DIRECT
    return flags


@contextlib.contextmanager
def open_target(path: Path, *, direct: bool = True) -> Iterator[Target]:
    """Open ``path`` for writing; ImagerError(write-failed) saying why it cannot be."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ImagerError(Reason.write_failed, f"{path}: {exc.strerror}") from None
    is_block = stat.S_ISBLK(st.st_mode)
    if not (is_block or stat.S_ISREG(st.st_mode)):
        raise ImagerError(Reason.write_failed, f"{path}: neither a block device nor a file-backed disk")
    fd = -1
    used_direct = direct
    for attempt_direct in (True, False) if direct else (False,):
        try:
            fd = os.open(path, _open_flags(is_block, attempt_direct))
            used_direct = attempt_direct
            break
        except OSError as exc:
            if exc.errno == errno.EINVAL and attempt_direct:
                continue  # the file system does not do O_DIRECT (tmpfs): buffered, fsync'd writes
            if exc.errno == errno.EBUSY:
                raise ImagerError(
                    Reason.write_failed,
                    f"{path}: busy (mounted, or held by device-mapper, md or another program)",
                    hint="nothing may use the target disk while the imager writes it",
                ) from None
            raise ImagerError(
                Reason.write_failed, f"{path}: cannot open it for writing: {exc.strerror}"
            ) from None
    target = Target(path, fd, os.lseek(fd, 0, os.SEEK_END), is_block, used_direct)
    try:
        yield target
    finally:
        target.close()


def aligned_buffer(size: int) -> mmap.mmap:
    """``size`` bytes of page-aligned, zeroed memory."""
    return mmap.mmap(-1, max(ALIGN, -(-size // ALIGN) * ALIGN))


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]
        offset += written


def write_at(path: Path, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` through the page cache, then fsync (small writes: heads, tails)."""
    flags = os.O_WRONLY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ImagerError(
            Reason.write_failed, f"{path}: cannot open it for writing: {exc.strerror}"
        ) from None
    try:
        pwrite_all(fd, data, offset)
        os.fsync(fd)
    except OSError as exc:
        raise ImagerError(
            Reason.write_failed, f"{path}: write at byte {offset} failed: {exc.strerror}"
        ) from None
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer at the end of the disk), read past the page cache."""
    flush(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ImagerError(Reason.write_failed, f"{path}: cannot open it: {exc.strerror}") from None
    try:
        chunks = []
        while length > 0:
            chunk = os.pread(fd, min(length, 8 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ImagerError(
            Reason.write_failed, f"{path}: read at byte {offset} failed: {exc.strerror}"
        ) from None
    finally:
        os.close(fd)


def disk_size(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ImagerError(Reason.write_failed, f"{path}: cannot open it: {exc.strerror}") from None
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def flush(path: Path) -> None:
    """Drop the page cache of ``path``, so that reads come from the disk (BLKFLSBUF; fadvise for files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if stat.S_ISBLK(os.fstat(fd).st_mode):
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, BLKFLSBUF)
        else:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def reread_partitions(path: Path) -> None:
    """Ask the kernel to re-read the partition table (block devices; nothing for files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if stat.S_ISBLK(os.fstat(fd).st_mode):
            try:
                fcntl.ioctl(fd, BLKRRPART)
            except OSError as exc:
                log.warning("%s: re-reading the partition table failed: %s", path, exc.strerror)
    finally:
        os.close(fd)


def wipe(path: Path, *, image_end: int | None = None) -> None:
    """Zero the partition tables at both ends (and the end of the image's extent); never raises for
    a region it cannot reach, only logs, because it runs on failure paths too."""
    try:
        size = disk_size(path)
    except ImagerError as exc:
        log.error("cannot wipe %s: %s", path, exc.message)
        return
    regions = {(0, min(WIPE_BYTES, size)), (max(0, size - WIPE_BYTES), size)}
    if image_end is not None and 0 < image_end <= size:
        regions.add((max(0, image_end - WIPE_BYTES), image_end))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.error("cannot wipe %s: %s", path, exc.strerror)
        return
    try:
        for start, end in sorted(regions):
            if end > start:
                pwrite_all(fd, bytes(end - start), start)
        os.fsync(fd)
    except OSError as exc:
        log.error("wiping %s failed: %s", path, exc.strerror)
    finally:
        os.close(fd)
    flush(path)
    reread_partitions(path)
    log.info("wiped the partition tables of %s (first and last %d KiB)", path, WIPE_BYTES >> 10)
