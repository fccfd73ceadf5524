"""Raw HTTP/2 over TLS for flood tests: streams and connections a real client would never open.

``StreamFlood`` opens one connection and sends HEADERS for many gRPC streams without any
DATA (the "header-only streams" attack), then reports what the server said: its
SETTINGS_MAX_CONCURRENT_STREAMS and the streams it refused. ``silent_connections`` opens TCP
connections that never start TLS.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings


@dataclass
class FloodResult:
    max_concurrent_streams: int | None = None
    refused: set[int] = field(default_factory=set)
    reset: set[int] = field(default_factory=set)
    ended: dict[int, str] = field(default_factory=dict)  # stream -> grpc-status
    sent: int = 0


class StreamFlood:
    def __init__(self, host: str, port: int) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the test only floods; it trusts nothing it reads
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection((host, port), timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname=host)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.authority = f"{host}:{port}"
        self.result = FloodResult()

    def open_streams(self, count: int, path: str) -> None:
        """HEADERS only, for ``count`` streams; the client ignores the server's stream limit on purpose."""
        self.conn.local_settings.acknowledge()
        for _ in range(count):
            stream_id = self.conn.get_next_available_stream_id()
            # h2 refuses to exceed the peer's limit; an attacker's client does not: bypass it.
            self.conn._open_streams = lambda *a, **k: 0  # type: ignore[method-assign]
            self.conn.send_headers(
                stream_id,
                [
                    (":method", "POST"),
                    (":scheme", "https"),
                    (":path", path),
                    (":authority", self.authority),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ],
            )
            self.result.sent += 1
        self.sock.sendall(self.conn.data_to_send())

    def send_message(self, stream_id: int, payload: bytes, *, end: bool = True) -> None:
        """One gRPC length-prefixed message of raw bytes (garbage, if the test says so)."""
        frame = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self.conn.send_data(stream_id, frame, end_stream=end)
        self.sock.sendall(self.conn.data_to_send())

    def read_for(self, seconds: float) -> FloodResult:
        deadline = time.monotonic() + seconds
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError):
                continue
            except (ConnectionError, ssl.SSLError, OSError):
                break
            if not data:
                break
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                    if changed is not None:
                        self.result.max_concurrent_streams = changed.new_value
                elif isinstance(event, h2.events.StreamReset):
                    if event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                        self.result.refused.add(event.stream_id)
                    else:
                        self.result.reset.add(event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    for name, value in event.headers:
                        key = name.decode() if isinstance(name, bytes) else name
                        if key == "grpc-status":
                            self.result.ended[event.stream_id] = (
                                value.decode() if isinstance(value, bytes) else value
                            )
            with contextlib.suppress(OSError):
                self.sock.sendall(self.conn.data_to_send())
        return self.result

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def silent_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections that never send a byte (stop early if the kernel refuses)."""
    out: list[socket.socket] = []
    for _ in range(count):
        try:
            out.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            break
    return out


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """True once the server has closed ``sock`` (it reads EOF or a reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
