"""server/wire's header blocks and statuses, decoded by ``hpack`` (the ecosystem's decoder)."""

from __future__ import annotations

import base64
import urllib.parse

import hpack
import pytest
from hyperframe.frame import PingFrame, RstStreamFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from server.wire import h2 as wire_h2
from server.wire import headers as wire_headers
from server.wire.headers import _percent, literal, trailers
from server.wire.server import parse_timeout
from tests.server.wire.helpers import (
    ABORT_MESSAGE,
    ABORT_TRAILING,
)

pytestmark = pytest.mark.timeout(180)


# == 4. units, decoded by hpack ====================================================================
def _decode(block: bytes) -> list[tuple[bytes, bytes]]:
    decoder = hpack.Decoder(max_header_list_size=1 << 23)  # the default stops at 64 KiB
    return [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]


def _b64(value: bytes) -> bytes:
    return base64.b64decode(value + b"=" * (-len(value) % 4))


def test_trailers_decode_to_status_message_and_metadata() -> None:
    block = trailers(9, ABORT_MESSAGE, [("X-Mixed-Case", "v"), *ABORT_TRAILING])
    fields = _decode(block)
    assert fields[0] == (b"grpc-status", b"9")
    assert fields[1][0] == b"grpc-message"
    assert urllib.parse.unquote_to_bytes(fields[1][1]) == ABORT_MESSAGE.encode()
    assert all(0x20 <= b <= 0x7E for b in fields[1][1])
    rest = dict(fields[2:])
    assert rest[b"x-mixed-case"] == b"v"
    for key, value in ABORT_TRAILING:
        wire_value = rest[key.encode()]
        if key.endswith("-bin"):
            assert b"=" not in wire_value  # unpadded, as the gRPC spec says implementations should emit
            assert _b64(wire_value) == value
        else:
            assert wire_value == str(value).encode()


def test_trailers_without_a_message_and_a_long_message() -> None:
    assert _decode(trailers(0)) == [(b"grpc-status", b"0")]
    long = _decode(trailers(2, "é" * 5000))
    assert urllib.parse.unquote_to_bytes(long[1][1]).decode() == "é" * 1024


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"1S", 1.0),
        (b"250m", 0.25),
        (b"5M", 300.0),
        (b"2H", 7200.0),
        (b"1500u", 0.0015),
        (b"99999999n", 0.099999999),
        (b"0S", 0.0),
        (b"12345678S", 12345678.0),
    ],
)
def test_parse_timeout(value: bytes, seconds: float) -> None:
    parsed = parse_timeout(value)
    assert parsed is not None and parsed == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [b"", b"S", b"1", b"123456789S", b"1s", b"1.5S", b"-1S", b"+1S", b" 1S", b"1x", b"\xd9\xa1S", b"1SS"],
)
def test_parse_timeout_refuses_what_is_not_a_grpc_timeout(value: bytes) -> None:
    assert parse_timeout(value) is None


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_percent_encoding_round_trips(message: str) -> None:
    encoded = _percent(message)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert urllib.parse.unquote_to_bytes(encoded) == message.encode("utf-8", "replace")
    for escape in encoded.split(b"%")[1:]:  # every % starts a %XX of upper-case hex digits
        assert len(escape) >= 2 and all(c in b"0123456789ABCDEF" for c in escape[:2]), encoded


def test_percent_encoding_of_examples() -> None:
    assert _percent("plain ascii ~!") == b"plain ascii ~!"
    assert _percent("100%") == b"100%25"
    assert _percent("é") == b"%C3%A9"
    assert _percent("a\nb\x7f") == b"a%0Ab%7F"


@given(st.binary(min_size=1, max_size=400), st.binary(max_size=20_000))
@settings(max_examples=200, deadline=None)
def test_literal_decodes_with_hpack(name: bytes, value: bytes) -> None:
    decoder = hpack.Decoder()
    assert [(bytes(n), bytes(v)) for n, v in decoder.decode(literal(name, value), raw=True)] == [
        (name, value)
    ]
    assert len(decoder.header_table.dynamic_entries) == 0  # "without indexing": the table stays empty


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 255, 16_383, 16_384, 2**21])
def test_literal_integer_boundaries(size: int) -> None:
    name, value = b"n" * max(size % 300, 1), b"v" * size
    assert _decode(literal(name, value)) == [(name, value)]


def test_the_response_header_block_decodes() -> None:
    fields = _decode(wire_headers.TABLE_SIZE_ZERO + wire_headers.RESPONSE_HEADERS + trailers(0))
    assert fields == [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"0")]


def test_frames_decode_with_hyperframe() -> None:
    from hyperframe.frame import Frame

    raw = wire_h2.frame(wire_h2.PING, wire_h2.FLAG_ACK, 0, b"abcdefgh")
    parsed, length = Frame.parse_frame_header(memoryview(raw[:9]))
    parsed.parse_body(memoryview(raw[9 : 9 + length]))
    assert isinstance(parsed, PingFrame) and "ACK" in parsed.flags and parsed.opaque_data == b"abcdefgh"
    raw = wire_h2.frame(wire_h2.RST_STREAM, 0, 7, (8).to_bytes(4, "big"))
    parsed, length = Frame.parse_frame_header(memoryview(raw[:9]))
    parsed.parse_body(memoryview(raw[9:]))
    assert isinstance(parsed, RstStreamFrame) and parsed.stream_id == 7 and parsed.error_code == 8
