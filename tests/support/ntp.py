"""A site NTP server on the host's loopback: Debian's chronyd, serving time and never setting the host's clock.

Public API::

    class NtpServer:                       # a context manager too
        port: int                          # UDP, on 127.0.0.1
        @classmethod
        def start(cls, work: Path, *, ns=None, port=0) -> NtpServer   # ns: inside a network namespace
        def query() -> float               # one SNTP request: the server's transmit time (Unix seconds)
        def stop() -> None

Racks get their time from the site's NTP servers, which the node-pool release names. ``make demo`` and
the VM tier give the node one on the host: chronyd 4.3 from Debian's ``chrony`` package, unpacked into
``.cache/chrony-deb`` and never installed (installing it would replace the host's own time service),
started with ``-x`` (it never adjusts the host's clock) as a ``local stratum 8`` server bound to
127.0.0.1 on a free port, answering 127.0.0.1 only. The boot test's node reaches it through the relay
(``imagebuilder/guest/relay.py``: the guest's UDP 127.0.0.1:123 carried over the one guest forward); a
rack's servers (tests/support/rack.py) reach it on port 123 of the rack's namespace as ``10.0.2.2``.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time
from pathlib import Path
from types import TracebackType

from tests.support.netns import NetNamespace
from tests.support.peers import ROOT, PeerError, log_tail, run, spawn, stop

CACHE = ROOT / ".cache" / "chrony-deb"
NTP_EPOCH = 2208988800  # 1900-01-01 to 1970-01-01


def chronyd() -> Path:
    """Debian's chronyd, unpacked (once) into .cache/chrony-deb; apt downloads the package."""
    binary = CACHE / "root" / "usr" / "sbin" / "chronyd"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    CACHE.chmod(0o777)  # apt-get download runs as _apt where it can
    got = run(["sh", "-c", 'cd "$1" && apt-get download chrony', "sh", CACHE], check=False, timeout=300)
    if got.returncode != 0:
        run(["apt-get", "update"], timeout=600)
        run(["sh", "-c", 'cd "$1" && apt-get download chrony', "sh", CACHE], timeout=300)
    debs = sorted(CACHE.glob("chrony_*.deb"))
    if not debs:
        raise PeerError(f"apt-get download chrony left no chrony_*.deb in {CACHE}")
    tmp = CACHE / "root.tmp"
    run(["rm", "-rf", tmp])
    run(["dpkg-deb", "-x", debs[-1], tmp])
    tmp.rename(CACHE / "root")
    return binary


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sntp_query(
    port: int, host: str = "127.0.0.1", timeout: float = 2.0, sock: socket.socket | None = None
) -> float:
    """One SNTP (RFC 4330) client request; the server's transmit timestamp as Unix seconds.
    ``sock``: the UDP socket to send it from (one of a network namespace), closed afterwards."""
    with sock if sock is not None else socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(b"\x23" + 47 * b"\0", (host, port))  # LI 0, version 4, mode 3 (client)
        data, _ = s.recvfrom(512)
    if len(data) < 48 or data[0] & 7 != 4:
        raise OSError(f"not an NTP server reply: {data[:8].hex()}")
    seconds, fraction = struct.unpack("!II", data[40:48])
    return float(seconds - NTP_EPOCH + fraction / 2**32)


class NtpServer:
    def __init__(self, work: Path, port: int, ns: NetNamespace | None = None) -> None:
        self.work = work
        self.port = port
        self.ns = ns
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, work: Path, *, ns: NetNamespace | None = None, port: int = 0) -> NtpServer:
        """chronyd on 127.0.0.1:``port`` (0: a free one), or inside ``ns`` (a rack's site NTP server)."""
        work.mkdir(parents=True, exist_ok=True)
        server = cls(work, port or _free_udp_port(), ns)
        conf = work / "chrony.conf"
        conf.write_text(
            "# The demo's site NTP server (tests/support/ntp.py): serves, never sets the host clock (-x).\n"
            f"port {server.port}\nbindaddress 127.0.0.1\nallow 127.0.0.1\nlocal stratum 8\ncmdport 0\n"
            f"pidfile {work / 'chronyd.pid'}\n"
        )
        log = work / "chronyd.log"
        server._proc = spawn(
            [chronyd(), "-x", "-d", "-f", conf, "-u", "root"], log_path=log, netns=ns.name if ns else None
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                server.query()
                return server
            except OSError:
                if server._proc.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    raise PeerError(
                        f"chronyd did not answer on 127.0.0.1:{server.port}: {log_tail(log)}"
                    ) from None
                time.sleep(0.2)

    def query(self) -> float:
        if self.ns is not None:
            return sntp_query(self.port, sock=self.ns.socket(socket.AF_INET, socket.SOCK_DGRAM))
        return sntp_query(self.port)

    def stop(self) -> None:
        if self._proc is not None:
            stop(self._proc, grace=10.0)
            self._proc = None

    def __enter__(self) -> NtpServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
