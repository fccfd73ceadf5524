"""Header blocks of the wire transport: HPACK encoding of our few fields, and decoding (``hpack``).

The server encodes its own blocks as literals without indexing and never adds to its dynamic table
(the first block of a connection sets the table's size to 0), so nothing the peer announces about
its decoder matters. Request blocks are decoded by the ``hpack`` library; the first block of a
connection is memoised (:class:`HeaderDecoder`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import hpack


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


# :status 200 (static index 8) and content-type (static index 31) application/grpc. The server
# never adds to its dynamic table; the first block of a connection sets its size to 0.
RESPONSE_HEADERS = b"\x88" + _int(31, 4) + _int(16, 7) + b"application/grpc"
TABLE_SIZE_ZERO = b"\x20"


_MESSAGE_SAFE = frozenset(range(0x20, 0x7F)) - {ord("%")}


def _percent(message: str) -> bytes:
    """grpc-message's percent-encoding of UTF-8 (gRPC over HTTP/2)."""
    raw = message.encode("utf-8", "replace")
    if all(b in _MESSAGE_SAFE for b in raw):
        return raw
    return b"".join(bytes((b,)) if b in _MESSAGE_SAFE else b"%%%02X" % b for b in raw)


def trailers(code: int, message: str = "", metadata: Sequence[tuple[str, Any]] = ()) -> bytes:
    """The HPACK block of a call's status: grpc-status, grpc-message and any trailing metadata."""
    block = literal(b"grpc-status", b"%d" % code)
    if message:
        block += literal(b"grpc-message", _percent(message[:1024]))
    for key, value in metadata:
        name = key.lower().encode("ascii")
        if name.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else str(value).encode()
            block += literal(name, base64.b64encode(raw).rstrip(b"="))
        else:
            block += literal(name, value if isinstance(value, bytes) else str(value).encode())
    return block


CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_FIRST_BLOCKS: dict[tuple[int, bytes], list[tuple[bytes, bytes]]] = {}
_FIRST_BLOCKS_MAX = 256
_FIRST_BLOCK_BYTES = 1024


class HeaderDecoder:
    """HPACK decoding (the ``hpack`` library) with the first block of a connection memoised.

    A fleet's agents open one connection each and send the same first header block, which the
    library decodes from an empty dynamic table: its result depends on the bytes alone, so it is
    kept (at most 256 blocks of up to 1 KiB). Only when a second block arrives on the
    connection is the first one decoded for real, to rebuild the table the second refers to.
    """

    __slots__ = ("_decoder", "_max", "_replay")

    def __init__(self, max_header_list: int) -> None:
        self._max = max_header_list
        self._decoder: hpack.Decoder | None = None
        self._replay: bytes | None = None

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        if self._decoder is None and self._replay is None:
            cached = _FIRST_BLOCKS.get((self._max, block))
            if cached is not None:
                self._replay = block
                return cached
        decoder = self._decoder
        if decoder is None:
            decoder = self._decoder = hpack.Decoder(max_header_list_size=self._max)
            if self._replay is not None:
                decoder.decode(self._replay, raw=True)
                self._replay = None
            else:
                headers = [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]
                if len(block) <= _FIRST_BLOCK_BYTES:
                    if len(_FIRST_BLOCKS) >= _FIRST_BLOCKS_MAX:
                        _FIRST_BLOCKS.clear()
                    _FIRST_BLOCKS[(self._max, block)] = headers
                return headers
        return [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]
