"""The join broker's credentials do not outlive their purpose, and one agent cannot flood it (issue 11)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol._gen.nodetrust.join.v1 import join_pb2
from server.store import TokenRecord
from tests.support.joinenv import JoinEnv, SimAgent, attest_sim, cpu_report, join, start_join_env
from tests.support.joinrpc import Refused, join_call
from tests.support.simtpm import SimulatedTpm


@pytest.fixture
def env(tmp_path: Path) -> Iterator[JoinEnv]:
    e = start_join_env(tmp_path, join={"token_ttl": "15m", "joins_per_agent": 3})
    yield e
    e.srv.stop()


@pytest.fixture
def agent(env: JoinEnv, tmp_path: Path) -> SimAgent:
    return attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "agent")


def _request(node_name: str = "node-1", **fields: Any) -> join_pb2.JoinRequest:
    doc: dict[str, Any] = {
        "pool": "cpu",
        "node_name": node_name,
        "report": cpu_report(),
        "request_id": secrets.token_hex(16),
        "requested_at": int(time.time()),
    }
    doc.update(fields)
    return join_pb2.JoinRequest(**doc)


def _joined(env: JoinEnv, agent: SimAgent, token_id: str, node_name: str | None = None) -> bool:
    name = node_name or agent.node_name
    reply = join_call(env, agent, "ReportJoined", join_pb2.JoinedRequest(token_id=token_id, node_name=name),
                   join_pb2.JoinedResponse)  # fmt: skip
    return bool(reply.revoked)


def _files(env: JoinEnv) -> set[str]:
    return (
        {p.name for p in env.tokens_dir.glob("bootstrap-token-*.yaml")} if env.tokens_dir.exists() else set()
    )


def test_a_used_token_is_revoked_once_the_node_reports_it_joined(env: JoinEnv, agent: SimAgent) -> None:
    """The "one-time" token once stayed valid for its whole TTL after kubeadm join."""
    grant = join(env, agent)
    token_id = grant.token.split(".")[0]
    assert f"bootstrap-token-{token_id}.yaml" in _files(env)
    assert _joined(env, agent, token_id) is True
    assert f"bootstrap-token-{token_id}.yaml" not in _files(env)
    store = env.srv.app.store
    assert store is not None and store.live_token(agent.spiffe_id, int(time.time())) is None
    line = env.srv.audit_lines()[-1]
    assert line["event"] == "joined" and line["reason"] == "token_revoked" and line["token_id"] == token_id
    # Reporting again is harmless (the agent retries a report it did not see answered).
    assert _joined(env, agent, token_id) is False
    # And the reuse window never hands out a revoked token.
    assert join(env, agent).token != grant.token


def test_a_report_for_another_node_name_revokes_nothing(env: JoinEnv, agent: SimAgent) -> None:
    grant = join(env, agent)
    token_id = grant.token.split(".")[0]
    with pytest.raises(Refused) as refused:
        _joined(env, agent, token_id, node_name="node-2")
    assert refused.value.status == "INVALID_ARGUMENT" and refused.value.reason == "unknown_token"
    assert f"bootstrap-token-{token_id}.yaml" in _files(env)
    # Another agent cannot revoke this agent's token: it only ever reaches its own.
    other = attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), env.base / "other")
    assert _joined(env, other, token_id) is False
    assert f"bootstrap-token-{token_id}.yaml" in _files(env)


def test_joins_per_agent_are_limited(env: JoinEnv, agent: SimAgent) -> None:
    """One attested machine once added about 10 GB a day of store rows and audit lines."""
    for n in range(3):
        join(env, agent, node_name=f"node-{n}")  # distinct names: no reuse
    with pytest.raises(Refused) as refused:
        join_call(env, agent, "RequestJoin", _request("node-9"), join_pb2.JoinResponse)
    assert refused.value.status == "RESOURCE_EXHAUSTED" and refused.value.reason == "join_rate_limited"
    assert refused.value.detail is not None and (refused.value.detail.retry_after_s or 0) > 0
    store = env.srv.app.store
    assert store is not None and len(store.joins_for(agent.spiffe_id)) == 3


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"node_name": "node-b\n"}, "bad_node_name"),
        ({"request_id": secrets.token_hex(16) + "\n"}, "bad_request_id"),
    ],
    ids=["node name with a trailing newline", "request id with a trailing newline"],
)
def test_trailing_newlines_are_refused(
    env: JoinEnv, agent: SimAgent, fields: dict[str, Any], reason: str
) -> None:
    """`^...$` once accepted "node-b\\n" (it got a token) and a replayed id plus "\\n"."""
    with pytest.raises(Refused) as refused:
        join_call(env, agent, "RequestJoin", _request(**fields), join_pb2.JoinResponse)
    assert refused.value.status == "INVALID_ARGUMENT" and refused.value.reason == reason
    assert _files(env) == set()


def test_garbage_join_request_is_invalid_argument_with_an_audit_line(env: JoinEnv, agent: SimAgent) -> None:
    # A JSON report with an integer of 5,000 digits once escaped as INTERNAL with exception text.
    with pytest.raises(Refused) as refused:
        join_call(
            env,
            agent,
            "RequestJoin",
            _request(report=b'{"schema":' + b"9" * 5000 + b"}"),
            join_pb2.JoinResponse,
        )
    assert refused.value.status == "INVALID_ARGUMENT" and refused.value.reason == "bad_report"
    assert "Exceeds the limit" not in refused.value.message
    assert env.srv.audit_lines()[-1]["reason"] == "bad_report"


def test_a_join_cancelled_while_its_token_is_minted_leaves_no_valid_token(
    env: JoinEnv, agent: SimAgent
) -> None:
    """Once: a valid token in the store and the backend, no audit line, no joins row."""
    service = env.srv.app.join_service
    real = service.backend.create
    entered = threading.Event()

    def slow_create(token: Any) -> str:
        entered.set()
        time.sleep(1.0)
        return str(real(token))

    service.backend.create = slow_create
    before = len(env.srv.audit_lines())
    try:
        join_call(env, agent, "RequestJoin", _request(), join_pb2.JoinResponse, cancel_after=0.4)
        assert entered.wait(10)
        deadline = time.monotonic() + 20
        store = env.srv.app.store
        assert store is not None
        while time.monotonic() < deadline and (
            store.live_token(agent.spiffe_id, int(time.time())) is not None or _files(env)
        ):
            time.sleep(0.1)
    finally:
        service.backend.create = real
    assert store.live_token(agent.spiffe_id, int(time.time())) is None
    assert _files(env) == set()
    lines = [a for a in env.srv.audit_lines()[before:] if a["event"] == "join"]
    assert len(lines) == 1, lines


def test_the_sweeper_removes_recorded_tokens_the_server_died_with(env: JoinEnv, agent: SimAgent) -> None:
    """A token created but not recorded when the server was killed was never swept (the file backend kept it)."""
    grant = join(env, agent)
    token_id = grant.token.split(".")[0]
    store = env.srv.app.store
    service = env.srv.app.join_service
    assert store is not None
    # The server records before it creates; what a kill leaves is a recorded token, live or expired.
    live = store.live_token(agent.spiffe_id, int(time.time()))
    assert live is not None and live.token_id == token_id
    clock = service.clock
    service.clock = lambda: clock() + 3600  # an hour later: expired
    try:
        assert service.sweep() >= 1
    finally:
        service.clock = clock
    assert _files(env) == set()
    assert list(store.stale_tokens(int(time.time()) + 3600)) == []


def test_a_revoked_token_the_backend_could_not_delete_is_retried(env: JoinEnv, agent: SimAgent) -> None:
    grant = join(env, agent)
    token_id = grant.token.split(".")[0]
    service = env.srv.app.join_service
    real = service.backend.delete

    def broken(token_id: str, ref: str) -> None:
        raise OSError("the backend is down")

    service.backend.delete = broken
    try:
        assert _joined(env, agent, token_id) is True  # revoked in the store at once
    finally:
        service.backend.delete = real
    assert f"bootstrap-token-{token_id}.yaml" in _files(env)  # still in the backend
    store = env.srv.app.store
    assert store is not None
    assert [t.token_id for t in store.stale_tokens(int(time.time()))] == [token_id]
    service.sweep()
    assert _files(env) == set()


def test_tokens_are_recorded_before_the_backend_makes_them_valid(env: JoinEnv, agent: SimAgent) -> None:
    service = env.srv.app.join_service
    store = env.srv.app.store
    assert store is not None
    real = service.backend.create
    seen: list[TokenRecord | None] = []

    def checking_create(token: Any) -> str:
        seen.append(store.live_token(agent.spiffe_id, int(time.time())))
        return str(real(token))

    service.backend.create = checking_create
    try:
        grant = join(env, agent)
    finally:
        service.backend.create = real
    assert seen and seen[0] is not None and seen[0].token_id == grant.token.split(".")[0]


def test_a_join_without_an_audit_trail_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    audit = env.srv.app.audit
    assert audit is not None
    audit.min_free_bytes = 1 << 50
    audit._free_checked = 0.0
    try:
        with pytest.raises(Refused) as refused:
            join_call(env, agent, "RequestJoin", _request(), join_pb2.JoinResponse)
    finally:
        audit.min_free_bytes = 0
        audit._free_checked = 0.0
    assert refused.value.status == "UNAVAILABLE" and refused.value.reason == "audit_unavailable"
    assert _files(env) == set()
