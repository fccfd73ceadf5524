"""imagebuilder/guest/boltcanon.py: containerd's bbolt databases rewritten canonically, times clamped."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from imagebuilder.guest import boltcanon
from imagebuilder.guest.boltcanon import Bucket

EPOCH = 1793491200  # 2026-11-01
DATA = Path(__file__).parent / "data"


def _go_time(unix: int, nanos: int = 0, zone: int = -1) -> bytes:
    """Go's time.MarshalBinary (version 1) of a UTC instant."""
    return b"\x01" + struct.pack(">qih", unix + boltcanon.GO_UNIX_OFFSET, nanos, zone)


def _db(created: int, *, order: list[str]) -> Bucket:
    images = Bucket(sequence=0)
    for name in order:
        images.items[name.encode()] = Bucket(items={
            b"createdat": _go_time(created, 123456789), b"updatedat": _go_time(created + 5),
            b"target": Bucket(items={b"digest": b"sha256:" + name.encode() * 8, b"size": b"\x9c\x03"}),
        })  # fmt: skip
    big = Bucket(items={f"blob{i:04d}".encode(): bytes(300) for i in range(200)})  # overflow pages
    return Bucket(
        items={
            b"v1": Bucket(sequence=7, items={b"k8s.io": Bucket(items={b"images": images, b"content": big})})
        }
    )


def test_the_same_content_gives_the_same_bytes_whatever_the_order_and_the_time() -> None:
    one, _ = boltcanon.canonical(
        boltcanon._Writer(4096).write(_db(EPOCH + 3600, order=["a", "b", "c"])), EPOCH
    )
    two, _ = boltcanon.canonical(
        boltcanon._Writer(4096).write(_db(EPOCH + 7200, order=["c", "a", "b"])), EPOCH
    )
    assert one == two
    assert len(one) % 4096 == 0


def test_times_are_clamped_and_everything_else_kept() -> None:
    data = boltcanon._Writer(4096).write(_db(EPOCH + 3600, order=["a"]))
    out, changed = boltcanon.canonical(data, EPOCH)
    assert changed == 2
    root, page_size = boltcanon.read(out)
    assert page_size == 4096
    v1 = root.items[b"v1"]
    assert (
        isinstance(v1, Bucket) and v1.sequence == 7
    )  # bucket sequences survive (containerd's snapshot ids)
    image = v1.items[b"k8s.io"].items[b"images"].items[b"a"]  # type: ignore[union-attr]
    assert isinstance(image, Bucket)
    assert image.items[b"createdat"] == _go_time(EPOCH) == image.items[b"updatedat"]
    assert image.items[b"target"].items[b"size"] == b"\x9c\x03"  # type: ignore[union-attr]
    content = v1.items[b"k8s.io"].items[b"content"]  # type: ignore[union-attr]
    assert isinstance(content, Bucket) and len(content.items) == 200


def test_older_times_and_other_keys_are_left_alone() -> None:
    root = Bucket(
        items={b"b": Bucket(items={b"createdat": _go_time(EPOCH - 10, 5), b"other": _go_time(EPOCH + 10)})}
    )
    assert boltcanon.clamp_times(root, EPOCH) == 0


def test_the_meta_pages_are_bbolts() -> None:
    out, _ = boltcanon.canonical(boltcanon._Writer(4096).write(_db(EPOCH, order=["a"])), EPOCH)
    for page in (0, 1):
        pgid, flags, _count, _overflow = boltcanon.PAGE_HEADER.unpack_from(out, page * 4096)
        assert (pgid, flags) == (page, boltcanon.META)
        body = out[page * 4096 + 16 : page * 4096 + 16 + boltcanon.META_BODY.size]
        magic, version, psize, _f, _root, _seq, freelist, high, txid = boltcanon.META_BODY.unpack(body)
        assert (magic, version, psize, freelist, txid) == (boltcanon.MAGIC, 2, 4096, 2, page)
        assert high * 4096 == len(out)
        assert struct.unpack_from("<Q", out, page * 4096 + 16 + boltcanon.META_BODY.size)[
            0
        ] == boltcanon._fnv1a64(body)
    assert boltcanon.PAGE_HEADER.unpack_from(out, 2 * 4096)[1:3] == (boltcanon.FREELIST, 0)


def test_a_file_that_is_no_bbolt_database_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.db"
    other.write_bytes(b"SQLite format 3\0" + bytes(100))
    assert boltcanon.main([str(EPOCH), str(other)]) == 0
    assert "not a bbolt database, left alone" in capsys.readouterr().out
    assert other.read_bytes().startswith(b"SQLite")


def test_a_damaged_database_fails_and_stays(tmp_path: Path) -> None:
    damaged = tmp_path / "meta.db"
    data = bytearray(boltcanon._Writer(4096).write(_db(EPOCH, order=["a"])))
    data[16 + 30] ^= 0xFF  # both meta pages' checksums no longer match
    data[4096 + 16 + 30] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert boltcanon.main([str(EPOCH), str(damaged)]) == 1
    assert damaged.read_bytes() == bytes(data)


def test_rewrite_keeps_mode_and_is_idempotent(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    db.write_bytes(boltcanon._Writer(4096).write(_db(EPOCH + 1, order=["b", "a"])))
    db.chmod(0o600)
    assert boltcanon.main([str(EPOCH), str(db)]) == 0
    first = db.read_bytes()
    assert db.stat().st_mode & 0o777 == 0o600
    assert boltcanon.main([str(EPOCH), str(db)]) == 0
    assert db.read_bytes() == first
