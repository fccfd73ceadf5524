"""A VM's loopback services over its one guest forward (imagebuilder/guest/relay.py) and the boot test's
NTP server (imagebuilder/sntp.py), without a VM: both halves of the relay run here, on loopback."""

from __future__ import annotations

import base64
import os
import re
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imagebuilder import sntp
from imagebuilder.guest import relay
from imagebuilder.sntp import SntpServer
from tests.support.ntp import NTP_EPOCH, NtpServer, chronyd, sntp_query

REPO = Path(__file__).resolve().parents[2]
FLIP = bytes(255 - i for i in range(256))  # the echo server answers each byte inverted


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def echo(conn: socket.socket = conn) -> None:
                while data := conn.recv(65536):
                    conn.sendall(data.translate(FLIP))
                conn.close()

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield int(server.getsockname()[1])
    server.close()


def _free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:

        def write() -> None:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        received = b""
        while data := conn.recv(65536):
            received += data
        writer.join()
    return received


def _parallel(count: int, work: object) -> None:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_the_relay_carries_concurrent_connections_to_the_mapped_port_only(echo_port: int) -> None:
    guest_port, unmapped = _free_port(), _free_port()
    with relay.host_relay({guest_port: echo_port}) as forward:
        relay.start_guest_relay(f"127.0.0.1:{forward}", [guest_port, unmapped])
        results: dict[int, bool] = {}

        def client(i: int) -> None:
            payload = os.urandom(200_000 + i)
            results[i] = _exchange(guest_port, payload) == payload.translate(FLIP)

        _parallel(6, client)
        assert results == dict.fromkeys(range(6), True)
        # a port the host has no forward for: the connection is closed, nothing is dialled
        assert _exchange(unmapped, b"hello") == b""


def test_the_relay_carries_the_nodes_ntp_datagrams_to_the_site_server(tmp_path: Path) -> None:
    """The node's time service reaches the site NTP server (Debian's chronyd on the host) through the relay;
    each client's answers come back to that client; a UDP port the host does not map gets no answer."""
    guest_udp, unmapped = _free_port(socket.SOCK_DGRAM), _free_port(socket.SOCK_DGRAM)
    with NtpServer.start(tmp_path / "ntp") as ntp, relay.host_relay({}, {guest_udp: ntp.port}) as forward:
        relay.start_guest_relay(f"127.0.0.1:{forward}", [], [guest_udp, unmapped])
        answers: dict[int, float] = {}

        def client(i: int) -> None:
            answers[i] = sntp_query(guest_udp, timeout=30)

        _parallel(3, client)
        direct = ntp.query()
        with pytest.raises(TimeoutError):
            sntp_query(unmapped, timeout=1)
    assert sorted(answers) == [0, 1, 2]
    assert all(abs(answer - direct) < 60 for answer in answers.values()), (answers, direct)


def test_the_relay_gives_up_when_the_host_never_answers() -> None:
    closed = _free_port()
    started = time.monotonic()
    with pytest.raises(OSError):
        relay.start_guest_relay(f"127.0.0.1:{closed}", [], [], connect_s=0)
    assert time.monotonic() - started < 30  # one try, not the minute a VM's relay waits


def test_the_bootcmd_writes_this_module_and_starts_it_as_a_transient_unit() -> None:
    entry = relay.bootcmd("10.0.2.100:8080", [8081, 8082], [123], default_route=True)
    assert entry[:2] == ["sh", "-c"]
    script = entry[2]
    encoded = re.search(r"echo ([A-Za-z0-9+/=]+) \| base64 -d > /run/nodetrust-relay/relay.py", script)
    assert encoded is not None, script
    assert base64.b64decode(encoded.group(1)) == (REPO / "imagebuilder/guest/relay.py").read_bytes()
    assert script.endswith(
        "/usr/bin/python3 /run/nodetrust-relay/relay.py 10.0.2.100:8080 --tcp 8081 --tcp 8082 --udp 123 --default-route"
    )
    assert "systemd-run --unit=nodetrust-relay.service" in script and "--no-block" in script
    # the guest half's command line is the one main() parses
    help_text = subprocess.run(["python3", str(REPO / "imagebuilder/guest/relay.py"), "--help"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--tcp" in help_text and "--udp" in help_text and "--default-route" in help_text


# -- the boot test's NTP server ----------------------------------------------------------------------


def test_the_ntp_server_answers_with_this_hosts_clock() -> None:
    with SntpServer.start() as server:
        before = time.time()
        answer = sntp_query(server.port)
        after = time.time()
        assert before - 0.01 <= answer <= after + 0.01
        assert server.answered == 1


def test_the_ntp_server_reply_follows_rfc_5905() -> None:
    request = bytes([0x23]) + bytes(39) + b"\x01\x02\x03\x04\x05\x06\x07\x08"
    answer = sntp.reply(request, 1_800_000_000.25, 1_800_000_000.5)
    assert answer is not None and len(answer) == 48
    first, stratum, _poll, _precision = struct.unpack("!BBbb", answer[:4])
    assert (first >> 6, (first >> 3) & 7, first & 7) == (0, 4, 4)  # in sync, version 4, server
    assert 1 <= stratum < 16 and answer[12:16] == b"LOCL"
    assert answer[24:32] == request[40:48]  # the origin is the client's transmit time
    receive = struct.unpack("!II", answer[32:40])
    transmit = struct.unpack("!II", answer[40:48])
    assert receive == (1_800_000_000 + NTP_EPOCH, 2**30) and transmit == (1_800_000_000 + NTP_EPOCH, 2**31)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"",
        bytes([0x23]) + bytes(46),  # 47 bytes: too short
        bytes([0x24]) + bytes(47),  # mode 4: a server's packet
        bytes([0x26]) + bytes(47),  # mode 6: a control message (ntpq)
        bytes([0x03]) + bytes(47),  # version 0
        bytes([0x2B]) + bytes(47),  # version 5
    ],
)
def test_the_ntp_server_drops_what_is_not_a_client_request(request_bytes: bytes) -> None:
    assert sntp.reply(request_bytes, time.time(), time.time()) is None
    with SntpServer.start() as server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        s.sendto(request_bytes or b"\0", ("127.0.0.1", server.port))
        with pytest.raises(TimeoutError):
            s.recvfrom(512)
        assert sntp_query(server.port) > 0  # and still serves
        assert server.answered == 1


def test_chronyd_as_a_client_accepts_the_ntp_server(tmp_path: Path) -> None:
    """The ecosystem's own oracle: chronyd (Debian's, never installed) takes samples from the server and
    reports a small offset, without setting this host's clock (-Q)."""
    with SntpServer.start() as server:
        directive = f"server 127.0.0.1 port {server.port} iburst maxsamples 4"
        argv = [str(chronyd()), "-Q", "-u", "root", "-f", "/dev/null", "-t", "30", directive]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    said = result.stdout + result.stderr
    offset = re.search(r"System clock wrong by (-?[0-9.]+) seconds", said)
    assert result.returncode == 0 and offset is not None, said
    assert abs(float(offset.group(1))) < 1.0, said
