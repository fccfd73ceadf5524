"""Writing a verified image: the disk becomes bootable only once every byte is verified.

Both paths hold back the first :data:`HEAD_BYTES` of the image (the protective MBR and the primary
GPT) and write them last, after the digest matched and the body read back equal. The target was
wiped first (:func:`imager.blockdev.wipe`), so until the head is committed the disk has no valid
partition table at either end: firmware finds nothing to boot, whatever happens in between (a
tampered byte, a cut connection, a power loss).

* **raw** (:func:`write_raw`): the image streams from the network straight to the disk. Each 8 MiB
  buffer is hashed as it arrives and handed to a writer thread (``O_DIRECT`` on aligned buffers),
  so hashing and writing overlap; the digest is compared when the last byte is in. The digest is
  the one :mod:`imager.digest` chose: BLAKE3 (one stream, fast enough for the disk), or SHA-256 per
  signed chunk on several hasher threads, or one SHA-256 stream. No tool ever
  reads the bytes. A raw image that starts with a QCOW2, VMDK, VHDX, QED, VDI or LUKS magic is
  refused at its first buffer.
* **qcow2** (:func:`write_qcow2`): the image streams into a scratch file in memory (tmpfs), hashed
  as it comes; qemu-img sees it only after the digest matched and :mod:`imager.qcow2` passed its
  header. ``qemu-img convert -f qcow2`` (never a probe) writes all but the head, ``qemu-img
  compare`` reads the body back, then the head is extracted, written and read back.

docs/bare-metal.md, "Raw or QCOW2", gives the measured trade-off (``bench/imager.py``).
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from imager import blockdev
from imager.blockdev import ALIGN, Target, aligned_buffer, open_target, pwrite_all
from imager.digest import Check, new
from imager.errors import ImagerError, Reason
from imager.http import Fetcher
from imager.progress import Progress
from imager.qcow2 import HEADER_READ, check_header, container_format
from imager.run import run
from protocol.release import Image, digests_equal

log = logging.getLogger(__name__)

HEAD_BYTES = 1 << 20
CHUNK = 8 << 20
DEPTH = 4
SCRATCH_MARGIN = 64 << 20
_QUEUE_POLL_S = 0.5


@dataclass(frozen=True)
class Written:
    """What a write did: the image's SHA-256 (signed, and verified through ``digest``), how many bytes of
    disk it covers, how long."""

    sha256: str
    disk_bytes: int
    seconds: float
    readback_seconds: float
    digest: str = "sha256"  # the algorithm the bytes were verified with (imager.digest)


def _digest_refusal(name: str, check: Check, actual: str) -> ImagerError:
    return ImagerError(
        Reason.digest_mismatch,
        f"{name}: {check.algorithm} mismatch (the signature says {check.expected}, the bytes received are {actual})",
        hint="the image on the server is not the signed one (tampered or half-published): republish the release",
    )


def _sha256_check(image: Image) -> Check:
    return Check("sha256", image.sha256)


class _Pool:
    """Aligned buffers; a buffer handed to the hasher and the writer comes back when both are done."""

    def __init__(self, count: int, size: int) -> None:
        self.free: queue.Queue[mmap.mmap] = queue.Queue()
        self._users: dict[int, int] = {}
        self._lock = threading.Lock()
        for _ in range(count):
            self.free.put(aligned_buffer(size))

    def lend(self, buf: mmap.mmap, users: int) -> None:
        with self._lock:
            self._users[id(buf)] = users

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._users[id(buf)] -= 1
            done = self._users[id(buf)] == 0
        if done:
            self.free.put(buf)


class _Stage(threading.Thread, abc.ABC):
    """One stage of the pipeline (hash or write) in its own thread: both read a buffer at once."""

    def __init__(self, name: str, pool: _Pool) -> None:
        super().__init__(name=f"imager-{name}", daemon=True)
        self.pool = pool
        self.work: queue.Queue[tuple[mmap.mmap, int, int, int] | None] = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.work.get()
            if item is None:
                return
            buf, start, length, offset = item
            try:
                if self.error is None:
                    self.handle(memoryview(buf)[start:length], offset)
            except OSError as exc:
                self.error = exc
            finally:
                self.pool.release(buf)

    @abc.abstractmethod
    def handle(self, view: memoryview, offset: int) -> None:
        """Consume one buffer of the image at ``offset``."""


class _Hasher(_Stage):
    def __init__(self, pool: _Pool, check: Check) -> None:
        super().__init__("hasher", pool)
        self.hash = check.new()

    def handle(self, view: memoryview, offset: int) -> None:
        self.hash.update(view)  # hashlib releases the GIL for large buffers: this runs beside the writer


@dataclass(frozen=True)
class Chunked:
    """An image's signed per-chunk digests (:mod:`protocol.chunklist`), already checked against its list."""

    digests: tuple[bytes, ...]
    chunk_size: int
    size: int
    sha256: str  # the image's whole digest, which the signed list stands for


class _ChunkHasher(_Stage):
    """Checks whole chunks against the signed list. Chunk ``k`` goes to hasher ``k mod N``, its buffers in
    order (a chunk is a whole number of buffers), so N hashers run at once, each on its own chunks."""

    def __init__(self, pool: _Pool, index: int, chunked: Chunked) -> None:
        super().__init__(f"hasher-{index}", pool)
        self.chunked = chunked
        self.current = -1
        self.hash = hashlib.sha256()
        self.checked = 0
        self.mismatch: tuple[int, str] | None = None

    def handle(self, view: memoryview, offset: int) -> None:
        size, chunk = self.chunked.size, self.chunked.chunk_size
        k = offset // chunk
        if k != self.current:
            self.current, self.hash = k, hashlib.sha256()
        self.hash.update(view)
        if offset + len(view) == min((k + 1) * chunk, size):
            got = self.hash.digest()
            if hmac.compare_digest(got, self.chunked.digests[k]):
                self.checked += 1
            elif self.mismatch is None:
                self.mismatch = (k, got.hex())


def hashers_for(count: int | None = None) -> int:
    """How many chunk hashers: one per CPU this process may run on, at most 8."""
    return max(1, min(8, count if count is not None else len(os.sched_getaffinity(0))))


class _Writer(_Stage):
    def __init__(self, pool: _Pool, target: Target) -> None:
        super().__init__("writer", pool)
        self.target = target

    def handle(self, view: memoryview, offset: int) -> None:
        if not self.target.direct or (len(view) % ALIGN == 0 and offset % ALIGN == 0):
            pwrite_all(self.target.fd, view, offset)
            return
        aligned = len(view) - len(view) % ALIGN
        if aligned and offset % ALIGN == 0:
            pwrite_all(self.target.fd, view[:aligned], offset)
        else:
            aligned = 0
        fd = os.open(self.target.path, os.O_WRONLY | os.O_CLOEXEC)  # the unaligned tail, buffered
        try:
            pwrite_all(fd, view[aligned:], offset + aligned)
            os.fsync(fd)
        finally:
            os.close(fd)


class DiskSink:
    """The raw stream's sink: the network reads into a buffer; a hasher thread and a writer thread
    then work on it at the same time (the writer skips the head, which is kept in memory)."""

    def __init__(
        self,
        target: Target,
        name: str,
        progress: Progress | None = None,
        *,
        check: Check,
        chunked: Chunked | None = None,
    ) -> None:
        self.target = target
        self.name = name
        self.progress = progress
        self.chunked = (
            chunked
            if check.algorithm == "sha256" and chunked is not None and chunked.chunk_size % CHUNK == 0
            else None
        )  # per-chunk SHA-256 on several threads; BLAKE3 is one stream, fast enough on one
        count = 1 if self.chunked is None else hashers_for()
        self.pool = _Pool(DEPTH + count - 1, CHUNK)
        self.hasher = _Hasher(self.pool, check) if self.chunked is None else None  # one digest of the whole
        self.hashers: list[_Stage] = (
            [self.hasher] if self.hasher is not None
            else [_ChunkHasher(self.pool, i, self.chunked) for i in range(count) if self.chunked is not None]
        )  # fmt: skip
        self.writer = _Writer(self.pool, target)
        for stage in (*self.hashers, self.writer):
            stage.start()
        self.current = self._take()
        self.fill = 0
        self.offset = 0
        self.head = b""

    def _take(self) -> mmap.mmap:
        while True:
            self._check()
            try:
                return self.pool.free.get(timeout=_QUEUE_POLL_S)
            except queue.Empty:
                continue

    def _check(self) -> None:
        for stage in self.hashers:
            if isinstance(stage, _ChunkHasher) and stage.mismatch is not None and self.chunked is not None:
                k, actual = stage.mismatch
                start, end = (
                    k * self.chunked.chunk_size,
                    min((k + 1) * self.chunked.chunk_size, self.chunked.size),
                )
                raise ImagerError(
                    Reason.digest_mismatch,
                    f"{self.name}: sha256 mismatch in chunk {k} (bytes {start}-{end - 1}): the signed chunk list "
                    f"says {self.chunked.digests[k].hex()}, the bytes received are {actual}",
                    hint="the image on the server is not the signed one (tampered or half-published): "
                    "republish the release",
                )
        error = self.writer.error or next((h.error for h in self.hashers if h.error is not None), None)
        if error is not None:
            raise ImagerError(
                Reason.write_failed,
                f"{self.target.path}: writing failed: {getattr(error, 'strerror', None) or error}",
                hint="the disk reports an I/O error: check it (SMART, the controller log) or choose another",
            )

    def buffer(self) -> memoryview:
        return memoryview(self.current)[self.fill :]

    def filled(self, n: int) -> None:
        self.fill += n
        if self.progress is not None:
            self.progress.update(n)
        if self.fill == CHUNK:
            self._hand_over()

    def _hand_over(self) -> None:
        start = 0
        if self.offset == 0:
            first = bytes(memoryview(self.current)[: min(self.fill, HEAD_BYTES)])
            found = container_format(first[:64])
            if found is not None:
                raise ImagerError(
                    Reason.image_format,
                    f"{self.name}: declared raw but it is a {found} image",
                    hint="the release names the wrong artifact for the raw format: republish it",
                )
            self.head = first
            start = len(first)
        writes = start < self.fill
        self.pool.lend(self.current, 2 if writes else 1)
        which = 0 if self.chunked is None else (self.offset // self.chunked.chunk_size) % len(self.hashers)
        self.hashers[which].work.put((self.current, 0, self.fill, self.offset))
        if writes:
            self.writer.work.put((self.current, start, self.fill, self.offset + start))
        self.offset += self.fill
        self.fill = 0
        self.current = self._take()

    def finish(self) -> str:
        """Write what is left, wait for both stages, flush; the hex digest of everything received."""
        if self.fill:
            self._hand_over()
        self.pool.free.put(self.current)
        self._stop()
        self._check()
        try:
            os.fsync(self.target.fd)
        except OSError as exc:
            raise ImagerError(
                Reason.write_failed, f"{self.target.path}: flushing failed: {exc.strerror}"
            ) from None
        if self.hasher is not None:
            return self.hasher.hash.hexdigest()
        if self.chunked is None:  # a sink has one of its two hashers
            raise ImagerError(Reason.internal, f"{self.name}: no digest was computed")
        self._check()  # a chunk that differs
        checked = sum(h.checked for h in self.hashers if isinstance(h, _ChunkHasher))
        if checked != len(self.chunked.digests) or self.offset != self.chunked.size:
            raise ImagerError(
                Reason.digest_mismatch,
                f"{self.name}: {checked} of the {len(self.chunked.digests)} signed chunks were verified "
                f"({self.offset} of {self.chunked.size} bytes)",
                hint="the image on the server is not the signed one: republish the release",
            )
        return self.chunked.sha256  # every byte matched the signed list, which stands for this digest

    def _stop(self) -> None:
        for stage in (*self.hashers, self.writer):
            stage.work.put(None)
        for stage in (*self.hashers, self.writer):
            stage.join(timeout=3600)

    def abort(self) -> None:
        self._stop()


class FileSink:
    """The QCOW2 stream's sink: a scratch file, hashed as it is written."""

    def __init__(self, path: Path, progress: Progress | None = None, *, check: Check) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.hash = check.new()
        self.progress = progress
        self.buf = bytearray(CHUNK)

    def buffer(self) -> memoryview:
        return memoryview(self.buf)

    def filled(self, n: int) -> None:
        view = memoryview(self.buf)[:n]
        self.hash.update(view)
        while view:
            view = view[os.write(self.fd, view) :]
        if self.progress is not None:
            self.progress.update(n)

    def close(self) -> str:
        os.close(self.fd)
        return self.hash.hexdigest()


def hash_disk(
    path: Path,
    length: int,
    *,
    what: str,
    console: Callable[[str, int], Progress] | None = None,
    algorithm: str = "sha256",
) -> str:
    """The digest (``algorithm``) of the first ``length`` bytes of ``path``, read from the disk (not the page cache).

    A reader thread fills aligned buffers with ``O_DIRECT`` reads while this thread hashes the previous
    one, so reading and hashing overlap as writing and hashing do.
    """
    blockdev.flush(path)
    digest = new(algorithm)
    progress = console(what, length) if console else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    free: queue.Queue[mmap.mmap] = queue.Queue()
    for _ in range(DEPTH):
        free.put(aligned_buffer(CHUNK))
    full: queue.Queue[tuple[mmap.mmap, int] | BaseException | None] = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        offset = 0
        try:
            while offset < length and not stop.is_set():
                buf = free.get()
                want = min(CHUNK, length - offset)
                got = os.preadv(fd, [memoryview(buf)[: -(-want // ALIGN) * ALIGN]], offset)
                if got <= 0:
                    full.put(
                        ImagerError(
                            Reason.readback_mismatch, f"{path}: reading back stopped at byte {offset}"
                        )
                    )
                    return
                got = min(want, got)
                full.put((buf, got))
                offset += got
            full.put(None)
        except OSError as exc:
            full.put(
                ImagerError(
                    Reason.write_failed, f"{path}: reading back failed at byte {offset}: {exc.strerror}"
                )
            )

    thread = threading.Thread(target=reader, name="imager-readback", daemon=True)
    thread.start()
    try:
        while True:
            item = full.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            buf, got = item
            digest.update(memoryview(buf)[:got])
            free.put(buf)
            if progress is not None:
                progress.update(got)
    finally:
        stop.set()
        free.put(aligned_buffer(ALIGN))  # unblock a reader waiting for a buffer
        thread.join(timeout=60)
        os.close(fd)
    if progress is not None:
        progress.finish()
    return digest.hexdigest()


def check_disk_chunks(
    path: Path, chunked: Chunked, *, console: Callable[[str, int], Progress] | None = None
) -> None:
    """Read the image back from the disk (``O_DIRECT``: not the page cache) and check every chunk against
    the signed list, the chunks on several hasher threads at once; ImagerError names the first that differs."""
    blockdev.flush(path)
    progress = console("reading back", chunked.size) if console else None
    count = hashers_for()
    pool = _Pool(DEPTH + count - 1, CHUNK)
    hashers = [_ChunkHasher(pool, i, chunked) for i in range(count)]
    for hasher in hashers:
        hasher.start()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    offset = 0
    try:
        while offset < chunked.size:
            if any(h.mismatch is not None for h in hashers):
                break
            buf = pool.free.get()
            want = min(CHUNK, chunked.size - offset)
            try:
                got = os.preadv(fd, [memoryview(buf)[: -(-want // ALIGN) * ALIGN]], offset)
            except OSError as exc:
                pool.free.put(buf)
                raise ImagerError(
                    Reason.write_failed, f"{path}: reading back failed at byte {offset}: {exc.strerror}"
                ) from None
            if got < want:
                pool.free.put(buf)
                raise ImagerError(
                    Reason.readback_mismatch, f"{path}: reading back stopped at byte {offset + max(got, 0)}"
                )
            pool.lend(buf, 1)
            hashers[(offset // chunked.chunk_size) % count].work.put((buf, 0, want, offset))
            offset += want
            if progress is not None:
                progress.update(want)
    finally:
        for hasher in hashers:
            hasher.work.put(None)
        for hasher in hashers:
            hasher.join(timeout=3600)
        os.close(fd)
    for hasher in hashers:
        if hasher.mismatch is not None:
            k, actual = hasher.mismatch
            raise ImagerError(
                Reason.readback_mismatch,
                f"{path}: chunk {k} reads back as sha256 {actual}, not the verified {chunked.digests[k].hex()}",
                hint="the disk does not keep what is written to it: replace it or choose another",
            )
        if hasher.error is not None:
            raise ImagerError(Reason.write_failed, f"{path}: reading back failed: {hasher.error}")
    if sum(h.checked for h in hashers) != len(chunked.digests):
        raise ImagerError(Reason.readback_mismatch, f"{path}: not every chunk read back")
    if progress is not None:
        progress.finish()


def write_raw(
    fetcher: Fetcher,
    url: str,
    image: Image,
    target_path: Path,
    *,
    console: Callable[[str, int], Progress] | None = None,
    chunks: tuple[bytes, ...] | None = None,
    check: Check | None = None,
) -> Written:
    """Stream a raw image to ``target_path`` (already wiped); verify, commit the head, read back.

    ``check``: the signed digest to verify with (:func:`imager.digest.choose`; default the SHA-256).
    ``chunks``: the image's signed per-chunk digests (``image.chunks``, parsed by
    :func:`protocol.chunklist.parse` after its own digest was checked), used when the check is SHA-256:
    each chunk is then checked on its own core, and a tampered chunk stops the stream at once. Without
    them, one SHA-256 of the whole."""
    check = check or _sha256_check(image)
    started = time.monotonic()
    with open_target(target_path) as target:
        if image.size > target.size:
            raise ImagerError(
                Reason.image_too_large,
                f"{image.name}: {image.size} bytes do not fit the {target.size}-byte disk",
                hint="choose a larger disk with the hints",
            )
        progress = console(f"writing {image.name}", image.size) if console else None
        chunked = None
        if chunks is not None and image.chunks is not None:
            chunked = Chunked(chunks, image.chunks.chunk_size, image.size, image.sha256)
        sink = DiskSink(target, image.name, progress, check=check, chunked=chunked)
        try:
            fetcher.stream(url, name=image.name, size=image.size, sink=sink)
            actual = sink.finish()
        except BaseException:
            sink.abort()
            raise
        if progress is not None:
            progress.finish()
    expected = image.sha256 if sink.chunked is not None else check.expected
    if not digests_equal(actual, expected):
        raise _digest_refusal(image.name, check, actual)
    blockdev.write_at(target_path, sink.head, 0)
    wrote = time.monotonic() - started
    readback = time.monotonic()
    if chunked is not None and sink.chunked is not None:
        check_disk_chunks(target_path, chunked, console=console)
        back = image.sha256
    else:
        back = hash_disk(
            target_path, image.size, what="reading back", console=console, algorithm=check.algorithm
        )
    if not digests_equal(back, expected):
        raise ImagerError(
            Reason.readback_mismatch,
            f"{target_path}: the disk reads back as {check.algorithm} {back}, not the verified {expected}",
            hint="the disk does not keep what is written to it: replace it or choose another",
        )
    return Written(image.sha256, image.size, wrote, time.monotonic() - readback, check.algorithm)


def _driver(is_block: bool) -> str:
    return "host_device" if is_block else "file"


def _opts(**options: str | int) -> str:
    for value in options.values():
        if "," in str(value):
            raise ImagerError(Reason.internal, f"a qemu-img option value holds a comma: {value!r}")
    return ",".join(f"{key.replace('__', '.')}={value}" for key, value in options.items())


def fetch_scratch(
    fetcher: Fetcher,
    url: str,
    image: Image,
    scratch: Path,
    *,
    console: Callable[[str, int], Progress] | None = None,
    check: Check | None = None,
) -> Path:
    """Download a QCOW2 into ``scratch`` (in memory), hashed as it comes (``check``, default the SHA-256);
    refuse it unless it matches."""
    check = check or _sha256_check(image)
    try:
        stats = os.statvfs(scratch.parent)
    except OSError as exc:
        raise ImagerError(Reason.memory, f"{scratch.parent}: {exc.strerror}") from None
    free = stats.f_bavail * stats.f_frsize
    if free < image.size + SCRATCH_MARGIN:
        raise ImagerError(
            Reason.memory,
            f"{image.name}: {image.size} bytes do not fit the {free} bytes of memory free for the download",
            hint="give the server more memory, or publish a raw image with the release and boot with "
            "nodeimager.format=raw (it streams to the disk)",
        )
    progress = console(f"downloading {image.name}", image.size) if console else None
    sink = FileSink(scratch, progress, check=check)
    try:
        fetcher.stream(url, name=image.name, size=image.size, sink=sink)
    except BaseException:
        sink.close()
        scratch.unlink(missing_ok=True)
        raise
    actual = sink.close()
    if progress is not None:
        progress.finish()
    if not digests_equal(actual, check.expected):
        scratch.unlink(missing_ok=True)
        raise _digest_refusal(image.name, check, actual)
    return scratch


def _poll_writes(progress: Progress | None) -> Callable[[int], None] | None:
    if progress is None:
        return None

    def poll(pid: int) -> None:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                key, _, value = line.partition(":")
                if key == "wchar":
                    progress.set(int(value))
        except (OSError, ValueError):
            pass

    return poll


def write_qcow2(
    scratch: Path,
    image: Image,
    target_path: Path,
    *,
    console: Callable[[str, int], Progress] | None = None,
) -> Written:
    """Convert a verified QCOW2 onto ``target_path`` (already wiped): header check, body, compare,
    then the head, which makes the disk bootable, last."""
    started = time.monotonic()
    with scratch.open("rb") as fh:
        head = fh.read(HEADER_READ)
    size = blockdev.disk_size(target_path)
    header = check_header(head, name=image.name, disk_size=size)
    if image.virtual_size is not None and image.virtual_size != header.virtual_size:
        raise ImagerError(
            Reason.image_format,
            f"{image.name}: the QCOW2 holds a {header.virtual_size}-byte disk, the release says {image.virtual_size}",
            hint="republish the release from the build folder",
        )
    virtual = header.virtual_size
    if virtual <= HEAD_BYTES:
        raise ImagerError(
            Reason.image_format, f"{image.name}: a {virtual}-byte disk is too small to be an image"
        )
    with open_target(target_path) as target:
        is_block, direct = target.is_block, target.direct
    source = _opts(driver="raw", offset=HEAD_BYTES, file__driver="qcow2", file__file__driver="file",
                   file__file__filename=str(scratch))  # fmt: skip
    body = _opts(driver="raw", offset=HEAD_BYTES, size=virtual - HEAD_BYTES, file__driver=_driver(is_block),
                 file__filename=str(target_path))  # fmt: skip
    cache = "none" if direct else "writeback"
    progress = console(f"writing {image.name}", virtual) if console else None
    # -T: the scratch copy is in memory (tmpfs has no O_DIRECT); -t: the target, direct where it can be
    run(["qemu-img", "convert", "-n", "-t", cache, "-T", "writeback",
         "--image-opts", source, "--target-image-opts", body],
        reason=Reason.write_failed, timeout=6 * 3600, poll=_poll_writes(progress),
        hint="the disk refused the write: check it, or choose another")  # fmt: skip
    if progress is not None:
        progress.set(virtual)
        progress.finish()
    wrote = time.monotonic() - started
    readback = time.monotonic()
    blockdev.flush(target_path)
    compared = run(["qemu-img", "compare", "-T", "writeback", "--image-opts", source, body],
                   reason=Reason.readback_mismatch, check=False, timeout=6 * 3600)  # fmt: skip
    if compared.returncode != 0:
        raise ImagerError(
            Reason.readback_mismatch if compared.returncode == 1 else Reason.write_failed,
            f"{target_path}: the disk does not read back as the verified image (qemu-img compare status "
            f"{compared.returncode})",
            hint="the disk does not keep what is written to it: replace it or choose another",
        )
    head_file = scratch.with_name(scratch.name + ".head")
    head_file.unlink(missing_ok=True)
    run(["qemu-img", "convert", "-O", "raw", "--image-opts",
         _opts(driver="raw", size=HEAD_BYTES, file__driver="qcow2", file__file__driver="file",
               file__file__filename=str(scratch)), str(head_file)],
        reason=Reason.write_failed, timeout=600)  # fmt: skip
    head_bytes = head_file.read_bytes()
    head_file.unlink(missing_ok=True)
    if len(head_bytes) != HEAD_BYTES:
        raise ImagerError(
            Reason.write_failed, f"{image.name}: the image's first MiB came out {len(head_bytes)} bytes"
        )
    blockdev.write_at(target_path, head_bytes, 0)
    if blockdev.read_at(target_path, 0, HEAD_BYTES) != head_bytes:
        raise ImagerError(
            Reason.readback_mismatch,
            f"{target_path}: the partition table does not read back as written",
            hint="the disk does not keep what is written to it: replace it or choose another",
        )
    return Written(image.sha256, virtual, wrote, time.monotonic() - readback)
