"""server/wire: TLS and connection lifetime (ALPN, idle, the connection cap, the handshake timeout), stop, bound ports, IPv6."""

from __future__ import annotations

import json
import socket
import time
from contextlib import suppress
from pathlib import Path

import pytest
from google.protobuf import wrappers_pb2

from server.app import server_tls
from server.wire.h2 import Limits
from server.wire.server import WireServer
from tests.server.wire.helpers import (
    CLIENTS,
    HANG,
    LIMITS,
    META,
    SLOW,
    RawFactory,
    WireFactory,
    WireThread,
    bytes_value,
    new_tag,
    run_client,
    running_handlers,
    string_value,
    sv,
)
from tests.support.h2flood import closed_by_peer, silent_connections
from tests.support.h2raw import (
    CANCEL,
    NO_ERROR,
    PREFACE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    client_context,
    frame,
    peer_closed,
)

pytestmark = pytest.mark.timeout(180)


# -- TLS and connection lifetime ---------------------------------------------------------------------
@pytest.mark.parametrize("alpn", [None, ["http/1.1"]], ids=["no-alpn", "http1.1"])
def test_a_tls_client_without_alpn_h2_is_closed(wire: WireThread, alpn: list[str] | None) -> None:
    raw = socket.create_connection((wire.host, wire.port), timeout=10)
    try:
        try:
            sock = client_context(wire.bundle, alpn=alpn).wrap_socket(raw, server_hostname=None)
        except OSError:
            return  # refused in the handshake itself: closed too
        assert sock.selected_alpn_protocol() is None
        with suppress(OSError):
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        assert peer_closed(sock, within=10)
    finally:
        raw.close()


def test_an_idle_connection_gets_goaway_no_error_and_is_closed(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(idle_s=0.3))
    conn = raws(srv)
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert conn.closed()


def test_a_connection_with_a_call_open_is_not_idle(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(idle_s=0.3))
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    conn.read_for(1.0)  # more than three idle periods
    assert conn.goaway(timeout=0) is None and not conn.eof
    conn.send_frame(RST_STREAM, 0, 1, CANCEL.to_bytes(4, "big"))  # the call ends: idle from now
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert srv.seen.wait(f"cancelled:{tag}")


def test_connections_over_max_connections_are_closed_before_the_handshake(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(max_connections=2, handshake_timeout=60.0)
    first, second = raws(srv), raws(srv)
    assert first.ready() and second.ready()
    extra = socket.create_connection((srv.host, srv.port), timeout=10)
    try:
        # handshake_timeout is 60 s: a close now is the cap, not the handshake deadline.
        assert closed_by_peer(extra, within=15)
    finally:
        extra.close()
    first.close()
    for _ in range(100):  # the slot comes back once the server has seen the close
        try:
            third = raws(srv)
        except OSError:
            time.sleep(0.05)
            continue
        if third.ready(timeout=2):
            break
    else:
        pytest.fail("no new connection was accepted after one of the two closed")
    third.call(1, bytes_value(b"in").SerializeToString())
    assert third.stream(1).status == 0


def test_silent_connections_count_against_max_connections(make_wire: WireFactory) -> None:
    srv = make_wire(max_connections=2, handshake_timeout=60.0)
    silent = silent_connections(srv.host, srv.port, 3)
    try:
        assert len(silent) == 3
        assert closed_by_peer(silent[2], within=15)
    finally:
        for s in silent:
            s.close()


def test_a_connection_that_never_says_hello_is_closed_after_handshake_timeout(
    make_wire: WireFactory,
) -> None:
    srv = make_wire(handshake_timeout=0.3)
    silent = socket.create_connection((srv.host, srv.port), timeout=10)
    try:
        assert closed_by_peer(silent, within=15)
    finally:
        silent.close()
    conn = srv.raw()  # and the server still serves
    try:
        conn.call(1, bytes_value(b"x").SerializeToString())
        assert conn.stream(1).status == 0
    finally:
        conn.close()


# == 3. stop, ports, IPv6 ===========================================================================
def test_stop_ends_in_flight_calls_and_closes_connections(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire()
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")

    async def stop() -> tuple[bool, int]:
        await srv.server.stop(0.2)
        # When stop() returns, the calls it ended have ended: nothing runs after the server
        # is gone (ServerApp.stop closes the audit log and the store next).
        return srv.seen.is_set(f"cancelled:{tag}"), running_handlers()

    cancelled, running = srv.call(stop)
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert conn.closed()
    srv.call(srv.server.wait_for_termination, timeout=5)
    with pytest.raises(OSError):
        socket.create_connection((srv.host, srv.port), timeout=5).close()
    assert srv.seen.wait(f"cancelled:{tag}"), "the in-flight handler was never cancelled"
    assert (cancelled, running) == (True, 0), "stop() returned while a handler was still running"


def test_stop_with_grace_lets_calls_finish_and_refuses_new_streams(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire()
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(SLOW))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    stopping = srv.submit(lambda: srv.server.stop(30))
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR and goaway.last_stream_id == 1
    conn.call(3, sv("late"), path=SLOW)
    assert conn.stream(3).reset == REFUSED_STREAM
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert wrappers_pb2.StringValue.FromString(seen.messages()[0]).value == f"done {tag}"
    assert conn.closed()
    stopping.result(10)


def test_add_secure_port_returns_0_for_an_address_it_cannot_bind(
    make_wire: WireFactory, tmp_path: Path
) -> None:
    srv = make_wire()
    tls = server_tls(srv.svid, tmp_path / "data0")
    server = WireServer(limits=LIMITS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        in_use = taken.getsockname()[1]
        assert server.add_secure_port(f"127.0.0.1:{in_use}", tls) == 0
    assert server.add_secure_port("192.0.2.1:0", tls) == 0  # TEST-NET-1: not an address of this host
    assert server.add_secure_port("127.0.0.1:port", tls) == 0
    assert server.add_secure_port("127.0.0.1:70000", tls) == 0
    bound = server.add_secure_port("127.0.0.1:0", tls)
    assert bound > 0
    with socket.create_connection(("127.0.0.1", bound), timeout=5):
        pass  # listening (the kernel's backlog accepts before start())

    async def close() -> None:
        await server.stop(0)

    srv.call(close)


def test_ipv6_loopback(make_wire: WireFactory, tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        has_ipv6 = True
    except OSError:
        has_ipv6 = False
    if not has_ipv6:
        srv = make_wire()
        server = WireServer(limits=LIMITS)
        assert server.add_secure_port("[::1]:0", server_tls(srv.svid, tmp_path / "data0")) == 0
        return
    srv = make_wire(address="[::1]:0")
    assert srv.host == "::1" and srv.port > 0
    for kind in CLIENTS:
        out = run_client(kind, srv, lambda c: c.unary(META, string_value("v6"), wrappers_pb2.StringValue))
        assert out.code == "OK", (kind, out)
        assert json.loads(out.responses[0].value)["peer"].startswith("ipv6:[::1]:"), kind
