"""Signed per-chunk digests (protocol.chunklist): the raw path checks each chunk on its own hasher thread.

The chunk list is the oracle's, not ours: coreutils' ``split --filter=sha256sum`` computes the same
lines (tests/imager/test_release.py checks a release's lists that way); here the imager's use of it:
every chunk checked, a changed chunk refused by its number before the head is written, a list that
does not fit the image refused before any byte is fetched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from imager import blockdev
from imager.errors import ImagerError, Reason
from imager.http import Fetcher
from imager.write import CHUNK, HEAD_BYTES, Written, hashers_for, write_raw
from protocol import chunklist
from protocol.errors import ReleaseFormatError
from protocol.release import ChunkList, Image
from tests.imager.server import Fault, ReleaseServer

MiB = 1 << 20
SIZE = 5 * CHUNK + 3 * MiB  # six chunks of 8 MiB, the last one short


@pytest.fixture
def image(tmp_path: Path) -> tuple[Path, Image, tuple[bytes, ...]]:
    path = tmp_path / "srv" / "node.raw"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    listed = chunklist.render(path, CHUNK)
    sliced = subprocess.run(["split", "-b", str(CHUNK), "--filter=sha256sum", str(path)], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert listed.decode() == "".join(line.split()[0] + "\n" for line in sliced.splitlines())
    digests = chunklist.parse(listed, size=SIZE, chunk_size=CHUNK, name="node.raw.sha256-chunks")
    chunks = ChunkList("node.raw.sha256-chunks", hashlib.sha256(listed).hexdigest(), len(listed), CHUNK)
    whole = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, Image("node.raw", whole, SIZE, "raw", SIZE, chunks), digests


def _target(tmp_path: Path) -> Path:
    target = tmp_path / "target.disk"
    with target.open("wb") as fh:
        fh.truncate(SIZE + 8 * MiB)
    blockdev.wipe(target)
    return target


def _write(
    path: Path, signed: Image, target: Path, chunks: tuple[bytes, ...], fault: Fault | None = None
) -> Written:
    """``write_raw`` of the served image to ``target`` with the signed chunk list ``chunks``."""
    with ReleaseServer(path.parent) as srv:
        if fault is not None:
            srv.faults["/node.raw"] = fault
        return write_raw(Fetcher(attempts=1), f"{srv.url}/node.raw", signed, target, chunks=chunks)


def _head_blank(target: Path) -> bool:
    """No partition table was committed: the disk cannot boot."""
    with target.open("rb") as fh:
        return not any(fh.read(HEAD_BYTES))


def test_every_chunk_is_checked_and_the_disk_holds_the_image(
    tmp_path: Path, image: tuple[Path, Image, tuple[bytes, ...]]
) -> None:
    path, signed, digests = image
    target = _target(tmp_path)
    written = _write(path, signed, target, digests)
    assert written.sha256 == signed.sha256
    with target.open("rb") as fh:
        assert fh.read(SIZE) == path.read_bytes()


def test_the_chunks_are_what_is_checked_not_only_the_whole_digest(
    tmp_path: Path, image: tuple[Path, Image, tuple[bytes, ...]]
) -> None:
    """The whole digest is right, one listed chunk is not: the chunk path is the one that ran."""
    path, signed, digests = image
    wrong = (*digests[:2], hashlib.sha256(b"another chunk").digest(), *digests[3:])
    target = _target(tmp_path)
    with pytest.raises(ImagerError) as caught:
        _write(path, signed, target, wrong)
    assert caught.value.reason == Reason.digest_mismatch
    assert f"chunk 2 (bytes {2 * CHUNK}-{3 * CHUNK - 1})" in caught.value.message
    assert _head_blank(target), "the head was written: the disk could boot"


def test_a_byte_flipped_in_one_chunk_stops_the_stream_naming_that_chunk(
    tmp_path: Path, image: tuple[Path, Image, tuple[bytes, ...]]
) -> None:
    path, signed, digests = image
    target = _target(tmp_path)
    with pytest.raises(ImagerError) as caught:
        _write(path, signed, target, digests, Fault(flip=4 * CHUNK + 12345))
    assert caught.value.reason == Reason.digest_mismatch
    assert "chunk 4 " in caught.value.message and digests[4].hex() in caught.value.message
    assert _head_blank(target)


def test_a_chunk_list_that_does_not_fit_the_image_is_refused() -> None:
    line = b"0" * 64 + b"\n"
    with pytest.raises(ReleaseFormatError, match="6 chunks of 8388608 bytes need 390"):
        chunklist.parse(line * 5, size=SIZE, chunk_size=CHUNK, name="x")
    with pytest.raises(ReleaseFormatError, match="line 3 is not a lower-case hex SHA-256"):
        chunklist.parse(line * 2 + b"0" * 63 + b"G\n" + line * 3, size=SIZE, chunk_size=CHUNK, name="x")
    for bad in (0, 3 << 20, 2 << 30, True, "64M"):
        with pytest.raises(ReleaseFormatError, match="power of two from 1 MiB to 1 GiB"):
            chunklist.check_chunk_size(bad, "release.json", "images[0].chunks")


def test_one_hasher_per_cpu_at_most_eight() -> None:
    assert [hashers_for(n) for n in (0, 1, 2, 16)] == [1, 1, 2, 8]


def test_a_disk_that_does_not_keep_a_chunk_is_refused_at_read_back(
    tmp_path: Path, image: tuple[Path, Image, tuple[bytes, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back checks the chunks too (on several threads): a byte the disk lost is found there."""
    path, signed, digests = image
    target = _target(tmp_path)
    real_flush = blockdev.flush

    def losing_flush(where: Path) -> None:  # the read-back starts by flushing: the disk "loses" a byte then
        with target.open("r+b") as fh:
            fh.seek(3 * CHUNK + 7)
            byte = fh.read(1)
            fh.seek(3 * CHUNK + 7)
            fh.write(bytes([byte[0] ^ 0xFF]))
        real_flush(where)

    monkeypatch.setattr(blockdev, "flush", losing_flush)
    with pytest.raises(ImagerError) as caught:
        _write(path, signed, target, digests)
    assert caught.value.reason == Reason.readback_mismatch
    assert (
        "chunk 3 reads back as sha256" in caught.value.message and digests[3].hex() in caught.value.message
    )
