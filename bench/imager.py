"""How fast the imager writes a verified image, against the raw write speed of the same target.

A 2 GiB image of incompressible data is served on the loopback by busybox httpd (sendfile: a
server that costs the client's CPU almost nothing, as nginx on a release server) and written to
a file-backed disk (a preallocated file on the machine's disk), with verification on: the
SHA-256 of every byte is computed while it streams and compared before the head (the partition
table) is committed. The floor is ``dd bs=8M oflag=direct conv=fsync`` of the same bytes to the
same target, timed in the same run: ``--rounds`` pairs (default 3), each a ``dd`` and then an
imager write, so that both see the same disk (a shared machine's disk speed wanders by 2x within a
minute); the ratio of the two bests is the figure, and each pair's own ratio is printed beside it.
The load average is printed too: hashing is CPU work, and on a shared machine it competes. So are one
SHA-256 stream and one BLAKE3 stream over bytes in memory, timed alone: a write verified with one of
them can go no faster than that on this CPU.

Printed: seconds and MiB/s of each, and the ratios ``dd / imager`` for

* the raw path's write (stream, hash, write; the goal is >= 0.9) as the imager does it by default
  (``nodeimager.digest=auto``: the release's signed BLAKE3), and with SHA-256 (``nodeimager.digest=sha256``)
  both ways: the signed per-chunk digests a release carries (each chunk checked on its own core) and
  one digest of the whole,
* the raw path's write plus its read-back (the whole disk is read and hashed again),
* the QCOW2 path (download into memory with the hash, header check, ``qemu-img convert``, compare).

    .venv/bin/python -m bench.imager [--size-gib 2] [--rounds 3] [--dir /var/tmp] [--no-qcow2]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from imagebuilder.release.digests import digest_file
from imager import blockdev
from imager.digest import Check, new
from imager.http import Fetcher
from imager.write import fetch_scratch, hashers_for, write_qcow2, write_raw
from protocol import chunklist
from protocol.release import ChunkList, Image

MiB = 1 << 20


@contextlib.contextmanager
def _httpd(folder: Path) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["busybox", "httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", str(folder)])
    try:
        for _ in range(50):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _dd(source: Path, target: Path) -> float:
    blockdev.flush(target)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={source}", f"of={target}", "bs=8M", "oflag=direct", "conv=notrunc,fsync", "status=none"],
                   check=True, timeout=3600)  # fmt: skip
    return time.perf_counter() - start


def _image(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as fh:
        for _ in range(size // (64 * MiB)):
            chunk = os.urandom(64 * MiB)
            digest.update(chunk)
            fh.write(chunk)
    return digest.hexdigest()


def _hash_seconds(size: int, algorithm: str) -> float:
    """One stream of ``algorithm`` over ``size`` bytes already in memory: the verified write's own ceiling."""
    block = os.urandom(64 * MiB)
    digest = new(algorithm)
    start = time.perf_counter()
    for _ in range(size // len(block)):
        digest.update(block)
    return time.perf_counter() - start


def _rate(size: int, seconds: float) -> str:
    return f"{seconds:7.2f} s  {size / MiB / seconds:8.1f} MiB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"))  # noqa: S108 - a disk-backed folder
    parser.add_argument("--no-qcow2", action="store_true", help="skip the QCOW2 path")
    parser.add_argument(
        "--rounds", type=int, default=3, help="dd + imager pairs on the raw path (default 3)"
    )
    args = parser.parse_args()
    size = args.size_gib << 30
    work = Path(tempfile.mkdtemp(prefix="bench-imager-", dir=args.dir))
    try:
        srv_dir = work / "srv"
        srv_dir.mkdir()
        raw = srv_dir / "node.raw"
        print(f"making a {args.size_gib} GiB image of random data in {work} ...")
        digest = _image(raw, size)
        target = work / "target.disk"
        with target.open("wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, size + 64 * MiB)
        floor: list[float] = []
        fast, writes, single = [], [], []
        signed = digest_file(raw)  # what `imagebuilder release` signs for the image
        assert signed.sha256 == digest
        listed = signed.chunk_list
        chunks = ChunkList("node.raw" + chunklist.SUFFIX, hashlib.sha256(listed).hexdigest(), len(listed),
                           chunklist.CHUNK_SIZE)  # fmt: skip
        digests = chunklist.parse(listed, size=size, chunk_size=chunks.chunk_size, name=chunks.name)
        with _httpd(srv_dir) as url:
            fetcher = Fetcher(attempts=1)
            image = Image("node.raw", digest, size, "raw", size, chunks, signed.blake3)
            blake3 = Check("blake3", signed.blake3)
            for _ in range(max(1, args.rounds)):
                floor.append(_dd(raw, target))
                blockdev.wipe(target)
                fast.append(write_raw(fetcher, f"{url}/node.raw", image, target, check=blake3))
                blockdev.wipe(target)
                writes.append(write_raw(fetcher, f"{url}/node.raw", image, target, chunks=digests))
                blockdev.wipe(target)
                single.append(write_raw(fetcher, f"{url}/node.raw", image, target))
            default = min(fast, key=lambda w: w.seconds)
            written = min(writes, key=lambda w: w.seconds)
            one = min(single, key=lambda w: w.seconds)
            qcow2_seconds = None
            if not args.no_qcow2:
                qcow2 = srv_dir / "node.qcow2"
                subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)],
                               check=True, timeout=3600)  # fmt: skip
                q_signed = digest_file(qcow2)
                q_image = Image("node.qcow2", q_signed.sha256, q_signed.size, "qcow2", size, None,
                                q_signed.blake3)  # fmt: skip
                shm = Path("/dev/shm")  # noqa: S108 - memory-backed, as the imager's /run
                scratch_dir = shm if shm.is_dir() else work
                scratch = scratch_dir / f"bench-imager-{os.getpid()}.qcow2"
                blockdev.wipe(target)
                start = time.perf_counter()
                try:
                    fetch_scratch(fetcher, f"{url}/node.qcow2", q_image, scratch,
                                  check=Check("blake3", q_signed.blake3))  # fmt: skip
                    q_written = write_qcow2(scratch, q_image, target)
                finally:
                    scratch.unlink(missing_ok=True)
                qcow2_seconds = time.perf_counter() - start
                qcow2_write = qcow2_seconds - q_written.readback_seconds
        best = min(floor)
        sha = _hash_seconds(size, "sha256")
        b3 = _hash_seconds(size, "blake3")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(
            f"dd oflag=direct (floor)         {_rate(size, best)}   (runs: {', '.join(f'{s:.2f}' for s in floor)} s)"
        )
        print(f"sha256 alone, one core          {_rate(size, sha)}   (a SHA-256-verified stream's ceiling)")
        print(f"blake3 alone, one core          {_rate(size, b3)}   (a BLAKE3-verified stream's ceiling)")
        runs = ", ".join(f"{w.seconds:.2f}" for w in fast)
        print(
            f"imager raw, write (blake3)      {_rate(size, default.seconds)}   (runs: {runs} s; the default)"
        )
        runs = ", ".join(f"{w.seconds:.2f}" for w in writes)
        print(f"imager raw, sha256 chunks       {_rate(size, written.seconds)}   (runs: {runs} s; "
              f"{hashers_for()} hashers)")  # fmt: skip
        runs = ", ".join(f"{w.seconds:.2f}" for w in single)
        print(f"imager raw, sha256 one stream   {_rate(size, one.seconds)}   (runs: {runs} s)")
        print(
            f"imager raw, write+read-back     {_rate(size, default.seconds + default.readback_seconds)}   (blake3)"
        )
        if qcow2_seconds is not None:
            print(f"imager qcow2, write (blake3)    {_rate(size, qcow2_write)}")
            print(f"imager qcow2, all+compare       {_rate(size, qcow2_seconds)}")
        pairs = ", ".join(f"{d / w.seconds:.2f}" for d, w in zip(floor, fast, strict=True))
        print(
            f"ratio raw write / dd              {best / default.seconds:.2f}   (goal >= 0.90; each pair: {pairs})"
        )
        pairs = ", ".join(f"{d / w.seconds:.2f}" for d, w in zip(floor, writes, strict=True))
        print(f"ratio raw sha256 chunks / dd      {best / written.seconds:.2f}   (each pair: {pairs})")
        print(f"ratio raw sha256 one stream / dd  {best / one.seconds:.2f}")
        print(
            f"ratio raw sha256 one stream / max(dd, sha256) {max(best, sha) / one.seconds:.2f}   (its tighter bound)"
        )
        print(f"ratio raw write+read-back / dd    {best / (default.seconds + default.readback_seconds):.2f}")
        if qcow2_seconds is not None:
            print(f"ratio qcow2 write / dd            {best / qcow2_write:.2f}")
            print(f"ratio qcow2 all / dd              {best / qcow2_seconds:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
