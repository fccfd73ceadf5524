"""HTTP/2 server connections carrying gRPC (RFC 9113; header blocks by the ``hpack`` library).

One :class:`Connection` per TLS connection, driven by the event loop's ``data_received``. It
parses frames, keeps both directions' flow-control windows, splits DATA into gRPC's
length-prefixed messages and hands each new stream to its :class:`Application` (the gRPC
dispatcher, :mod:`server.wire.server`). It implements what a gRPC server needs and refuses the
rest: no server push, no priorities (ignored, as RFC 9113 allows), no compression.

Everything a peer sends is bounded before it is kept (:class:`Limits`): the frame size, the
header block, the declared message size, the bytes buffered per connection, the streams open at
once, and the frames that cost the server work without doing any (PING, SETTINGS, reset
streams, empty DATA, WINDOW_UPDATE, unknown types) between two requests. A peer that breaks
the protocol or a bound gets a GOAWAY with the RFC's error code and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from typing import Protocol, cast

from hpack.exceptions import HPACKError

from server.wire.headers import (
    CONNECTION_SPECIFIC,
    RESPONSE_HEADERS,
    TABLE_SIZE_ZERO,
    HeaderDecoder,
    trailers,
)
from server.wire.stream import DEFAULT_WINDOW, Stream

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

S_HEADER_TABLE_SIZE = 0x1
S_ENABLE_PUSH = 0x2
S_MAX_CONCURRENT_STREAMS = 0x3
S_INITIAL_WINDOW_SIZE = 0x4
S_MAX_FRAME_SIZE = 0x5
S_MAX_HEADER_LIST_SIZE = 0x6

MAX_WINDOW = 2**31 - 1
MAX_FRAME = 16_384  # ours: SETTINGS_MAX_FRAME_SIZE is never raised
CONNECTION_WINDOW = 1 << 20
CLOSE_TIMEOUT_S = 5.0  # after close, what the peer has not read is dropped


@dataclass(frozen=True)
class Limits:
    """What one connection may make the server hold (the server's channel arguments map here)."""

    max_streams: int = 16
    max_header_block: int = 16_384
    max_message: int = 4 * 1024 * 1024
    max_buffered: int = 8 * 1024 * 1024
    idle_s: float = 60.0
    # PING, SETTINGS, RST_STREAM, WINDOW_UPDATE, PRIORITY, empty DATA and unknown frames allowed
    # between two new streams; a real client sends a handful.
    max_idle_frames: int = 1000


class ProtocolViolation(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Application(Protocol):
    def admit(self, conn: Connection) -> bool: ...
    def stream_opened(self, conn: Connection, stream: Stream) -> None: ...
    def connection_closed(self, conn: Connection) -> None: ...


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


class Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection, and its TLS (OpenSSL on memory buffers, ALPN h2).

    TLS runs here rather than in asyncio's SSL transport, which keeps a 256 KiB read buffer per
    connection (125 MiB at 500 connections) and adds a layer of calls to every read and write.
    """

    def __init__(
        self,
        app: Application,
        limits: Limits,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        *,
        tls: ssl.SSLContext | None = None,
        handshake_timeout: float = 10.0,
    ) -> None:
        self.app = app
        self.tls = tls
        self.handshake_timeout = handshake_timeout
        self.sslobj: ssl.SSLObject | None = None
        self.tls_in = ssl.MemoryBIO()
        self.tls_out = ssl.MemoryBIO()
        self.handshaking = tls is not None
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.limits = limits
        self.peer = peer
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.settings_seen = False
        self.decoder = HeaderDecoder(limits.max_header_block)
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = MAX_FRAME
        self.recv_unacked = 0
        self.buffered = 0
        self.idle_frames = 0
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.first_block = True
        self.going_away = False
        self.closed = False
        self.lost = False  # connection_lost has run: the transport is gone
        self.paused = False
        self.drained: asyncio.Future[None] | None = None
        self.cont: tuple[Stream | None, int, bytearray, bool] | None = None  # CONTINUATION in progress
        self.idle_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.app.admit(self) is False:  # over the connection cap: closed before any TLS byte
            self.closed = True
            self.transport.abort()
            return
        if self.tls is not None:
            self.sslobj = self.tls.wrap_bio(self.tls_in, self.tls_out, server_side=True)
            self.handshake_timer = self.loop.call_later(self.handshake_timeout, self._handshake_expired)
            return
        self._start()

    # -- TLS (OpenSSL through ssl.MemoryBIO: one small buffer per connection) ----------------
    def _handshake_expired(self) -> None:
        self.handshake_timer = None
        if self.handshaking:
            log.debug("TLS handshake with %s did not finish in time", self.peer)
            self.abort()

    def _tls_received(self, data: bytes) -> None:
        sslobj = self.sslobj
        assert sslobj is not None  # noqa: S101 - set in connection_made
        self.tls_in.write(data)
        if self.handshaking:
            try:
                sslobj.do_handshake()
            except ssl.SSLWantReadError:
                self._tls_send()
                return
            except (ssl.SSLError, OSError) as exc:
                log.debug("TLS handshake with %s failed: %s", self.peer, exc)
                self._tls_send()
                self.abort()
                return
            self.handshaking = False
            if self.handshake_timer is not None:
                self.handshake_timer.cancel()
                self.handshake_timer = None
            self._tls_send()
            if sslobj.selected_alpn_protocol() != "h2":
                log.debug("connection from %s without ALPN h2: closed", self.peer)
                self.abort()
                return
            self._start()
        chunks: list[bytes] = []
        while True:
            try:
                chunk = sslobj.read(65536)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify: what came before it still counts
                if chunks:
                    self._h2_received(b"".join(chunks))
                self.close()
                return
            except (ssl.SSLError, OSError) as exc:
                log.debug("TLS error from %s: %s", self.peer, exc)
                self.abort()
                return
            if not chunk:
                break
            chunks.append(chunk)
        if self.tls_out.pending:
            self._tls_send()  # post-handshake messages (key updates)
        if chunks:
            self._h2_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _tls_send(self) -> None:
        if self.tls_out.pending and self.transport is not None and not self.lost:
            self.transport.write(self.tls_out.read())

    def _start(self) -> None:
        settings = (
            S_MAX_CONCURRENT_STREAMS.to_bytes(2, "big") + self.limits.max_streams.to_bytes(4, "big")
            + S_MAX_HEADER_LIST_SIZE.to_bytes(2, "big") + self.limits.max_header_block.to_bytes(4, "big")
            + S_ENABLE_PUSH.to_bytes(2, "big") + (0).to_bytes(4, "big")
        )  # fmt: skip
        self._queue(frame(SETTINGS, 0, 0, settings))
        self._queue(frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = True
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
        for stream in list(self.streams.values()):
            self._peer_reset(stream)
        self.streams.clear()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.app.connection_closed(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    async def drain(self) -> None:
        """Wait while the peer does not read what was written (bounded memory for slow readers)."""
        if self.paused and not self.closed:
            if self.drained is None:
                self.drained = self.loop.create_future()
            await self.drained

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.sslobj is not None:
            self._tls_received(data)
        else:
            self._h2_received(data)

    def _h2_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self.buf
        buf += data
        try:
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self.preface = True
            pos = 0
            end = len(buf)
            while end - pos >= 9 and not self.closed:
                length = int.from_bytes(buf[pos : pos + 3], "big")
                if length > MAX_FRAME:
                    raise ProtocolViolation(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if end - pos < 9 + length:
                    break
                kind = buf[pos + 3]
                flags = buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, sid, payload)
            del buf[:pos]
            if len(buf) > MAX_FRAME + 9:  # pragma: no cover - a partial frame is never larger
                raise ProtocolViolation(FRAME_SIZE_ERROR, "oversized partial frame")
            if self.recv_unacked >= CONNECTION_WINDOW // 4:
                self._queue(frame(WINDOW_UPDATE, 0, 0, self.recv_unacked.to_bytes(4, "big")))
                self.recv_unacked = 0
        except ProtocolViolation as err:
            self.goaway(err.code, str(err))
        except HPACKError as err:
            self.goaway(COMPRESSION_ERROR, f"header block: {type(err).__name__}")

    # -- frames ------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.cont is not None and kind != CONTINUATION:
            raise ProtocolViolation(PROTOCOL_ERROR, "a frame inside a header block")
        if not self.settings_seen and kind != SETTINGS:
            raise ProtocolViolation(PROTOCOL_ERROR, "the first frame is not SETTINGS")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == PING:
            if sid != 0 or len(payload) != 8:
                raise ProtocolViolation(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed PING")
            self._idle_frame()
            if not flags & FLAG_ACK:
                self._queue(frame(PING, FLAG_ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise ProtocolViolation(
                    PROTOCOL_ERROR if not sid else FRAME_SIZE_ERROR, "malformed RST_STREAM"
                )
            if sid > self.last_stream:
                raise ProtocolViolation(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            self._idle_frame()
            stream = self.streams.get(sid)
            if stream is not None:
                stream.closed = True
                self._drop(stream)  # its buffered bytes are given back
                self._peer_reset(stream)
        elif kind == GOAWAY:
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == PRIORITY:
            if len(payload) != 5:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "malformed PRIORITY")
            self._idle_frame()
        elif kind == PUSH_PROMISE:
            raise ProtocolViolation(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            self._idle_frame()  # unknown frame types are ignored (RFC 9113 §4.1)

    def _idle_frame(self) -> None:
        self.idle_frames += 1
        if self.idle_frames > self.limits.max_idle_frames:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, "too many control frames without a request")

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & FLAG_ACK:
            if payload:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            self._idle_frame()
            return
        if len(payload) % 6:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "malformed SETTINGS")
        if self.settings_seen:
            self._idle_frame()
        self.settings_seen = True
        for i in range(0, len(payload), 6):
            ident = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ProtocolViolation(FLOW_CONTROL_ERROR, "a stream window overflowed")
            elif ident == S_MAX_FRAME_SIZE:
                if not MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif ident == S_ENABLE_PUSH and value > 1:
                raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH out of range")
            # HEADER_TABLE_SIZE: this side's dynamic table is always 0; MAX_CONCURRENT_STREAMS:
            # a server opens none; MAX_HEADER_LIST_SIZE: our response headers are a few bytes.
        self._queue(frame(SETTINGS, FLAG_ACK, 0))
        self._flush_pending()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        self._idle_frame()
        if sid == 0:
            if inc == 0:
                raise ProtocolViolation(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR, "the connection window overflowed")
            self._flush_pending()
            return
        if sid > self.last_stream:
            raise ProtocolViolation(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        stream = self.streams.get(sid)
        if stream is None:
            return  # a stream closed meanwhile
        if inc == 0:
            self._reset(stream, PROTOCOL_ERROR)
            return
        stream.send_window += inc
        if stream.send_window > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        self._flush_stream(stream)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolViolation(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self.recv_unacked += size
        if flags & FLAG_PADDED:
            if not payload or payload[0] >= size:
                raise ProtocolViolation(PROTOCOL_ERROR, "bad DATA padding")
            payload = payload[1 : size - payload[0]]
        stream = self.streams.get(sid)
        if stream is None or stream.ended:
            if sid > self.last_stream:
                raise ProtocolViolation(PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:
                self._reset(stream, STREAM_CLOSED)
            self._idle_frame()
            return
        if not payload and not flags & FLAG_END_STREAM:
            self._idle_frame()
        if payload:
            stream.buf += payload
            self.buffered += len(payload)
            if self.buffered > self.limits.max_buffered:
                raise ProtocolViolation(ENHANCE_YOUR_CALM, "too much request data buffered")
            stream.owed += size
            self._split(stream)
            # Give the stream's window back in halves (fewer frames), at once when a message being
            # received needs more than is left, never while a whole message waits unread.
            if not stream.messages and (stream.owed >= DEFAULT_WINDOW // 2 or len(stream.buf) >= 5):
                self._credit_stream(stream, stream.owed)
                stream.owed = 0
        if flags & FLAG_END_STREAM:
            stream.ended = True
            if stream.buf and not stream.closed:
                self.app_error(stream, 13, "the request ended inside a message")  # INTERNAL
        if stream.messages or stream.ended:
            stream._wake()

    def _split(self, stream: Stream) -> None:
        buf = stream.buf
        while len(buf) >= 5:
            if buf[0] != 0:
                self.app_error(stream, 13, "compressed message without a grpc-encoding")
                return
            n = int.from_bytes(buf[1:5], "big")
            if n > self.limits.max_message:
                self.app_error(
                    stream, 8, f"received message larger than max ({n} vs. {self.limits.max_message})"
                )  # RESOURCE_EXHAUSTED
                return
            if len(buf) < 5 + n:
                return
            stream.messages.append(bytes(buf[5 : 5 + n]))
            del buf[: 5 + n]
            self.buffered -= 5

    def _credit_stream(self, stream: Stream, size: int) -> None:
        if size and not stream.ended and not self.closed:
            self._queue(frame(WINDOW_UPDATE, 0, stream.id, size.to_bytes(4, "big")))

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or not sid % 2:
            raise ProtocolViolation(PROTOCOL_ERROR, "HEADERS on an even or zero stream")
        size = len(payload)
        start = 0
        if flags & FLAG_PADDED:
            if not payload or payload[0] >= size:
                raise ProtocolViolation(PROTOCOL_ERROR, "bad HEADERS padding")
            size -= payload[0]
            start = 1
        if flags & FLAG_PRIORITY:
            start += 5
        if start > size:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "HEADERS too short")
        block = payload[start:size]
        existing = self.streams.get(sid)
        if existing is None and sid <= self.last_stream:
            raise ProtocolViolation(STREAM_CLOSED, "HEADERS on a closed stream")
        end_stream = bool(flags & FLAG_END_STREAM)
        if flags & FLAG_END_HEADERS:
            self._header_block(existing, sid, block, end_stream)
        else:
            self.cont = (existing, sid, bytearray(block), end_stream)
            if len(block) > self.limits.max_header_block:
                raise ProtocolViolation(ENHANCE_YOUR_CALM, "header block too large")

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self.cont is None or self.cont[1] != sid:
            raise ProtocolViolation(PROTOCOL_ERROR, "CONTINUATION outside a header block")
        existing, _, block, end_stream = self.cont
        block += payload
        if len(block) > self.limits.max_header_block:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, "header block too large")
        if not payload and not flags & FLAG_END_HEADERS:
            self._idle_frame()
        if flags & FLAG_END_HEADERS:
            self.cont = None
            self._header_block(existing, sid, bytes(block), end_stream)

    def _header_block(self, existing: Stream | None, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self.decoder.decode(block)  # HPACK state must advance for every block
        if existing is not None:  # trailers from the client: only allowed as the end of the request
            if not end_stream:
                raise ProtocolViolation(PROTOCOL_ERROR, "a second HEADERS without END_STREAM")
            self._data(FLAG_END_STREAM, sid, b"")
            return
        self.last_stream = sid
        if self.going_away:
            self._queue(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        if len(self.streams) >= self.limits.max_streams:
            self._queue(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            self._idle_frame()
            return
        stream = Stream(self, sid, self.peer_initial_window)
        fields: dict[bytes, bytes] = {}
        regular = False
        for name, value in headers:
            if name[:1] == b":":
                if regular or name in fields:
                    self._queue(frame(RST_STREAM, 0, sid, PROTOCOL_ERROR.to_bytes(4, "big")))
                    return
            else:
                regular = True
                if (
                    name.lower() != name
                    or name in CONNECTION_SPECIFIC
                    or (name == b"te" and value != b"trailers")
                ):  # RFC 9113 §8.2.2: malformed
                    self._queue(frame(RST_STREAM, 0, sid, PROTOCOL_ERROR.to_bytes(4, "big")))
                    return
            fields[name] = value
        path = fields.get(b":path", b"")
        if fields.get(b":method") != b"POST" or not path.startswith(b"/") or b":scheme" not in fields:
            self._queue(frame(RST_STREAM, 0, sid, PROTOCOL_ERROR.to_bytes(4, "big")))
            return
        stream.headers = fields
        stream.path = path.decode("ascii", "replace")
        stream.ended = end_stream
        self.streams[sid] = stream
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.app.stream_opened(self, stream)

    # -- sending -------------------------------------------------------------------
    def _queue(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            # Two hops: the calls a frame just started (their first step is already scheduled)
            # add their replies first, and everything leaves in one TLS record and one send.
            self.loop.call_soon(self.loop.call_soon, self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.closed:
            data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
            self.out.clear()
            if self.sslobj is None:
                self.transport.write(data)
                return
            try:
                self.sslobj.write(data)
            except (ssl.SSLError, OSError) as exc:
                log.debug("TLS error to %s: %s", self.peer, exc)
                self.abort()
                return
            self._tls_send()
        else:
            self.out.clear()

    def _header_frame(self, stream: Stream, block: bytes, end: bool) -> None:
        if self.first_block:
            block = TABLE_SIZE_ZERO + block
            self.first_block = False
        # Our blocks are a few hundred bytes at most; split anyway if a peer's frame size is the minimum.
        step = self.peer_max_frame
        if len(block) <= step:
            self._queue(frame(HEADERS, FLAG_END_HEADERS | (FLAG_END_STREAM if end else 0), stream.id, block))
            return
        self._queue(frame(HEADERS, FLAG_END_STREAM if end else 0, stream.id, block[:step]))
        rest = block[step:]
        while rest:
            chunk, rest = rest[:step], rest[step:]
            self._queue(frame(CONTINUATION, 0 if rest else FLAG_END_HEADERS, stream.id, chunk))

    def send_response_headers(self, stream: Stream) -> None:
        if not stream.headers_sent and not stream.closed:
            stream.headers_sent = True
            self._header_frame(stream, RESPONSE_HEADERS, False)

    def send_message(self, stream: Stream, message: bytes) -> None:
        """One gRPC message (the 5-byte prefix added here), split by the peer's frame size and windows."""
        if stream.closed:
            return
        self.send_response_headers(stream)
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        step = self.peer_max_frame
        for i in range(0, len(data), step):
            stream.pending.append((data[i : i + step], False))
        self._flush_stream(stream)

    def send_trailers(self, stream: Stream, block: bytes) -> bool:
        """The call's status (an HPACK block of literals); ends our side, resets a peer still sending.

        True when the trailers left now; False while data before them waits for the peer's window.
        """
        if stream.closed:
            return True
        if not stream.headers_sent:  # trailers-only response
            stream.headers_sent = True
            block = RESPONSE_HEADERS + block
        stream.pending.append((block, True))
        self._flush_stream(stream)
        return stream.closed

    def _flush_stream(self, stream: Stream) -> None:
        while stream.pending and not stream.closed:
            payload, is_trailers = stream.pending[0]
            if is_trailers:
                stream.pending.popleft()
                self._header_frame(stream, payload, True)
                self._finish(stream)
                return
            size = len(payload)
            room = min(stream.send_window, self.send_window)
            if room <= 0:
                return  # resumed by WINDOW_UPDATE
            if size > room:  # a peer with a small window gets what fits now, the rest on its update
                stream.pending[0] = (payload[room:], False)
                payload, size = payload[:room], room
            else:
                stream.pending.popleft()
            stream.send_window -= size
            self.send_window -= size
            self._queue(frame(DATA, 0, stream.id, payload))

    def _flush_pending(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush_stream(stream)

    def _finish(self, stream: Stream) -> None:
        stream.closed = True
        # The control-frame budget renews with each call answered, not each stream opened: a
        # stream opened and reset at once (rapid reset) spends it.
        self.idle_frames = 0
        if not stream.ended:  # RFC 9113 §8.1: a complete response; the rest of the request is unwanted
            self._queue(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
        self._drop(stream)

    def _drop(self, stream: Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if self.streams.pop(stream.id, None) is not None:
            self.buffered -= len(stream.buf) + sum(len(m) for m in stream.messages)
            stream.buf.clear()
            stream.messages.clear()
            self._stream_gone()

    def _stream_gone(self) -> None:
        if not self.streams:
            if self.going_away:
                self.close()
            else:
                self._arm_idle()

    def app_error(self, stream: Stream, code: int, message: str) -> None:
        """End a call from the transport's side (a bad message, its deadline): its status, and its
        handler cancelled. Trailers held back by the peer's window become a reset instead."""
        if stream.closed:
            return
        if self.send_trailers(stream, trailers(code, message)):
            self._peer_reset(stream)
        else:
            self._reset(stream, CANCEL)

    def _reset(self, stream: Stream, code: int) -> None:
        self._queue(frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big")))
        stream.closed = True
        self._drop(stream)
        self._peer_reset(stream)

    def reset_stream(self, stream: Stream, code: int = CANCEL) -> None:
        if not stream.closed:
            self._reset(stream, code)

    def _peer_reset(self, stream: Stream) -> None:
        if stream.reset:
            return
        stream.reset = True
        stream.closed = True  # nothing more may be sent on it (RFC 9113 §5.1)
        stream._wake()
        if stream.on_reset is not None:
            stream.on_reset()

    # -- lifetime ----------------------------------------------------------------------
    def _arm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if not self.closed:
            self.idle_timer = self.loop.call_later(self.limits.idle_s, self._idle)

    def _idle(self) -> None:
        self.idle_timer = None
        if not self.streams:
            self.goaway(NO_ERROR, "idle")

    def goaway(self, code: int, reason: str) -> None:
        """Say GOAWAY and close: at once for an error, after the open calls for NO_ERROR."""
        if self.closed:
            return
        if code != NO_ERROR:
            log.info("HTTP/2 connection from %s closed: %s", self.peer, reason[:200])
        debug = reason.encode()[:64] if code != NO_ERROR else b""
        self._queue(
            frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)
        )
        self.going_away = True
        if code != NO_ERROR or not self.streams:
            self.close()

    def close(self) -> None:
        """Send what is queued and TLS close_notify, then close (no wait for the peer's)."""
        if self.closed or self.transport is None:
            return
        self._flush()
        self.closed = True
        if self.sslobj is not None and not self.handshaking:
            with contextlib.suppress(ssl.SSLError, OSError):
                self.sslobj.unwrap()
            self._tls_send()
        if self.transport.can_write_eof():
            # Lingering close: the peer's unread bytes would make the kernel answer with a reset
            # that can destroy the GOAWAY before the peer reads it. Half-close, read and discard
            # until the peer closes, for at most CLOSE_TIMEOUT_S.
            self.transport.write_eof()
        else:  # pragma: no cover - TCP transports can
            self.transport.close()
        # A peer that does not read what is left, or never closes, must not hold the socket.
        self.loop.call_later(CLOSE_TIMEOUT_S, self.abort)

    def eof_received(self) -> bool | None:
        return None  # the peer closed its side: close ours

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None and not self.lost:
            self.transport.abort()
