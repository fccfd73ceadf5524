"""A VM's loopback services over its one guest forward: many TCP connections and UDP flows on one stream.

QEMU's ``guestfwd=...-cmd:`` forwards (one relay process per connection) cannot run under libvirt: its
seccomp sandbox (``-sandbox ...,spawn=deny``) kills QEMU when it forks. The one guest forward that works
is a character device: the guest's ``10.0.2.100:8080`` (:data:`imagebuilder.domain.GUEST_FORWARD`) is a
single byte stream to a loopback port of the host, with no connection boundaries. So the guest keeps one
connection to it open and carries every connection over it in frames (type, id, length, payload):

* ``OPEN`` (payload: the port the guest client dialled), ``DATA``, ``EOF``: a TCP connection to
  ``127.0.0.1:<port>`` in the guest becomes one to the host's mapped loopback port;
* ``DGRAM``: a datagram to ``127.0.0.1:<udp port>`` in the guest (the node's time client asking the
  site NTP server); the id is the guest client's source port, the payload the service port (2 bytes)
  and the datagram; the host answers with ``DGRAM`` frames of the same id.

The host half (:func:`host_relay`) dials only the ports it maps; anything else is refused (an ``EOF``
for a connection, nothing for a datagram). Payloads are bounded by the frame's 16-bit length.

In the guest it runs with the image's own ``python3`` (standard library only), started from cloud-init's
``bootcmd`` as a transient unit (:func:`bootcmd`), so the services it carries (the time servers above
all: ``systemd-time-wait-sync`` holds ``time-sync.target`` until the clock is set) are there before
anything waits for them::

    python3 relay.py 10.0.2.100:8080 [--tcp PORT]... [--udp PORT]... [--default-route]

``--default-route``: QEMU's user-mode networking with ``restrict=on`` hands out an address but no router
(libslirp sends no gateway option when restricted), and a time client does not count a link with no
route as online; a rack network has one. The user-mode gateway (10.0.2.2) becomes the default route;
``restrict=on`` still drops every packet that is not for the guest forward, so nothing leaves the host.

Used by the boot test (:mod:`imagebuilder.boottest`: the image's time client against
:mod:`imagebuilder.sntp` on the host) and by ``make demo`` (the agent's servers and the site NTP server).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

OPEN, DATA, EOF, DGRAM = 1, 2, 3, 4
HEADER = struct.Struct(">BIH")
PORT = struct.Struct(">H")
MAX_PAYLOAD = 60000  # under the frame's 16-bit length
GATEWAY = "10.0.2.2"  # QEMU user-mode networking's gateway
UNIT = "nodetrust-relay.service"
GUEST_DIR = "/run/nodetrust-relay"
CONNECT_S = 60.0


class Mux:
    """Many TCP connections and UDP flows over one stream.

    The guest half has neither ``dial`` nor ``dial_udp``; the host half opens the far end of an OPEN with
    ``dial(port)`` and of a new UDP flow with ``dial_udp(port)`` (a connected UDP socket); either raises
    :class:`OSError` for a port it does not map.
    """

    def __init__(
        self,
        stream: socket.socket,
        dial: Callable[[int], socket.socket] | None = None,
        dial_udp: Callable[[int], socket.socket] | None = None,
    ) -> None:
        self.stream = stream
        self.dial = dial
        self.dial_udp = dial_udp
        self.udp: dict[int, socket.socket] = {}  # guest half: service port -> bound socket; host half: flow
        self.conns: dict[int, socket.socket] = {}
        self.lock = threading.Lock()
        self.next_id = 1
        self.closed = threading.Event()

    def send(self, kind: int, conn: int, payload: bytes = b"") -> None:
        with self.lock:
            self.stream.sendall(HEADER.pack(kind, conn, len(payload)) + payload)

    def _recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.stream.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def open(self, local: socket.socket, port: int) -> None:
        """Carry ``local`` (accepted here) to ``port`` on the far side."""
        with self.lock:
            conn, self.next_id = self.next_id, self.next_id + 1
            self.conns[conn] = local
        self.send(OPEN, conn, PORT.pack(port))
        threading.Thread(target=self._pump, args=(conn, local), daemon=True).start()

    def _pump(self, conn: int, local: socket.socket) -> None:
        try:
            while chunk := local.recv(MAX_PAYLOAD):
                self.send(DATA, conn, chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.send(EOF, conn)

    def _udp_replies(self, flow: int, port: int, far: socket.socket) -> None:
        """Host half: the service's answers to one guest flow, back over the stream."""
        with contextlib.suppress(OSError):
            while data := far.recv(MAX_PAYLOAD):
                self.send(DGRAM, flow, PORT.pack(port) + data)

    def _dgram(self, flow: int, payload: bytes) -> None:
        port, data = PORT.unpack(payload[: PORT.size])[0], payload[PORT.size :]
        if self.dial_udp is None:  # guest half: an answer for the client at 127.0.0.1:<flow>
            sock = self.udp.get(port)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendto(data, ("127.0.0.1", flow))
            return
        far = self.udp.get(flow)
        if far is None:
            try:
                far = self.dial_udp(port)
            except OSError:
                return
            self.udp[flow] = far
            threading.Thread(target=self._udp_replies, args=(flow, port, far), daemon=True).start()
        with contextlib.suppress(OSError):
            far.send(data)

    def serve(self) -> None:
        """Read frames until the stream ends."""
        try:
            while True:
                kind, conn, size = HEADER.unpack(self._recv_exact(HEADER.size))
                payload = self._recv_exact(size) if size else b""
                if kind == DGRAM and len(payload) >= PORT.size:
                    self._dgram(conn, payload)
                elif kind == OPEN and self.dial is not None and len(payload) == PORT.size:
                    try:
                        far = self.dial(PORT.unpack(payload)[0])
                    except OSError:
                        self.send(EOF, conn)
                        continue
                    self.conns[conn] = far
                    threading.Thread(target=self._pump, args=(conn, far), daemon=True).start()
                elif kind == DATA and conn in self.conns:
                    with contextlib.suppress(OSError):
                        self.conns[conn].sendall(payload)
                elif kind == EOF and conn in self.conns:
                    with contextlib.suppress(OSError):
                        self.conns[conn].shutdown(socket.SHUT_WR)
        except (EOFError, OSError):
            pass
        finally:
            self.closed.set()


def start_guest_relay(
    forward: str, ports: Sequence[int], udp_ports: Sequence[int] = (), *, connect_s: float = CONNECT_S
) -> Mux:
    """The guest half: listen on 127.0.0.1:<port> for each TCP port and each UDP port, and carry every
    connection and datagram over one connection to ``forward`` (retried for ``connect_s``)."""
    host, _, port = forward.rpartition(":")
    deadline = time.monotonic() + connect_s
    while True:
        try:
            stream = socket.create_connection((host, int(port)), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    stream.settimeout(None)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mux = Mux(stream)
    threading.Thread(target=mux.serve, daemon=True).start()
    for listen_port in ports:
        server = socket.create_server(("127.0.0.1", listen_port))

        def accept(server: socket.socket = server, listen_port: int = listen_port) -> None:
            while True:
                local, _ = server.accept()
                mux.open(local, listen_port)

        threading.Thread(target=accept, daemon=True).start()
    for udp_port in udp_ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", udp_port))
        mux.udp[udp_port] = sock

        def forward_datagrams(sock: socket.socket = sock, udp_port: int = udp_port) -> None:
            while True:
                data, (_, client) = sock.recvfrom(MAX_PAYLOAD)
                mux.send(DGRAM, client, PORT.pack(udp_port) + data)

        threading.Thread(target=forward_datagrams, daemon=True).start()
    return mux


@contextlib.contextmanager
def host_relay(ports: Mapping[int, int], udp_ports: Mapping[int, int] | None = None) -> Iterator[int]:
    """The host half: QEMU connects its character device here; each connection the guest opens to its
    127.0.0.1:<guest port> becomes a loopback connection to ``ports[guest port]``, and each datagram it
    sends to 127.0.0.1:<udp port> one to ``udp_ports[udp port]``; nothing else. Yields the listening port."""
    udp = dict(udp_ports or {})

    def dial(port: int) -> socket.socket:
        if port not in ports:
            raise OSError(f"no forward for port {port}")
        far = socket.create_connection(("127.0.0.1", ports[port]), timeout=30)
        far.settimeout(None)
        return far

    def dial_udp(port: int) -> socket.socket:
        if port not in udp:
            raise OSError(f"no forward for UDP port {port}")
        far = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        far.connect(("127.0.0.1", udp[port]))
        return far

    listener = socket.create_server(("127.0.0.1", 0))
    streams: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                stream, _ = listener.accept()
            except OSError:
                return
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            streams.append(stream)
            threading.Thread(target=Mux(stream, dial, dial_udp).serve, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()
        for stream in streams:
            with contextlib.suppress(OSError):
                stream.close()


def bootcmd(
    forward: str,
    ports: Sequence[int] = (),
    udp_ports: Sequence[int] = (),
    *,
    default_route: bool = False,
    python: str = "/usr/bin/python3",
) -> list[str]:
    """A cloud-init ``bootcmd`` entry that writes this module into the guest's /run and starts it as the
    transient :data:`UNIT` (the guest half, with the image's own Python)."""
    from importlib import resources

    source = resources.files("imagebuilder.guest").joinpath("relay.py").read_bytes()
    argv = [python, f"{GUEST_DIR}/relay.py", forward]
    argv += [a for p in ports for a in ("--tcp", str(int(p)))]
    argv += [a for p in udp_ports for a in ("--udp", str(int(p)))]
    if default_route:
        argv.append("--default-route")
    script = (
        f"mkdir -p {GUEST_DIR} && echo {base64.b64encode(source).decode()} | base64 -d > {GUEST_DIR}/relay.py && "
        f"systemd-run --unit={UNIT} --description='nodetrust: loopback services over the guest forward' "
        f"--no-block --property=Restart=on-failure {' '.join(argv)}"
    )
    return ["sh", "-c", script]


def add_default_route(gateway: str = GATEWAY) -> str:
    """The user-mode gateway as the default route, unless there is one; what was done, in words."""

    def ip(*argv: str) -> tuple[int, str]:
        proc = subprocess.run(
            ["/usr/sbin/ip", *argv], capture_output=True, text=True, check=False, timeout=30
        )
        return proc.returncode, (proc.stdout + proc.stderr).strip()

    _, route = ip("-4", "route", "show", "default")
    if route:
        return f"default route: {route}"
    prefix = gateway.rsplit(".", 1)[0] + "."
    _, addrs = ip("-4", "-o", "addr", "show")
    dev = next((line.split()[1] for line in addrs.splitlines() if f" {prefix}" in line), "")
    if not dev:
        return f"no user-mode address to route through:\n{addrs}"
    rc, out = ip("route", "add", "default", "via", gateway, "dev", dev)
    _, route = ip("-4", "route", "show", "default")
    return f"default route added (rc {rc}{': ' + out if out else ''}): {route}"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="relay.py", description="the guest half of the VM's loopback relay"
    )
    parser.add_argument("forward", help="HOST:PORT of the guest forward (10.0.2.100:8080)")
    parser.add_argument(
        "--tcp", type=int, action="append", default=[], help="a TCP port on 127.0.0.1 (repeat)"
    )
    parser.add_argument(
        "--udp", type=int, action="append", default=[], help="a UDP port on 127.0.0.1 (repeat)"
    )
    parser.add_argument("--default-route", action="store_true", help="route through the user-mode gateway")
    args = parser.parse_args(argv)
    if args.default_route:
        print(add_default_route(), flush=True)
    try:
        mux = start_guest_relay(args.forward, args.tcp, args.udp)
    except OSError as exc:
        print(f"relay: cannot reach the host at {args.forward}: {exc}", file=sys.stderr)
        return 1
    print(f"relay: {args.forward} carries TCP {args.tcp} and UDP {args.udp} of 127.0.0.1", flush=True)
    mux.closed.wait()
    print("relay: the host closed the stream", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
