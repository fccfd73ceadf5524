"""A real HTTP server on the loopback for the imager's tests, with faults on demand.

It serves a folder (with ``Range`` support, as release servers have), records every request, takes
POSTed events at ``/events``, and can misbehave per path: flip a byte, cut the body short, send more
than it announced, announce a larger ``Content-Length``, redirect, or answer with a status.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Fault:
    flip: int | None = None  # flip the byte at this offset of the file
    truncate: int | None = None  # send only this many bytes (announcing the full length), then close
    extra: int = 0  # send this many bytes more than the file (announcing the file's length)
    length: int | None = None  # announce this Content-Length
    no_length: bool = False  # announce no Content-Length: the body ends when the connection closes
    redirect: str = ""  # answer 302 to this location
    status: int = 0  # answer with this status
    times: int = -1  # how many requests the fault applies to (-1: all)
    stall: float = 0.0  # after the bytes sent (see truncate), keep the connection open and silent this long


@dataclass
class Recorder:
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, range)
    events: list[dict[str, Any]] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        self.server.recorder.requests.append(("POST", self.path, ""))
        if self.path == "/events":
            self.server.recorder.events.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:
        rng = self.headers.get("Range", "")
        self.server.recorder.requests.append(("GET", self.path, rng))
        fault = self.server.faults.get(self.path)
        if fault is not None and fault.times != 0:
            fault.times -= 1 if fault.times > 0 else 0
        else:
            fault = None
        if fault is not None and fault.status:
            self.send_response(fault.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault is not None and fault.redirect:
            self.send_response(302)
            self.send_header("Location", fault.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = path.stat().st_size
        start = 0
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        else:
            self.send_response(200)
        announced = size - start
        if fault is not None and fault.length is not None:
            announced = fault.length
        if fault is None or not fault.no_length:
            self.send_header("Content-Length", str(announced))
        self.end_headers()
        limit = size - start
        if fault is not None and fault.truncate is not None:
            limit = max(0, min(limit, fault.truncate - start))
        with path.open("rb") as fh:
            fh.seek(start)
            offset = start
            while limit > 0:
                chunk = bytearray(fh.read(min(1 << 20, limit)))
                if not chunk:
                    break
                if (
                    fault is not None
                    and fault.flip is not None
                    and offset <= fault.flip < offset + len(chunk)
                ):
                    chunk[fault.flip - offset] ^= 0x01
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                offset += len(chunk)
                limit -= len(chunk)
            if fault is not None and fault.extra:
                try:
                    self.wfile.write(b"\0" * fault.extra)
                except (BrokenPipeError, ConnectionResetError):
                    return
        if fault is not None and fault.stall:
            self.wfile.flush()
            time.sleep(fault.stall)
        if fault is not None and fault.truncate is not None:
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, sock: socket.socket | None = None) -> None:
        if sock is None:
            super().__init__(("127.0.0.1", 0), _Handler)
        else:  # a socket bound elsewhere (in a rack's network namespace, tests/support/rack.py)
            super().__init__(sock.getsockname(), _Handler, bind_and_activate=False)
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_activate()
        self.root = root
        self.faults: dict[str, Fault] = {}
        self.recorder = Recorder()


def tls_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the CA a test trusts) and its key, as PEM files."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "release server (test)")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


class ReleaseServer:
    """``with ReleaseServer(folder_parent) as srv: srv.url + '/<folder>/'``; HTTPS with ``tls``; ``sock``: a
    bound socket to serve on (one of a network namespace) instead of a free loopback port."""

    def __init__(
        self, root: Path, *, tls: tuple[Path, Path] | None = None, sock: socket.socket | None = None
    ) -> None:
        self._server = _Server(root, sock)
        self.scheme = "http"
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        port = self._server.server_address[1]
        return f"{self.scheme}://127.0.0.1:{port}"

    @property
    def faults(self) -> dict[str, Fault]:
        return self._server.faults

    @property
    def recorder(self) -> Recorder:
        return self._server.recorder

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ReleaseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
