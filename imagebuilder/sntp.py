"""The boot test's NTP server: this host's clock, served on a loopback UDP port (SNTP, RFC 4330 §5).

A node gets its time from the site's NTP servers, which the node-pool release names; the image
enables ``systemd-time-wait-sync`` so that nothing ordered after ``time-sync.target`` (the node agent)
runs on a wrong clock. The boot test VM has no route anywhere, so the boot test gives its guest a
server the way a rack does: this one, on the host's loopback, reached through the guest's relay
(:mod:`imagebuilder.guest.relay`). The guest's own time client (systemd-timesyncd or chrony) must
synchronise with it before ``multi-user.target`` is reached, and the boot test checks that it did.

It answers only well-formed client requests (mode 3, version 1 to 4, at least 48 bytes; anything else
is dropped unread beyond its first 512 bytes) with one 48-byte server reply (mode 4, stratum 1,
reference ``LOCL``, the request's transmit time as the origin, receive and transmit times from this
host's clock). It never sets this host's clock and binds 127.0.0.1 only.

Public API::

    class SntpServer:                 # a context manager
        port: int                     # UDP, on 127.0.0.1
        answered: int                 # replies sent so far
        @classmethod
        def start(cls) -> SntpServer
        def stop() -> None
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from types import TracebackType

log = logging.getLogger(__name__)

NTP_EPOCH = 2208988800  # 1900-01-01 to 1970-01-01, in seconds
PACKET = struct.Struct("!BBbb4s4s4s8s8s8s8s")  # RFC 5905 §7.3 header, 48 bytes
MAX_DATAGRAM = 512
CLIENT, SERVER = 3, 4
STRATUM = 1
PRECISION = -20  # about a microsecond
REFERENCE_ID = b"LOCL"
ROOT_DISPERSION = struct.pack("!HH", 0, 0x0100)  # about 4 ms, in NTP short format


def ntp_timestamp(unix: float) -> bytes:
    """A Unix time as an NTP timestamp (seconds since 1900 and a 32-bit fraction)."""
    seconds = int(unix)
    fraction = int((unix - seconds) * 2**32) & 0xFFFFFFFF
    return struct.pack("!II", (seconds + NTP_EPOCH) & 0xFFFFFFFF, fraction)


def reply(request: bytes, received: float, now: float) -> bytes | None:
    """The server's answer to ``request`` (received at ``received``, sent at ``now``), or None to drop it."""
    if len(request) < PACKET.size:
        return None
    first = request[0]
    version, mode = (first >> 3) & 7, first & 7
    if mode != CLIENT or not 1 <= version <= 4:
        return None
    transmit = request[40:48]  # the client's transmit time becomes our origin time
    return PACKET.pack(
        (0 << 6) | (version << 3) | SERVER,  # leap indicator 0: in sync
        STRATUM,
        6,  # poll: 64 s
        PRECISION,
        b"\0\0\0\0",  # root delay
        ROOT_DISPERSION,
        REFERENCE_ID,
        ntp_timestamp(received - 1.0),  # reference: when our clock was last set (it is the host's own)
        transmit,
        ntp_timestamp(received),
        ntp_timestamp(now),
    )


class SntpServer:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self.answered = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sntp", daemon=True)

    @classmethod
    def start(cls) -> SntpServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(0.5)  # how soon stop() is seen
        server = cls(sock)
        server._thread.start()
        log.debug("boot test NTP server on 127.0.0.1:%d (udp)", server.port)
        return server

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                request, peer = self._sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            received = time.time()
            answer = reply(request, received, time.time())
            if answer is None or peer[0] != "127.0.0.1":
                continue
            self.answered += 1
            with contextlib.suppress(OSError):
                self._sock.sendto(answer, peer)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> SntpServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
