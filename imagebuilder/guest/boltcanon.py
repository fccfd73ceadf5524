"""Rewrite a bbolt database in a canonical form: the same buckets, keys and values give the same bytes.

Run by the image's own ``python3`` in the provisioning boot (the staging plan's ``bolt`` entry,
cloud-init/stage.sh), standard library only, on containerd's databases after its image import
(``/var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db``, the overlayfs snapshotter's
``metadata.db``). bbolt, the B+tree store containerd uses, never clears a page it frees, lays pages
out by the history of its transactions (and containerd's garbage collector runs them when it
pleases), and containerd stamps records with the time (``createdat``, ``updatedat``). So two imports of
the same archives leave files that differ in freed pages (the import's random lease ids), in page
order and in times. This module reads every bucket, key and value, clamps every time stamp to
``SOURCE_DATE_EPOCH`` (values of keys named ``createdat``/``updatedat`` in Go's ``time.MarshalBinary``
form: the instant changes, the zone and the length stay), and writes a new file:

* page 0 and 1: the meta pages (magic, version 2, page size, the root bucket, freelist at page 2,
  the high-water mark, transaction ids 0 and 1, FNV-1a checksums), as ``bbolt`` writes a new database;
* page 2: an empty freelist;
* then every bucket depth-first in key order, each as one leaf page (with overflow pages when it is
  larger than a page), its sub-buckets written before it so it can name their pages; a bucket keeps
  its sequence (containerd's snapshot ids come from it).

Every bucket gets a page of its own (bbolt would inline small ones; it reads either, and splits or
inlines them again on its next write). A bucket of more than 65,535 keys cannot be one leaf page:
such a file is left as it is, with an error.

    python3 boltcanon.py SOURCE_DATE_EPOCH FILE...
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field

MAGIC = 0xED0CDAED
VERSION = 2
BRANCH, LEAF, META, FREELIST = 0x01, 0x02, 0x04, 0x10
BUCKET_FLAG = 0x01
PAGE_HEADER = struct.Struct("<QHHI")  # id, flags, count, overflow
LEAF_ELEMENT = struct.Struct("<IIII")  # flags, pos, ksize, vsize
BRANCH_ELEMENT = struct.Struct("<IIQ")  # pos, ksize, pgid
BUCKET_HEADER = struct.Struct("<QQ")  # root pgid, sequence
META_BODY = struct.Struct(
    "<IIII QQ QQQ"
)  # magic, version, page size, flags, root(root, seq), freelist, pgid, txid
TIME_KEYS = (b"createdat", b"updatedat")
GO_UNIX_OFFSET = 62135596800  # seconds from 0001-01-01 to 1970-01-01 (Go's time encoding)
MAX_ELEMENTS = 0xFFFF


class BoltError(Exception):
    pass


@dataclass
class Bucket:
    sequence: int = 0
    items: dict[bytes, bytes | Bucket] = field(default_factory=dict)


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# -- reading ----------------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.page_size, root, self.txid = self._meta()
        self.root = self._bucket(root[0], root[1], None)

    def _meta(self) -> tuple[int, tuple[int, int], int]:
        best: tuple[int, tuple[int, int], int] | None = None
        for page in (0, 1):
            # page 0 is at 0; page 1 at the page size, which page 0 (or the OS default) says
            size = struct.unpack_from("<I", self.data, PAGE_HEADER.size + 8)[0] if page else 0
            offset = page * size
            if offset + PAGE_HEADER.size + META_BODY.size + 8 > len(self.data):
                continue
            body = self.data[offset + PAGE_HEADER.size : offset + PAGE_HEADER.size + META_BODY.size]
            magic, version, psize, _flags, root, seq, _freelist, _pgid, txid = META_BODY.unpack(body)
            checksum = struct.unpack_from("<Q", self.data, offset + PAGE_HEADER.size + META_BODY.size)[0]
            if magic != MAGIC or version != VERSION or checksum != _fnv1a64(body):
                continue
            if best is None or txid > best[2]:
                best = (psize, (root, seq), txid)
        if best is None:
            raise BoltError("no valid meta page: not a bbolt database (or a damaged one)")
        return best

    def _page(self, buf: bytes, offset: int) -> tuple[int, int, int]:
        _id, flags, count, _overflow = PAGE_HEADER.unpack_from(buf, offset)
        return flags, count, offset + PAGE_HEADER.size

    def _bucket(self, root: int, sequence: int, inline: bytes | None) -> Bucket:
        bucket = Bucket(sequence)
        if inline is not None:
            self._node(inline, 0, bucket)
        else:
            self._node(self.data, root * self.page_size, bucket)
        return bucket

    def _node(self, buf: bytes, offset: int, bucket: Bucket) -> None:
        flags, count, elements = self._page(buf, offset)
        if flags & BRANCH:
            for i in range(count):
                at = elements + i * BRANCH_ELEMENT.size
                _pos, _ksize, pgid = BRANCH_ELEMENT.unpack_from(buf, at)
                self._node(self.data, pgid * self.page_size, bucket)
            return
        if not flags & LEAF:
            raise BoltError(f"page at {offset} is neither a branch nor a leaf (flags {flags:#x})")
        for i in range(count):
            at = elements + i * LEAF_ELEMENT.size
            eflags, pos, ksize, vsize = LEAF_ELEMENT.unpack_from(buf, at)
            key = bytes(buf[at + pos : at + pos + ksize])
            value = bytes(buf[at + pos + ksize : at + pos + ksize + vsize])
            if eflags & BUCKET_FLAG:
                root, sequence = BUCKET_HEADER.unpack_from(value, 0)
                bucket.items[key] = self._bucket(
                    root, sequence, value[BUCKET_HEADER.size :] if root == 0 else None
                )
            else:
                bucket.items[key] = value


def read(data: bytes) -> tuple[Bucket, int]:
    """The root bucket of a bbolt file and its page size."""
    try:
        reader = _Reader(data)
    except (struct.error, IndexError, RecursionError) as exc:
        raise BoltError(f"unreadable bbolt database: {exc}") from exc
    return reader.root, reader.page_size


# -- time stamps ------------------------------------------------------------------------------------------


def clamp_times(bucket: Bucket, epoch: int) -> int:
    """Clamp every Go ``time.MarshalBinary`` value of a ``createdat``/``updatedat`` key to ``epoch``; the count."""
    changed = 0
    for key, value in bucket.items.items():
        if isinstance(value, Bucket):
            changed += clamp_times(value, epoch)
        elif key in TIME_KEYS and len(value) in (15, 16) and value[0] in (1, 2):
            seconds = struct.unpack_from(">q", value, 1)[0] - GO_UNIX_OFFSET
            nanoseconds = struct.unpack_from(">i", value, 9)[0]
            if seconds > epoch or (seconds == epoch and nanoseconds):
                bucket.items[key] = value[:1] + struct.pack(">qi", epoch + GO_UNIX_OFFSET, 0) + value[13:]
                changed += 1
    return changed


# -- writing ----------------------------------------------------------------------------------------------


class _Writer:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: list[bytes] = []  # pages 3.. (0, 1: meta; 2: freelist)

    def _leaf(self, bucket: Bucket) -> int:
        children = {k: self._leaf(v) for k, v in sorted(bucket.items.items()) if isinstance(v, Bucket)}
        keys = sorted(bucket.items)
        if len(keys) > MAX_ELEMENTS:
            raise BoltError(f"a bucket of {len(keys)} keys does not fit one leaf page")
        values: list[tuple[int, bytes, bytes]] = []
        for key in keys:
            value = bucket.items[key]
            if isinstance(value, Bucket):
                values.append((BUCKET_FLAG, key, BUCKET_HEADER.pack(children[key], value.sequence)))
            else:
                values.append((0, key, value))
        headers = bytearray()
        payload = bytearray()
        start = PAGE_HEADER.size + LEAF_ELEMENT.size * len(values)
        for i, (flags, key, value) in enumerate(values):
            element_at = PAGE_HEADER.size + LEAF_ELEMENT.size * i
            pos = start + len(payload) - element_at
            headers += LEAF_ELEMENT.pack(flags, pos, len(key), len(value))
            payload += key + value
        size = start + len(payload)
        count = max(1, -(-size // self.page_size))
        pgid = 3 + len(self.pages)
        body = PAGE_HEADER.pack(pgid, LEAF, len(values), count - 1) + bytes(headers) + bytes(payload)
        body += bytes(count * self.page_size - len(body))
        for n in range(count):
            self.pages.append(body[n * self.page_size : (n + 1) * self.page_size])
        return pgid

    def write(self, root: Bucket) -> bytes:
        root_page = self._leaf(root)
        high_water = 3 + len(self.pages)
        out = bytearray()
        for txid in (0, 1):
            body = META_BODY.pack(
                MAGIC, VERSION, self.page_size, 0, root_page, root.sequence, 2, high_water, txid
            )
            page = PAGE_HEADER.pack(txid, META, 0, 0) + body + struct.pack("<Q", _fnv1a64(body))
            out += page + bytes(self.page_size - len(page))
        out += PAGE_HEADER.pack(2, FREELIST, 0, 0) + bytes(self.page_size - PAGE_HEADER.size)
        for page in self.pages:
            out += page
        return bytes(out)


def canonical(data: bytes, epoch: int) -> tuple[bytes, int]:
    """The canonical bytes of the database ``data`` with its times clamped to ``epoch``; how many were clamped."""
    root, page_size = read(data)
    changed = clamp_times(root, epoch)
    return _Writer(page_size).write(root), changed


def rewrite(path: str, epoch: int) -> str:
    with open(path, "rb") as fh:
        data = fh.read()
    out, changed = canonical(data, epoch)
    if read(out)[0] != clamp_and_copy(data, epoch):
        raise BoltError("the rewritten database does not read back the same")
    temp = path + ".canonical"
    with open(temp, "wb") as fh:
        fh.write(out)
    stat = os.stat(path)
    os.chmod(temp, stat.st_mode & 0o7777)
    os.chown(temp, stat.st_uid, stat.st_gid)
    os.replace(temp, path)
    return f"{path}: {len(data)} -> {len(out)} bytes, {changed} time stamps clamped"


def clamp_and_copy(data: bytes, epoch: int) -> Bucket:
    root, _ = read(data)
    clamp_times(root, epoch)
    return root


def is_bolt(path: str) -> bool:
    """Whether ``path`` starts like a bbolt database (page 0 a meta page with bbolt's magic)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(PAGE_HEADER.size + 8)
    except OSError:
        return False
    return len(head) == PAGE_HEADER.size + 8 and struct.unpack_from("<II", head, PAGE_HEADER.size) == (
        MAGIC,
        VERSION,
    )


def main(argv: list[str]) -> int:
    """Rewrite each FILE that is a bbolt database (others are named and left alone); 1 when one could not be."""
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: boltcanon.py SOURCE_DATE_EPOCH FILE...", file=sys.stderr)
        return 2
    epoch, status = int(argv[0]), 0
    for path in argv[1:]:
        if not is_bolt(path):
            print(f"{path}: not a bbolt database, left alone")
            continue
        try:
            print(rewrite(path, epoch))
        except (OSError, BoltError) as exc:
            print(f"{path}: not rewritten: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
