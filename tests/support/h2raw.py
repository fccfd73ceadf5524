"""A raw HTTP/2 client over TLS for the transport tests: any frame, well-formed or not.

:class:`RawH2` writes frames built byte by byte (so it can send what ``h2`` refuses to: a frame
on the wrong stream, an oversized one, a flood) and reads the server's frames with
``hyperframe``, decoding header blocks with ``hpack`` (the ecosystem's parsers are the oracle,
not server.wire's own). It hands back window credit for every DATA frame it reads, so a large
response can flow, and keeps per stream what it received: header blocks, data, the reset code.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

# Frame types, flags and error codes from the ecosystem's HTTP/2 libraries, not from the server's code.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 §3.4
DATA, HEADERS, PRIORITY, RST_STREAM = (
    DataFrame.type,
    HeadersFrame.type,
    PriorityFrame.type,
    RstStreamFrame.type,
)
SETTINGS, PUSH_PROMISE, PING = SettingsFrame.type, PushPromiseFrame.type, PingFrame.type
GOAWAY, WINDOW_UPDATE, CONTINUATION = GoAwayFrame.type, WindowUpdateFrame.type, ContinuationFrame.type
END_STREAM = ACK = 0x1  # RFC 9113 §6.1 and §6.5 (hyperframe names flags, not their bits)
END_HEADERS = 0x4

NO_ERROR = int(ErrorCodes.NO_ERROR)
PROTOCOL_ERROR = int(ErrorCodes.PROTOCOL_ERROR)
FLOW_CONTROL_ERROR = int(ErrorCodes.FLOW_CONTROL_ERROR)
FRAME_SIZE_ERROR = int(ErrorCodes.FRAME_SIZE_ERROR)
REFUSED_STREAM = int(ErrorCodes.REFUSED_STREAM)
CANCEL = int(ErrorCodes.CANCEL)
ENHANCE_YOUR_CALM = int(ErrorCodes.ENHANCE_YOUR_CALM)

Header = tuple[bytes, bytes]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame, exactly as given (RFC 9113 §4.1): nothing is checked."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def grpc_message(payload: bytes, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message."""
    return bytes((1 if compressed else 0,)) + len(payload).to_bytes(4, "big") + payload


def client_context(bundle: bytes | None, alpn: Sequence[str] | None = ("h2",)) -> ssl.SSLContext:
    """TLS that verifies the chain against ``bundle`` (no host name: the server SVID is a SPIFFE ID)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    if bundle is None:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=bundle.decode("ascii"))
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


def peer_closed(sock: socket.socket, within: float) -> bool:
    """True once the peer has closed ``sock`` (EOF, a reset or a TLS alert), False if it is still open."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except (TimeoutError, ssl.SSLWantReadError):
            return False
        except OSError:  # ConnectionResetError, ssl.SSLError (an alert, an unexpected EOF)
            return True
        if not data:
            return True


@dataclass
class StreamSeen:
    """What arrived on one stream."""

    blocks: list[list[Header]] = field(default_factory=list)  # decoded header blocks, in order
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False  # END_STREAM seen
    reset: int | None = None  # RST_STREAM's error code

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def headers(self) -> dict[bytes, bytes]:
        """The first header block (the response headers, or a trailers-only response)."""
        return dict(self.blocks[0]) if self.blocks else {}

    @property
    def trailers(self) -> dict[bytes, bytes]:
        """The last header block when it ended the stream (a trailers-only response is both)."""
        return dict(self.blocks[-1]) if self.blocks and self.ended else {}

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers."""
        value = self.trailers.get(b"grpc-status")
        return None if value is None else int(value)

    def messages(self) -> list[bytes]:
        """The gRPC messages of the received DATA (asserting their framing is whole)."""
        out: list[bytes] = []
        buf = bytes(self.data)
        while buf:
            assert len(buf) >= 5 and buf[0] == 0, buf[:16]
            n = int.from_bytes(buf[1:5], "big")
            assert len(buf) >= 5 + n, (len(buf), n)
            out.append(buf[5 : 5 + n])
            buf = buf[5 + n :]
        return out


class RawH2:
    """One TLS connection with ALPN h2 to ``host:port``; by default the preface and SETTINGS are sent."""

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        bundle: bytes | None = None,
        preface: bool = True,
        settings: bool = True,
        auto_window: bool = True,
        timeout: float = 10.0,
    ) -> None:
        raw = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock = client_context(bundle).wrap_socket(raw, server_hostname=None)
        except BaseException:
            raw.close()
            raise
        self.authority = f"{host}:{port}"
        self.io_timeout = timeout
        self.auto_window = auto_window
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.frames: list[Frame] = []
        self.streams: dict[int, StreamSeen] = {}
        self.eof = False
        self._block: tuple[int, bytearray, bool] | None = None  # a header block awaiting CONTINUATION
        self._pings = 0
        if preface:
            self.send(PREFACE)
        if settings:
            self.send_frame(SETTINGS, 0, 0)

    # -- sending --------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.sock.settimeout(self.io_timeout)  # reads shorten it; a timed-out TLS write cannot be retried
        self.sock.sendall(data)

    def try_send(self, data: bytes) -> bool:
        """Send unless the server has closed the connection already (a flood's tail may be refused)."""
        try:
            self.send(data)
        except OSError:
            return False
        return True

    def send_frame(self, kind: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        self.send(frame(kind, flags, stream_id, payload))

    def request_headers(
        self,
        path: str | None = "/test.Wire/Echo",
        *,
        method: str = "POST",
        content_type: str | None = "application/grpc",
        extra: Iterable[tuple[str, str]] = (),
    ) -> list[tuple[str, str]]:
        headers = [(":method", method), (":scheme", "https")]
        if path is not None:
            headers.append((":path", path))
        headers.append((":authority", self.authority))
        if content_type is not None:
            headers.append(("content-type", content_type))
        headers.append(("te", "trailers"))
        headers.extend(extra)
        return headers

    def encode(self, headers: Iterable[tuple[str, str]]) -> bytes:
        """A header block from this connection's encoder (its dynamic table grows as HPACK's does)."""
        return self.encoder.encode(list(headers))

    def headers(
        self, stream_id: int, headers: Iterable[tuple[str, str]] | None = None, *, end_stream: bool = False
    ) -> bytes:
        """HEADERS with END_HEADERS for ``stream_id``; returns the header block sent."""
        block = self.encode(self.request_headers() if headers is None else headers)
        self.send_frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block)
        return block

    def message(
        self, stream_id: int, payload: bytes, *, end_stream: bool = True, compressed: bool = False
    ) -> None:
        """One gRPC message in DATA frames of at most 16,384 bytes."""
        data = grpc_message(payload, compressed=compressed)
        chunks = [data[i : i + 16_384] for i in range(0, len(data), 16_384)]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            self.send_frame(DATA, END_STREAM if end_stream and last else 0, stream_id, chunk)

    def call(
        self,
        stream_id: int,
        payload: bytes,
        *,
        path: str = "/test.Wire/Echo",
        extra: Iterable[tuple[str, str]] = (),
    ) -> None:
        """A whole unary request: headers, one message, END_STREAM."""
        self.headers(stream_id, self.request_headers(path, extra=extra))
        self.message(stream_id, payload)

    # -- receiving ------------------------------------------------------------------------
    def _fill(self, timeout: float) -> bool:
        """Read once; False on timeout or EOF."""
        if self.eof:
            return False
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, ssl.SSLWantReadError):
            return False
        except OSError:
            self.eof = True
            return False
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _parse(self) -> list[Frame]:
        out: list[Frame] = []
        while len(self.buf) >= 9:
            parsed, length = Frame.parse_frame_header(memoryview(bytes(self.buf[:9])))
            if len(self.buf) < 9 + length:
                break
            parsed.parse_body(memoryview(bytes(self.buf[9 : 9 + length])))
            del self.buf[: 9 + length]
            self._note(parsed)
            out.append(parsed)
        return out

    def _note(self, f: Frame) -> None:
        self.frames.append(f)
        sid = f.stream_id
        if isinstance(f, HeadersFrame):
            self._block = (sid, bytearray(f.data), "END_STREAM" in f.flags)
        elif isinstance(f, ContinuationFrame) and self._block is not None:
            self._block[1].extend(f.data)
        if isinstance(f, HeadersFrame | ContinuationFrame) and "END_HEADERS" in f.flags and self._block:
            bsid, block, ends = self._block
            self._block = None
            seen = self.streams.setdefault(bsid, StreamSeen())
            seen.blocks.append(
                [(bytes(n), bytes(v)) for n, v in self.decoder.decode(bytes(block), raw=True)]
            )
            seen.ended = seen.ended or ends
        elif isinstance(f, DataFrame):
            seen = self.streams.setdefault(sid, StreamSeen())
            seen.data += f.data
            seen.ended = seen.ended or "END_STREAM" in f.flags
            if self.auto_window and f.flow_controlled_length:
                inc = f.flow_controlled_length.to_bytes(4, "big")
                credit = frame(WINDOW_UPDATE, 0, 0, inc)
                if not seen.ended:
                    credit += frame(WINDOW_UPDATE, 0, sid, inc)
                self.try_send(credit)
        elif isinstance(f, RstStreamFrame):
            self.streams.setdefault(sid, StreamSeen()).reset = f.error_code

    def read_until(self, done: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Read frames until ``done()`` holds (True), or EOF or ``timeout`` (then ``done()``)."""
        deadline = time.monotonic() + timeout
        self._parse()
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                self._parse()
                return done()
            self._parse()
        return True

    def read_for(self, seconds: float) -> None:
        """Read whatever arrives for ``seconds`` (or until EOF)."""
        self.read_until(lambda: self.eof, seconds)

    def first(self, kind: type[Frame], timeout: float = 10.0) -> Frame | None:
        """The first frame of ``kind`` received so far or within ``timeout``."""

        def found() -> Frame | None:
            return next((f for f in self.frames if isinstance(f, kind)), None)

        self.read_until(lambda: found() is not None, timeout)
        return found()

    def goaway(self, timeout: float = 10.0) -> GoAwayFrame | None:
        found = self.first(GoAwayFrame, timeout)
        return found if isinstance(found, GoAwayFrame) else None

    def server_settings(self, timeout: float = 10.0) -> dict[int, int]:
        """The server's first (non-ACK) SETTINGS."""

        def found() -> SettingsFrame | None:
            return next(
                (f for f in self.frames if isinstance(f, SettingsFrame) and "ACK" not in f.flags), None
            )

        self.read_until(lambda: found() is not None, timeout)
        got = found()
        return dict(got.settings) if got is not None else {}

    def ready(self, timeout: float = 10.0) -> dict[int, int]:
        """The server's SETTINGS, once its connection WINDOW_UPDATE has arrived too (the flow-control credit)."""
        settings = self.server_settings(timeout)
        self.read_until(
            lambda: any(isinstance(f, WindowUpdateFrame) and f.stream_id == 0 for f in self.frames), timeout
        )
        return settings

    def sync(self, timeout: float = 10.0) -> bool:
        """Send a PING and read until its ACK: the server has processed every frame sent before it.

        False when the connection ended first.
        """
        self._pings += 1
        payload = (0x5EED_0000_0000_0000 + self._pings).to_bytes(8, "big")
        if not self.try_send(frame(PING, 0, 0, payload)):
            return False

        def acked() -> bool:
            return any(
                isinstance(f, PingFrame) and "ACK" in f.flags and f.opaque_data == payload
                for f in self.frames
            )

        return self.read_until(acked, timeout)

    def closed(self, timeout: float = 10.0) -> bool:
        """True once the server closed the connection (frames received meanwhile are kept)."""
        return self.read_until(lambda: self.eof, timeout)

    def stream(self, stream_id: int, timeout: float = 10.0) -> StreamSeen:
        """What ``stream_id`` received once it ended or was reset (or by EOF or ``timeout``)."""
        self.read_until(lambda: stream_id in self.streams and self.streams[stream_id].done, timeout)
        return self.streams.get(stream_id, StreamSeen())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
