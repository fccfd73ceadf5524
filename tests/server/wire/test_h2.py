"""server/wire against raw HTTP/2 (tests/support/h2raw.py): protocol errors, floods, flow control, limits.

The server's answers are decoded by ``hyperframe`` and ``hpack``: the ecosystem's parsers are the oracle.
"""

from __future__ import annotations

import json

import hpack
import pytest
from google.protobuf import wrappers_pb2
from hyperframe.frame import DataFrame, PingFrame, SettingsFrame

from server.wire.h2 import Limits
from tests.server.wire.helpers import (
    ECHO,
    ECHO_STREAM,
    HANG,
    KIB,
    LIMITS,
    META,
    SIZED,
    RawFactory,
    WireFactory,
    WireThread,
    bytes_value,
    new_tag,
    sv,
)
from tests.support.h2raw import (
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    HEADERS,
    PING,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    RawH2,
    frame,
)

pytestmark = pytest.mark.timeout(180)


# == 2. raw HTTP/2 ==================================================================================
def _goaway_code(conn: RawH2) -> int | None:
    goaway = conn.goaway()
    return None if goaway is None else goaway.error_code


def test_the_server_opens_with_its_settings_and_acks_ours(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    settings_seen = conn.ready()
    assert settings_seen.get(0x3) == LIMITS.max_streams  # SETTINGS_MAX_CONCURRENT_STREAMS
    assert settings_seen.get(0x6) == LIMITS.max_header_block  # SETTINGS_MAX_HEADER_LIST_SIZE
    assert settings_seen.get(0x2, 0) == 0  # a server never enables push (RFC 9113 §6.5.2)
    assert conn.read_until(
        lambda: any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in conn.frames)
    )


@pytest.mark.parametrize(
    "preface",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", b"PRI * HTTP/1.1\r\n"],
    ids=["http1", "same-length", "short-prefix-mismatch"],
)
def test_a_wrong_preface_is_a_protocol_error(wire: WireThread, raws: RawFactory, preface: bytes) -> None:
    conn = raws(wire, preface=False, settings=False)
    conn.send(preface)
    assert conn.closed()
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_the_first_frame_must_be_settings(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire, settings=False)
    conn.send_frame(PING, 0, 0, b"12345678")
    assert _goaway_code(conn) == PROTOCOL_ERROR
    assert conn.closed()


def test_a_frame_above_16384_bytes_is_a_frame_size_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(HEADERS, END_HEADERS, 1, b"\x00" * 16_385)
    assert _goaway_code(conn) == FRAME_SIZE_ERROR
    assert conn.closed()


def test_data_on_stream_0_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(DATA, 0, 0, b"abc")
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_headers_on_an_even_stream_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(2)
    assert _goaway_code(conn) == PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([frame(SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00")], FLOW_CONTROL_ERROR),  # INITIAL_WINDOW 2^31
        ([frame(SETTINGS, 0, 0, b"\x00\x05\x00\x00\x3f\xff")], PROTOCOL_ERROR),  # MAX_FRAME_SIZE 16383
        ([frame(SETTINGS, 0, 0, b"\x00\x05\x01\x00\x00\x00")], PROTOCOL_ERROR),  # MAX_FRAME_SIZE 2^24
        ([frame(SETTINGS, 0, 0, b"\x00\x02\x00\x00\x00\x02")], PROTOCOL_ERROR),  # ENABLE_PUSH 2
        ([frame(SETTINGS, 0, 0, b"\x00\x04\x00")], FRAME_SIZE_ERROR),  # not a multiple of 6
        ([frame(SETTINGS, 0, 1)], PROTOCOL_ERROR),  # on a stream
        ([frame(SETTINGS, 1, 0, b"\x00\x04\x00\x00\x00\x01")], FRAME_SIZE_ERROR),  # ACK with a payload
        ([frame(PING, 0, 0, b"1234567")], FRAME_SIZE_ERROR),
        ([frame(PING, 0, 1, b"12345678")], PROTOCOL_ERROR),
        ([frame(RST_STREAM, 0, 0, b"\x00\x00\x00\x08")], PROTOCOL_ERROR),
        ([frame(RST_STREAM, 0, 7, b"\x00\x00\x00\x08")], PROTOCOL_ERROR),  # an idle stream (§6.4)
        ([frame(WINDOW_UPDATE, 0, 9, b"\x00\x00\x01\x00")], PROTOCOL_ERROR),  # an idle stream (§5.1)
        ([frame(WINDOW_UPDATE, 0, 0, b"\x00\x01")], FRAME_SIZE_ERROR),
        ([frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02")], PROTOCOL_ERROR),
        ([frame(CONTINUATION, END_HEADERS, 1, b"\x88")], PROTOCOL_ERROR),  # no header block open
        ([frame(PRIORITY, 0, 1, b"\x00\x00")], FRAME_SIZE_ERROR),
        ([frame(DATA, 0, 5, b"\x00\x00\x00\x00\x00")], PROTOCOL_ERROR),  # an idle stream
    ],
    ids=[
        "initial-window-too-large",
        "max-frame-too-small",
        "max-frame-too-large",
        "enable-push-2",
        "settings-length",
        "settings-on-stream",
        "settings-ack-payload",
        "ping-length",
        "ping-on-stream",
        "rst-on-stream-0",
        "rst-on-idle",
        "window-update-idle",
        "window-update-length",
        "push-promise",
        "stray-continuation",
        "priority-length",
        "data-idle",
    ],
)
def test_connection_errors(wire: WireThread, raws: RawFactory, frames: list[bytes], code: int) -> None:
    conn = raws(wire)
    conn.ready()
    conn.send(b"".join(frames))
    assert _goaway_code(conn) == code
    assert conn.closed()


def test_a_frame_inside_a_header_block_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    block = conn.encode(conn.request_headers(ECHO))
    conn.send_frame(HEADERS, 0, 1, block[:3])  # no END_HEADERS
    conn.send_frame(PING, 0, 0, b"12345678")
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_a_continuation_flood_beyond_max_header_block_is_refused(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_header_block=8 * KIB))
    conn = raws(srv)
    block = conn.encode(conn.request_headers(HANG))
    conn.send_frame(HEADERS, 0, 1, block)
    for _ in range(40):  # 160 KiB of header block, never ended
        if not conn.try_send(frame(CONTINUATION, 0, 1, b"\x00" * 4096)):
            break
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()
    assert srv.seen.tags("started:") == set()


def test_empty_continuation_frames_count_against_the_control_frame_bound(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    block = conn.encode(conn.request_headers(HANG))
    conn.send_frame(HEADERS, 0, 1, block)
    for _ in range(200):
        if not conn.try_send(frame(CONTINUATION, 0, 1, b"")):
            break
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM


@pytest.mark.parametrize(
    "flood",
    [
        frame(PING, 0, 0, b"pingpong"),
        frame(SETTINGS, 0, 0),
        frame(0xFA, 0, 0, b"unknown"),
        frame(PRIORITY, 0, 3, bytes(5)),
        frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")),
        frame(SETTINGS, 1, 0),  # unsolicited SETTINGS ACKs
    ],
    ids=["ping", "settings", "unknown-type", "priority", "window-update", "settings-ack"],
)
def test_a_control_frame_flood_is_enhance_your_calm(
    make_wire: WireFactory, raws: RawFactory, flood: bytes
) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    conn.ready()
    conn.try_send(flood * 60)
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()


def test_an_empty_data_flood_is_enhance_your_calm(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    conn.headers(1, conn.request_headers(ECHO_STREAM))
    conn.try_send(frame(DATA, 0, 1) * 60)
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM


def test_requests_reset_the_control_frame_count(make_wire: WireFactory, raws: RawFactory) -> None:
    """Between two requests a client may send max_idle_frames control frames, as often as it likes."""
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    for sid in (1, 3, 5):
        conn.send(frame(PING, 0, 0, b"pingpong") * 40)
        conn.call(sid, bytes_value(b"%d" % sid).SerializeToString())
        seen = conn.stream(sid)
        assert seen.status == 0, (sid, seen)
    assert conn.sync()
    assert conn.goaway(timeout=0) is None


def test_ping_is_answered_with_ack_and_the_same_payload(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(PING, 0, 0, b"\x01\x02\x03\x04\xfa\xfb\xfc\xfd")

    def acked() -> list[PingFrame]:
        return [f for f in conn.frames if isinstance(f, PingFrame) and "ACK" in f.flags]

    assert conn.read_until(lambda: bool(acked()))
    assert [f.opaque_data for f in acked()] == [b"\x01\x02\x03\x04\xfa\xfb\xfc\xfd"]
    assert acked()[0].stream_id == 0


def test_unknown_frame_types_are_ignored(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(0xFA, 0x0F, 0, b"extension")
    conn.send_frame(0x21, 0, 1, b"on an idle stream")
    conn.call(1, bytes_value(b"still fine").SerializeToString())
    assert conn.stream(1).status == 0
    assert conn.goaway(timeout=0) is None


def test_a_window_update_of_0_on_the_connection_is_a_protocol_error(
    wire: WireThread, raws: RawFactory
) -> None:
    conn = raws(wire)
    conn.send_frame(WINDOW_UPDATE, 0, 0, (0).to_bytes(4, "big"))
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_a_window_update_overflowing_the_connection_window_is_a_flow_control_error(
    wire: WireThread, raws: RawFactory
) -> None:
    conn = raws(wire)
    conn.send_frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big"))  # 65,535 + 2^31 - 1
    assert _goaway_code(conn) == FLOW_CONTROL_ERROR


def test_stream_window_errors_reset_only_the_stream(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    tags = [new_tag(), new_tag()]
    for sid, tag in zip((1, 3), tags, strict=True):
        conn.headers(sid, conn.request_headers(HANG))
        conn.message(sid, sv(tag))
    assert wire.seen.wait(f"started:{tags[0]}") and wire.seen.wait(f"started:{tags[1]}")
    conn.send_frame(WINDOW_UPDATE, 0, 1, (2**31 - 1).to_bytes(4, "big"))  # overflows stream 1's window
    conn.send_frame(WINDOW_UPDATE, 0, 3, (0).to_bytes(4, "big"))
    assert conn.stream(1).reset == FLOW_CONTROL_ERROR
    assert conn.stream(3).reset == PROTOCOL_ERROR
    assert wire.seen.wait(f"cancelled:{tags[0]}") and wire.seen.wait(f"cancelled:{tags[1]}")
    conn.call(5, bytes_value(b"the connection lives").SerializeToString())
    assert conn.stream(5).status == 0


def test_streams_beyond_max_streams_are_refused(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(max_streams=4))
    conn = raws(srv)
    assert conn.ready().get(0x3) == 4
    tags = {sid: new_tag() for sid in (1, 3, 5, 7, 9, 11)}
    for sid, tag in tags.items():
        conn.headers(sid, conn.request_headers(HANG))
        conn.message(sid, sv(tag))
    assert conn.sync()
    assert conn.streams.get(9) is not None and conn.streams[9].reset == REFUSED_STREAM
    assert conn.streams.get(11) is not None and conn.streams[11].reset == REFUSED_STREAM
    for sid in (1, 3, 5, 7):
        assert srv.seen.wait(f"started:{tags[sid]}"), sid
        assert sid not in conn.streams, conn.streams[sid]
    assert not srv.seen.is_set(f"started:{tags[9]}") and not srv.seen.is_set(f"started:{tags[11]}")
    # A slot freed by a reset is usable again.
    conn.send_frame(RST_STREAM, 0, 1, CANCEL.to_bytes(4, "big"))
    tag = new_tag()
    conn.headers(13, conn.request_headers(HANG))
    conn.message(13, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    assert srv.seen.wait(f"cancelled:{tags[1]}")


def test_rapid_reset_is_enhance_your_calm_and_leaves_no_handler_running(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    """CVE-2023-44487: HEADERS then RST_STREAM, over and over, makes the server start and cancel
    a call for every pair without ever holding max_streams; it must be stopped like a flood."""
    srv = make_wire(limits=Limits(max_idle_frames=100))
    conn = raws(srv)
    conn.ready()
    pairs = 2000
    burst = bytearray()
    for i in range(pairs):
        sid, body = 2 * i + 1, sv(f"rr{i}")
        burst += frame(HEADERS, END_HEADERS, sid, conn.encode(conn.request_headers(HANG)))
        burst += frame(DATA, 0, sid, b"\x00" + len(body).to_bytes(4, "big") + body)
        burst += frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big"))
    for i in range(0, len(burst), 64 * KIB):
        if not conn.try_send(bytes(burst[i : i + 64 * KIB])):
            break
    conn.sync()
    goaway = conn.goaway(timeout=2)
    left = srv.wait_no_handlers()
    started = len(srv.seen.tags("started:rr"))
    assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM, (
        f"{pairs} HEADERS+RST_STREAM pairs: no GOAWAY ENHANCE_YOUR_CALM ({goaway}); "
        f"{started} handlers were started and cancelled"
    )
    assert conn.closed()
    assert left == 0, f"{left} handler tasks still running"


def test_an_expired_call_waiting_for_a_request_message_does_not_leak(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    """A streaming call whose grpc-timeout passes while its handler waits for the next request
    message: the handler must end (and nothing of the call stay behind once the client is gone)."""
    srv = make_wire()
    conn = raws(srv)
    conn.headers(1, conn.request_headers(ECHO_STREAM, extra=[("grpc-timeout", "200m")]))
    seen = conn.stream(1)
    assert seen.status == 4, seen  # DEADLINE_EXCEEDED
    conn.close()
    assert srv.wait_no_handlers(timeout=3) == 0, "the handler waits forever for a message"


def test_request_bytes_buffered_beyond_max_buffered_are_enhance_your_calm(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_buffered=100_000, max_message=1024 * KIB))
    conn = raws(srv)
    conn.ready()
    part = b"\x00" + (900_000).to_bytes(4, "big") + b"p" * 40_000  # a message that never completes
    for sid in (1, 3, 5):
        conn.headers(sid, conn.request_headers(ECHO))
        if not conn.try_send(frame(DATA, 0, sid, part[:16_000]) + frame(DATA, 0, sid, part[16_000:32_000])):
            break
        conn.try_send(frame(DATA, 0, sid, part[32_000:]))
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()


def test_a_reset_stream_gives_back_its_buffered_bytes(make_wire: WireFactory, raws: RawFactory) -> None:
    """Partial uploads that the client cancels must not add up against max_buffered forever."""
    srv = make_wire(limits=Limits(max_buffered=100_000, max_message=1024 * KIB))
    conn = raws(srv)
    conn.ready()
    part = b"\x00" + (900_000).to_bytes(4, "big") + b"p" * 40_000
    for sid in (1, 3, 5, 7, 9):  # 200,000 bytes sent in all, never more than 40,005 held
        block = conn.encode(conn.request_headers(ECHO))
        conn.try_send(
            frame(HEADERS, END_HEADERS, sid, block)
            + frame(DATA, 0, sid, part[:16_000])
            + frame(DATA, 0, sid, part[16_000:32_000])
            + frame(DATA, 0, sid, part[32_000:])
            + frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big"))
        )
        if not conn.sync():
            break
    goaway = conn.goaway(timeout=0)
    assert goaway is None, f"stream {sid}: GOAWAY {goaway.error_code}: {goaway.additional_data!r}"
    conn.call(11, bytes_value(b"fine").SerializeToString())
    assert conn.stream(11).status == 0


@pytest.mark.parametrize(
    "headers",
    [
        [(":method", "GET"), (":scheme", "https"), (":path", ECHO), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), ("content-type", "application/grpc")],
        [(":method", "POST"), (":path", ECHO), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), (":path", "Echo"), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), ("content-type", "application/grpc"), (":path", ECHO)],
        [(":method", "POST"), (":method", "POST"), (":scheme", "https"), (":path", ECHO)],
        [(":method", "POST"), (":scheme", "https"), (":path", ECHO), ("Content-Type", "application/grpc")],
    ],
    ids=[
        "get",
        "no-path",
        "no-scheme",
        "relative-path",
        "pseudo-after-regular",
        "duplicate-pseudo",
        "uppercase",
    ],
)
def test_a_malformed_request_is_reset_with_protocol_error(
    wire: WireThread, raws: RawFactory, headers: list[tuple[str, str]]
) -> None:
    conn = raws(wire)
    conn.headers(1, headers)
    conn.message(1, bytes_value(b"x").SerializeToString())
    assert conn.stream(1).reset == PROTOCOL_ERROR
    conn.call(3, bytes_value(b"the connection lives").SerializeToString())
    assert conn.stream(3).status == 0


@pytest.mark.parametrize(
    "extra", [[("connection", "keep-alive")], [("te", "gzip")]], ids=["connection-header", "te-not-trailers"]
)
def test_connection_specific_fields_are_malformed(
    wire: WireThread, raws: RawFactory, extra: list[tuple[str, str]]
) -> None:
    """RFC 9113 §8.2.2: a request with a connection-specific field, or TE other than "trailers",
    MUST be treated as malformed (a stream error of type PROTOCOL_ERROR, §8.1.1)."""
    conn = raws(wire)
    headers = [h for h in conn.request_headers(ECHO) if h[0] != "te"] + extra
    conn.headers(1, headers)
    conn.message(1, bytes_value(b"x").SerializeToString())
    assert conn.stream(1).reset == PROTOCOL_ERROR


@pytest.mark.parametrize("content_type", ["application/json", None], ids=["json", "missing"])
def test_a_request_that_is_not_grpc_gets_an_error(
    wire: WireThread, raws: RawFactory, content_type: str | None
) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, content_type=content_type))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.done
    http_status = seen.headers.get(b":status")
    assert http_status != b"200" or (seen.status is not None and seen.status != 0), seen


def test_grpc_encoding_gzip_is_unimplemented(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, extra=[("grpc-encoding", "gzip")]))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.status == 12, seen  # UNIMPLEMENTED


def test_grpc_encoding_gzip_is_answered_with_grpc_accept_encoding(
    wire: WireThread, raws: RawFactory
) -> None:
    """gRPC doc/compression.md: a request compressed with an algorithm the server does not support
    ends UNIMPLEMENTED, and the server includes grpc-accept-encoding (what it does accept)."""
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, extra=[("grpc-encoding", "gzip")]))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.status == 12, seen
    accepted = b",".join(v for block in seen.blocks for n, v in block if n == b"grpc-accept-encoding")
    assert b"identity" in accepted, seen.blocks


def test_a_compressed_message_without_grpc_encoding_is_internal(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.message(1, bytes_value(b"x").SerializeToString(), compressed=True)
    seen = conn.stream(1)
    assert seen.status == 13, seen  # INTERNAL


def test_a_unary_request_without_a_message_is_an_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO), end_stream=True)
    seen = conn.stream(1)
    assert seen.status == 13, seen  # INTERNAL


def test_a_request_ending_inside_a_message_is_internal(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.send_frame(DATA, END_STREAM, 1, b"\x00\x00\x00\x00\x10abc")  # declares 16 bytes, sends 3
    assert conn.stream(1).status == 13


def test_padded_and_prioritised_frames_are_parsed(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    block = conn.encode(conn.request_headers(ECHO))
    # HEADERS: PADDED | PRIORITY | END_HEADERS, 7 bytes of padding, a priority of 5 bytes.
    conn.send_frame(
        HEADERS, 0x8 | 0x20 | END_HEADERS, 1, b"\x07" + b"\x00\x00\x00\x00\x10" + block + bytes(7)
    )
    body = wrappers_pb2.BytesValue(value=b"padded").SerializeToString()
    msg = b"\x00" + len(body).to_bytes(4, "big") + body
    conn.send_frame(DATA, 0x8 | END_STREAM, 1, b"\x03" + msg + bytes(3))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [wrappers_pb2.BytesValue.FromString(m).value for m in seen.messages()] == [b"padded"]


def test_client_trailers_end_the_request(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.message(1, bytes_value(b"with trailers").SerializeToString(), end_stream=False)
    conn.send_frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.encode([("x-client-trailer", "1")]))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [wrappers_pb2.BytesValue.FromString(m).value for m in seen.messages()] == [b"with trailers"]


def test_a_second_headers_without_end_stream_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(HANG))
    conn.send_frame(HEADERS, END_HEADERS, 1, conn.encode([("x-more", "1")]))
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_data_after_end_stream_is_stream_closed(wire: WireThread, raws: RawFactory) -> None:
    """RFC 9113 §5.1: DATA on a half-closed (remote) stream is a stream error STREAM_CLOSED."""
    conn = raws(wire)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))  # END_STREAM
    assert wire.seen.wait(f"started:{tag}")
    conn.send_frame(DATA, 0, 1, b"\x00\x00\x00\x00\x00")
    assert conn.stream(1).reset == 0x5  # STREAM_CLOSED
    assert wire.seen.wait(f"cancelled:{tag}")


def test_headers_on_a_lower_stream_id_is_a_connection_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.call(5, bytes_value(b"five").SerializeToString())
    assert conn.stream(5).status == 0
    conn.call(3, bytes_value(b"three").SerializeToString())
    assert _goaway_code(conn) in (PROTOCOL_ERROR, 0x5)  # §5.1.1, or STREAM_CLOSED (§5.1)


def test_the_server_respects_the_clients_windows_and_resumes(wire: WireThread, raws: RawFactory) -> None:
    """With SETTINGS_INITIAL_WINDOW_SIZE 0 nothing may be sent; raising it releases the response."""
    conn = raws(wire, settings=False, auto_window=False)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED))
    conn.message(1, wrappers_pb2.Int64Value(value=5000).SerializeToString())
    conn.read_for(0.3)
    assert not any(isinstance(f, DataFrame) and f.data for f in conn.frames)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (65_535).to_bytes(4, "big"))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [len(wrappers_pb2.BytesValue.FromString(m).value) for m in seen.messages()] == [5000]


def test_a_small_client_window_still_gets_the_whole_response(wire: WireThread, raws: RawFactory) -> None:
    """A client may advertise a window smaller than a frame (RFC 9113 §6.9.2: any value up to
    2^31-1) and credit only what it has received; the server must send DATA that fits."""
    conn = raws(wire, settings=False)  # auto_window: credits every DATA frame as it arrives
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (4096).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED))
    conn.message(1, wrappers_pb2.Int64Value(value=20_000).SerializeToString())
    seen = conn.stream(1, timeout=5)
    assert seen.status == 0, f"stalled with {len(seen.data)} bytes received"
    assert [len(wrappers_pb2.BytesValue.FromString(m).value) for m in seen.messages()] == [20_000]


def test_large_responses_use_frames_no_larger_than_16384(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.call(1, wrappers_pb2.Int64Value(value=300 * KIB).SerializeToString(), path=SIZED)
    seen = conn.stream(1)
    assert seen.status == 0
    sizes = [len(f.data) for f in conn.frames if isinstance(f, DataFrame)]
    assert max(sizes) <= 16_384 and sum(sizes) > 300 * KIB


def test_the_server_enforces_grpc_timeout_and_cancels_the_handler(
    wire: WireThread, raws: RawFactory
) -> None:
    """A client that never resets its call: the server's own deadline ends it, and the handler."""
    conn = raws(wire)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG, extra=[("grpc-timeout", "200m")]))
    conn.message(1, sv(tag))
    seen = conn.stream(1)
    assert seen.status == 4, seen  # DEADLINE_EXCEEDED
    assert conn.sync()
    assert wire.seen.wait(f"cancelled:{tag}", 5), "the handler still runs after its deadline"


def test_a_deadline_while_the_response_waits_for_the_window_ends_the_stream(
    wire: WireThread, raws: RawFactory
) -> None:
    """The client gives no window, so the response cannot leave; its deadline must still end the
    call: DEADLINE_EXCEEDED if the trailers can go, otherwise a reset, never a stream left open."""
    conn = raws(wire, settings=False, auto_window=False)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED, extra=[("grpc-timeout", "200m")]))
    conn.message(1, wrappers_pb2.Int64Value(value=5000).SerializeToString())
    seen = conn.stream(1, timeout=5)
    assert seen.done, seen
    assert seen.status == 4 if seen.ended else seen.reset == CANCEL, seen
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (65_535).to_bytes(4, "big"))
    assert conn.sync()
    assert not any(isinstance(f, DataFrame) and f.stream_id == 1 and f.data for f in conn.frames)


def test_maximum_concurrent_rpcs_holds_for_a_burst(make_wire: WireFactory, raws: RawFactory) -> None:
    """Four calls in one TLS record against a server capped at two RPCs: two run, two are refused."""
    srv = make_wire(maximum_concurrent_rpcs=2)
    conn = raws(srv)
    conn.ready()
    tags = {sid: new_tag() for sid in (1, 3, 5, 7)}
    burst = b""
    for sid, tag in tags.items():
        burst += frame(HEADERS, END_HEADERS, sid, conn.encode(conn.request_headers(HANG)))
        burst += frame(DATA, END_STREAM, sid, b"\x00" + len(sv(tag)).to_bytes(4, "big") + sv(tag))
    conn.send(burst)
    conn.read_until(lambda: sum(1 for s in conn.streams.values() if s.done) >= 2, timeout=5)
    conn.sync()
    refused = [sid for sid, s in conn.streams.items() if s.status == 8]
    started = {sid for sid, tag in tags.items() if srv.seen.is_set(f"started:{tag}")}
    assert len(started) <= 2, f"{len(started)} handlers ran at once (refused: {refused})"
    assert len(refused) == 2


# -- HPACK: the first-block memo --------------------------------------------------------------------
def test_the_first_block_memo_keeps_the_dynamic_table_of_every_connection(
    wire: WireThread, raws: RawFactory
) -> None:
    """Five connections send the same first header block (a fleet's agents); a second request on
    two of them refers to the first block's dynamic-table entries and must decode the same."""
    unique = new_tag()
    fleet = [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", META),
        (":authority", "nodeserver.example:8081"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("x-fleet", unique),
        ("x-node", "same for all"),
    ]
    encoder = hpack.Encoder()
    first = encoder.encode(fleet)
    second = encoder.encode([*fleet, ("x-second", "two")])
    assert len(second) < len(first) // 2  # indexed fields: it refers to the first block's entries
    conns = [raws(wire) for _ in range(5)]
    for i, conn in enumerate(conns):
        conn.send_frame(HEADERS, END_HEADERS, 1, first)
        conn.message(1, sv(f"first {i}"))
    for i, conn in enumerate(conns):
        seen = conn.stream(1)
        assert seen.status == 0, (i, seen)
        answer = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)
        assert answer["echo"] == f"first {i}"
        assert ["x-fleet", unique] in answer["metadata"] and ["x-node", "same for all"] in answer["metadata"]
    for i in (0, 3):  # the connection that decoded the block, and one that found it in the memo
        conns[i].send_frame(HEADERS, END_HEADERS, 3, second)
        conns[i].message(3, sv(f"second {i}"))
        seen = conns[i].stream(3)
        assert seen.status == 0, (i, seen)
        answer = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)
        assert answer["echo"] == f"second {i}"
        md = answer["metadata"]
        assert (
            ["x-fleet", unique] in md and ["x-node", "same for all"] in md and ["x-second", "two"] in md
        ), md
    # A third block on a memo connection still decodes (the decoder's state carried on).
    third = encoder.encode([*fleet, ("x-second", "two"), ("x-third", "3")])
    conns[3].send_frame(HEADERS, END_HEADERS, 5, third)
    conns[3].message(5, sv("third"))
    seen = conns[3].stream(5)
    md = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)["metadata"]
    assert ["x-third", "3"] in md and ["x-fleet", unique] in md


def test_a_bad_header_block_is_a_compression_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\x7f")  # index out of any table
    assert _goaway_code(conn) == 0x9  # COMPRESSION_ERROR
