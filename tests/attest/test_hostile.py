"""What a stranger can do to the attestation port before proving anything (issue 11's floods).

Each test reproduces one attack against a real nodeserver and asserts both that the attacker is
refused in a bounded, audited way and that an honest agent attests meanwhile.
"""

from __future__ import annotations

import json
import resource
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.svid import make_csr, new_key
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol.tpm_payload import decode_challenge, encode_attestation_data, encode_challenge_response
from tests.support.h2flood import StreamFlood, closed_by_peer, silent_connections
from tests.support.rawclient import RpcFailed, params, run_stream
from tests.support.server import ServerThread, server_config
from tests.support.serverproc import ServerProcess
from tests.support.simtpm import SimCa, SimulatedTpm

ATTEST = "/spire.api.server.agent.v1.Agent/AttestAgent"


def _ca_dir(base: Path, ca: SimCa) -> Path:
    (base / "ca").mkdir(parents=True, exist_ok=True)
    (base / "ca" / "sim.pem").write_bytes(ca.pem())
    return base / "ca"


def _honest(address: str, bundle: bytes, sim: SimulatedTpm) -> Any:
    async def script(stream: Any) -> Any:
        await stream.send_message(
            params(encode_attestation_data(sim.attestation_data()), make_csr(new_key()))
        )
        challenge = await stream.recv_message()
        secret = sim.activate(decode_challenge(challenge.challenge))
        await stream.send_message(
            agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
        )
        return await stream.recv_message()

    return run_stream(address, bundle, script)


def _attempt(address: str, bundle: bytes, script: Any) -> Any:
    try:
        return run_stream(address, bundle, script)
    except RpcFailed as failed:
        return failed


@pytest.fixture
def ca() -> SimCa:
    return SimCa.create()


def _server(base: Path, ca: SimCa, **overrides: Any) -> ServerThread:
    cfg = server_config(base / "server", ek_trust={"ca_dir": str(_ca_dir(base, ca))}, **overrides)
    return ServerThread(cfg).start()


@pytest.fixture
def srv(tmp_path: Path, ca: SimCa) -> Iterator[ServerThread]:
    s = _server(tmp_path, ca, first_message_timeout="2s")
    yield s
    s.stop()


def _wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_one_connection_cannot_hold_more_streams_than_its_share(srv: ServerThread, ca: SimCa) -> None:
    """4,200 header-only streams on one connection once held every RPC slot for the challenge timeout."""
    flood = StreamFlood("127.0.0.1", srv.app.ports.attest)
    try:
        flood.open_streams(400, ATTEST)
        result = flood.read_for(1.0)
        assert result.max_concurrent_streams == srv.config.max_streams_per_connection == 16
        # An honest agent attests while the flood holds its streams.
        ok = _honest(srv.address, srv.bundle, SimulatedTpm.create(ca))
        assert ok.WhichOneof("step") == "result"
        result = flood.read_for(4.0)  # past first_message_timeout (2 s)
    finally:
        flood.close()
    # The server never ran more than 16 of the 400 at once: the rest were refused or reset by
    # HTTP/2, and the ones it accepted ended on the first-message deadline.
    timed_out = {s for s, code in result.ended.items() if code == "4"}  # DEADLINE_EXCEEDED
    assert 0 < len(timed_out) <= 16, result
    lines = [a for a in srv.audit_lines() if a["reason"] == "params_timeout"]
    assert len(lines) == len(timed_out)


def test_requests_in_flight_per_address_are_capped(tmp_path: Path, ca: SimCa) -> None:
    srv = _server(tmp_path, ca, first_message_timeout="2s", peer_max_inflight=3)
    floods = [StreamFlood("127.0.0.1", srv.app.ports.attest) for _ in range(2)]
    try:
        for f in floods:
            f.open_streams(2, ATTEST)  # 4 streams from one address, 2 per connection
        results = [f.read_for(1.5) for f in floods]
        refused = [s for r in results for s, code in r.ended.items() if code == "8"]  # RESOURCE_EXHAUSTED
        assert len(refused) == 1, results
        lines = [a for a in srv.audit_lines() if a["reason"] == "peer_limit"]
        assert len(lines) == 1 and lines[0]["status"] == "RESOURCE_EXHAUSTED"
    finally:
        for f in floods:
            f.close()
        srv.stop()


def test_attestations_per_address_are_rate_limited(tmp_path: Path, ca: SimCa) -> None:
    srv = _server(tmp_path, ca, attest_rate_per_ip=0.01, attest_burst_per_ip=2)
    try:
        for _ in range(2):
            _honest(srv.address, srv.bundle, SimulatedTpm.create(ca))
        with pytest.raises(RpcFailed) as refused:
            _honest(srv.address, srv.bundle, SimulatedTpm.create(ca))
        assert refused.value.status == "RESOURCE_EXHAUSTED" and refused.value.reason == "rate_limited"
        assert refused.value.detail is not None and (refused.value.detail.retry_after_s or 0) > 1
        assert srv.audit_lines()[-1]["reason"] == "rate_limited"
    finally:
        srv.stop()


def test_silent_connections_do_not_exhaust_the_file_limit(tmp_path: Path, ca: SimCa) -> None:
    """1,050 silent TCP connections once exhausted a 1,024 file limit and locked every agent out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.fail(f"this test needs an open-file hard limit of at least 4096 (it is {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # for the test's own sockets
    config = {
        "trust_domain": "example.org",
        "data_dir": str(tmp_path / "data"),
        "listen": "127.0.0.1:0",
        "metrics_listen": None,
        "handshake_timeout": "2s",
        "ek_trust": {"ca_dir": str(_ca_dir(tmp_path, ca))},
    }
    # The server starts with the soft limit of 1,024 that many distributions set.
    server = ServerProcess(config, tmp_path / "server.json", nofile=1024, log=tmp_path / "server.log")
    socks = []
    try:
        socks = silent_connections("127.0.0.1", server.attest_port, 1100)
        assert len(socks) == 1100
        ok = _honest(server.attest, server.bundle, SimulatedTpm.create(ca))
        assert ok.WhichOneof("step") == "result"
        # A connection that never starts TLS is closed after handshake_timeout.
        assert closed_by_peer(socks[0], within=30)
    finally:
        for s in socks:
            s.close()
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_huge_unauthenticated_field_writes_a_bounded_audit_line(srv: ServerThread, ca: SimCa) -> None:
    """A 900 KB attestor type once wrote 2.7 MB of audit and log: a few such requests filled the disk."""
    sim = SimulatedTpm.create(ca)
    before = srv.config.audit_path.stat().st_size if srv.config.audit_path.exists() else 0
    huge = "x" * 900_000

    async def script(stream: Any) -> Any:
        await stream.send_message(
            params(encode_attestation_data(sim.attestation_data()), make_csr(new_key()), attestor=huge),
            end=True,
        )
        return await stream.recv_message()

    outcome = _attempt(srv.address, srv.bundle, script)
    assert isinstance(outcome, RpcFailed) and outcome.reason == "unknown_attestor", outcome
    assert len(outcome.message) < 2048
    grown = srv.config.audit_path.stat().st_size - before
    assert 0 < grown < 4096, grown
    line = srv.audit_lines()[-1]
    assert line["reason"] == "unknown_attestor" and len(line["attestor"]) <= 64


def test_an_oversized_message_is_refused_with_an_audit_line(srv: ServerThread, ca: SimCa) -> None:
    sim = SimulatedTpm.create(ca)

    async def script(stream: Any) -> Any:
        await stream.send_message(
            params(b"{" + b" " * (2 * 1024 * 1024) + b"}", make_csr(new_key())), end=True
        )
        return await stream.recv_message()

    outcome = _attempt(srv.address, srv.bundle, script)
    assert isinstance(outcome, RpcFailed) and outcome.status == "RESOURCE_EXHAUSTED", outcome
    assert outcome.reason == "message_too_large"
    assert srv.audit_lines()[-1]["reason"] == "message_too_large"
    assert _honest(srv.address, srv.bundle, sim).WhichOneof("step") == "result"


def test_garbage_protobuf_is_invalid_argument_with_an_audit_line(srv: ServerThread) -> None:
    flood = StreamFlood("127.0.0.1", srv.app.ports.attest)
    try:
        flood.open_streams(1, ATTEST)
        flood.send_message(1, b"\xff\xff\xff\xff\x0f garbage")
        result = flood.read_for(2.0)
    finally:
        flood.close()
    assert result.ended.get(1) == "3", result  # INVALID_ARGUMENT, not INTERNAL
    line = srv.audit_lines()[-1]
    assert line["reason"] == "malformed_message" and line["status"] == "INVALID_ARGUMENT"


def test_a_full_disk_refuses_work_instead_of_filling_it(tmp_path: Path, ca: SimCa) -> None:
    """With less free space than min_free_bytes nothing is attested, and /ready says why."""
    srv = _server(tmp_path, ca, min_free_bytes=1 << 40)  # 1 TiB: more than this disk has free
    try:
        with pytest.raises(RpcFailed) as refused:
            _honest(srv.address, srv.bundle, SimulatedTpm.create(ca))
        assert refused.value.status == "UNAVAILABLE" and refused.value.reason == "audit_unavailable"
        assert str(tmp_path) not in refused.value.message
        assert srv.app.store is not None and srv.app.store.list_agents() == []
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.app.ports.metrics}/ready", timeout=10)
        assert not_ready.value.code == 503
    finally:
        srv.stop()


def test_live_and_ready_beside_metrics(srv: ServerThread) -> None:
    base = f"http://127.0.0.1:{srv.app.ports.metrics}"
    for path, expect in (("/live", b"live"), ("/ready", b"ready"), ("/metrics", b"nodeserver_requests")):
        with urllib.request.urlopen(base + path, timeout=10) as answer:  # noqa: S310 - loopback
            assert answer.status == 200 and expect in answer.read()


def test_renew_agent_tells_a_spire_agent_to_reattest(srv: ServerThread) -> None:
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    from agent.refusals import DetailsCodec
    from agent.tls import SpiffeTLSContext
    from protocol.spiffe import server_id

    async def renew() -> GRPCError:
        tls = SpiffeTLSContext(srv.bundle, [server_id("example.org")])
        ch = Channel("127.0.0.1", srv.app.ports.attest, ssl=tls, status_details_codec=DetailsCodec())
        try:
            async with ch.request(
                "/spire.api.server.agent.v1.Agent/RenewAgent",
                Cardinality.UNARY_UNARY,
                agent_pb2.RenewAgentRequest,
                agent_pb2.RenewAgentResponse,
                timeout=10,
            ) as stream:
                await stream.send_message(agent_pb2.RenewAgentRequest(), end=True)
                await stream.recv_message()
        except GRPCError as exc:
            return exc
        finally:
            ch.close()
        raise AssertionError("RenewAgent succeeded")

    import asyncio

    exc = asyncio.run(renew())
    assert exc.status.name == "PERMISSION_DENIED"
    assert exc.details.spire_reason == "AGENT_MUST_REATTEST" and exc.details.reason.slug == "must_reattest"


def test_an_untrusted_ek_is_told_no_server_path(tmp_path: Path) -> None:
    (tmp_path / "hashes").mkdir()
    cfg = server_config(tmp_path / "server", ek_trust={"hash_dir": str(tmp_path / "hashes")})
    srv = ServerThread(cfg).start()
    try:
        with pytest.raises(RpcFailed) as refused:
            _honest(srv.address, srv.bundle, SimulatedTpm.create(None))
        assert refused.value.status == "PERMISSION_DENIED" and refused.value.reason == "ek_hash_not_listed"
        assert str(tmp_path) not in refused.value.message and "hashes" not in refused.value.message
        assert refused.value.message.startswith("tpm: could not validate EK")
        # The operator still sees where to look: the audit line carries the full reason.
        assert str(tmp_path / "hashes") in json.dumps(srv.audit_lines()[-1])
    finally:
        srv.stop()


def test_a_store_write_and_its_audit_line_agree_when_the_client_cancels(
    srv: ServerThread, ca: SimCa
) -> None:
    """An attestation cancelled after its challenge response was once stored while audited as cancelled."""
    store = srv.app.store
    assert store is not None
    real = store.record_attestations  # the group commit's write (server/commit.py)

    def slow(batch: Any) -> Any:
        time.sleep(0.5)
        return real(batch)

    store.record_attestations = slow  # type: ignore[method-assign]
    sim = SimulatedTpm.create(ca)
    before = len(srv.audit_lines())

    async def script(stream: Any) -> Any:
        import asyncio

        await stream.send_message(
            params(encode_attestation_data(sim.attestation_data()), make_csr(new_key()))
        )
        challenge = await stream.recv_message()
        secret = sim.activate(decode_challenge(challenge.challenge))
        await stream.send_message(
            agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret))
        )
        await asyncio.sleep(0.1)  # the server is inside the store write now
        await stream.cancel()

    try:
        _attempt(srv.address, srv.bundle, script)
        assert _wait_for(lambda: len(srv.audit_lines()) > before)
        time.sleep(1.0)  # let the write finish
    finally:
        store.record_attestations = real  # type: ignore[method-assign]
    lines = srv.audit_lines()[before:]
    assert len(lines) == 1, lines
    stored = store.get_agent(f"spiffe://example.org/spire/agent/tpm/{sim.ek_hash}") is not None
    assert stored == (lines[0]["result"] == "ok"), (stored, lines[0])
