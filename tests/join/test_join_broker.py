"""The join broker: tokens only for attested, verified, unbanned nodes; one live token per node;
every refusal with its status; no token in any log."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.errors import JoinRefusedError, ServerNotTrustedError, ServerUnavailableError
from agent.svid import new_key
from agent.tls import SpiffeTLSContext
from protocol._gen.nodetrust.join.v1 import join_pb2
from protocol.spiffe import SpiffeId, server_id
from tests.support.joinenv import (
    CPU_POOL,
    GPU_POOL,
    JoinEnv,
    SimAgent,
    attest_sim,
    cpu_report,
    join,
    start_join_env,
)
from tests.support.simtpm import SimulatedTpm

TOKEN_RE = r"^[a-z0-9]{6}\.[a-z0-9]{16}$"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    e = start_join_env(tmp_path_factory.mktemp("join"))
    yield e
    e.srv.stop()


@pytest.fixture
def agent(env: JoinEnv, tmp_path: Path) -> SimAgent:
    return attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "agent")


def _token_files(env: JoinEnv) -> list[Path]:
    return sorted(env.tokens_dir.glob("bootstrap-token-*.yaml")) if env.tokens_dir.exists() else []


def test_join_issues_a_token_and_everything_kubeadm_needs(
    env: JoinEnv, agent: SimAgent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    grant = join(env, agent, pool="cpu", node_name="gpu-node-7")
    import re

    assert re.match(TOKEN_RE, grant.token)
    assert grant.ca_cert_hashes == (env.ca_hash,)
    assert grant.api_server_endpoint == "10.0.0.10:6443"
    assert grant.kubernetes_version == "v1.36.3"
    assert grant.labels["nodetrust.io/pool"] == "cpu"
    assert 800 <= grant.token_expires_at - time.time() <= 905  # 15 min TTL
    token_id, secret = grant.token.split(".")
    # The file backend wrote the Secret manifest, private.
    path = env.tokens_dir / f"bootstrap-token-{token_id}.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    manifest = yaml.safe_load(path.read_text())
    assert manifest["type"] == "bootstrap.kubernetes.io/token"
    assert (
        manifest["stringData"]["token-id"] == token_id and manifest["stringData"]["token-secret"] == secret
    )
    # The store keeps the token as a hash only; the audit trail names the token id, never the secret.
    store = env.srv.app.store
    assert store is not None
    live = store.live_token(agent.spiffe_id, int(time.time()))
    assert live is not None and live.token_id == token_id and secret not in json.dumps(live.__dict__)
    audit = [line for line in env.srv.audit_lines() if line["event"] == "join"]
    assert audit[-1]["result"] == "ok" and audit[-1]["token_id"] == token_id
    # how the server judged the report: the cpu pool only warns on node checks (this host is no node)
    assert audit[-1]["verdict"] == "pass" and audit[-1]["passed_checks"], audit[-1]
    assert all(name.startswith("node.") for name in audit[-1]["warned_checks"]), audit[-1]
    assert not set(audit[-1]["passed_checks"]) & set(audit[-1]["warned_checks"])
    audit_text = env.srv.config.audit_path.read_text()
    assert secret not in audit_text and grant.token not in audit_text
    assert all(secret not in r.getMessage() for r in caplog.records)
    assert secret not in repr(grant)


def test_gpu_pool_taints_and_labels(env: JoinEnv, tmp_path: Path) -> None:
    """A GPU pool's taint reaches the node only through a passing report: recomputed, so a CPU report fails."""
    agent = attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "a")
    with pytest.raises(JoinRefusedError) as refused:
        join(env, agent, pool="gpu")
    assert refused.value.code == "PERMISSION_DENIED" and refused.value.permanent
    assert "gpu.pci.inventory" in refused.value.message


def test_a_retry_within_the_reuse_window_gets_the_same_token(env: JoinEnv, agent: SimAgent) -> None:
    """An agent that crash-loops between its join request and kubeadm mints nothing new."""
    store = env.srv.app.store
    assert store is not None
    first = join(env, agent)
    joins_before = len(store.joins_for(agent.spiffe_id))
    again = join(env, agent)
    assert again.token == first.token
    assert len(store.joins_for(agent.spiffe_id)) == joins_before  # no new history row
    assert [p.name for p in _token_files(env)].count(
        f"bootstrap-token-{first.token.split('.')[0]}.yaml"
    ) == 1
    line = [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]
    assert line["reason"] == "token_reused" and line["token_id"] == first.token.split(".")[0]


def test_a_retry_replaces_and_revokes_the_old_token(env: JoinEnv, agent: SimAgent) -> None:
    first = join(env, agent)
    # Past the reuse window (the broker's monotonic clock moved on), a retry mints a new token.
    service = env.srv.app.join_service
    real = service.monotonic
    service.monotonic = lambda: real() + 3600
    try:
        second = join(env, agent)
    finally:
        service.monotonic = real
    assert first.token != second.token
    ids = {p.name for p in _token_files(env)}
    assert f"bootstrap-token-{second.token.split('.')[0]}.yaml" in ids
    assert f"bootstrap-token-{first.token.split('.')[0]}.yaml" not in ids
    store = env.srv.app.store
    assert store is not None
    live = store.live_token(agent.spiffe_id, int(time.time()))
    assert live is not None and live.token_id == second.token.split(".")[0]


def test_report_claiming_pass_with_failing_observations(env: JoinEnv, agent: SimAgent) -> None:
    from agent.checks import run_checks
    from protocol.policy import policy_from_mapping
    from protocol.report import canonical_json, report_from_json, report_to_json

    report = run_checks(policy_from_mapping({"name": "gpu", **GPU_POOL}))
    assert not report.verdict.passed
    forged: dict[str, Any] = dict(report_to_json(report))
    checks: list[dict[str, Any]] = [dict(c) for c in forged["checks"]]
    for check in checks:
        check["status"] = "pass"
        check["reason"] = ""
    forged["checks"] = checks
    forged["verdict"] = {"passed": True, "failures": [], "warnings": []}
    with pytest.raises(JoinRefusedError, match="fails pool gpu"):
        join(env, agent, pool="gpu", report=canonical_json(report_from_json(forged)))
    line = [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]
    failed = {f.check for f in report.verdict.failures}
    assert line["verdict"] == "fail" and set(line["failed_checks"]) == failed, line  # judged, not believed
    assert not failed & set(line["passed_checks"])


def _raw_join(env: JoinEnv, agent: SimAgent, request: join_pb2.JoinRequest) -> tuple[str, str]:
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    async def call() -> tuple[str, str]:
        tls = SpiffeTLSContext(
            env.srv.bundle, [server_id("example.org")], cert_file=agent.cert, key_file=agent.key
        )
        ch = Channel("127.0.0.1", env.srv.app.ports.join, ssl=tls)
        try:
            async with ch.request(
                "/nodetrust.join.v1.Join/RequestJoin",
                Cardinality.UNARY_UNARY,
                join_pb2.JoinRequest,
                join_pb2.JoinResponse,
            ) as stream:
                await stream.send_message(request, end=True)
                await stream.recv_message()
                return "OK", ""
        except GRPCError as exc:
            return exc.status.name, exc.message or ""
        finally:
            ch.close()

    return asyncio.run(call())


def _request(agent: SimAgent, **kw: Any) -> join_pb2.JoinRequest:
    base: dict[str, Any] = {
        "pool": "cpu",
        "node_name": agent.node_name,
        "report": cpu_report(),
        "request_id": secrets.token_hex(16),
        "requested_at": int(time.time()),
    }
    base.update(kw)
    return join_pb2.JoinRequest(**base)


@pytest.mark.parametrize(
    ("case", "fields", "status", "reason"),
    [
        ("unknown pool", {"pool": "no-such-pool"}, "NOT_FOUND", "unknown_pool"),
        ("bad node name", {"node_name": "Node_1!"}, "INVALID_ARGUMENT", "bad_node_name"),
        ("stale request", {"requested_at": int(time.time()) - 3600}, "INVALID_ARGUMENT", "stale_request"),
        ("bad request id", {"request_id": "abc"}, "INVALID_ARGUMENT", "bad_request_id"),
        ("malformed report", {"report": b"{not json"}, "INVALID_ARGUMENT", "bad_report"),
    ],
)
def test_refusals(
    env: JoinEnv, agent: SimAgent, case: str, fields: dict[str, Any], status: str, reason: str
) -> None:
    before = _token_files(env)
    got = _raw_join(env, agent, _request(agent, **fields))
    assert got[0] == status, got
    last = [line for line in env.srv.audit_lines() if line["event"] == "join"][-1]
    assert last["reason"] == reason and last["status"] == status
    assert _token_files(env) == before


def test_replayed_request(env: JoinEnv, agent: SimAgent) -> None:
    request = _request(agent)
    assert _raw_join(env, agent, request)[0] == "OK"
    files = _token_files(env)
    status, message = _raw_join(env, agent, request)
    assert status == "ALREADY_EXISTS" and "replayed" in message
    assert _token_files(env) == files


def test_banned_agent(env: JoinEnv, agent: SimAgent) -> None:
    store = env.srv.app.store
    assert store is not None
    store.ban_agent(agent.spiffe_id)
    status, message = _raw_join(env, agent, _request(agent))
    assert status == "PERMISSION_DENIED" and "banned" in message


def _svid_for(env: JoinEnv, spiffe_id: str, out: Path, *, expired: bool = False) -> SimAgent:
    ca = env.srv.app.ca
    assert ca is not None
    key = new_key()
    svid = ca.issue_agent_svid(key.public_key(), SpiffeId.parse(spiffe_id), dt.timedelta(hours=1))
    cert = svid.cert
    if expired:
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(cert.subject)
            .issuer_name(cert.issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=3))
            .not_valid_after(now - dt.timedelta(hours=2))
        )
        for ext in cert.extensions:
            builder = builder.add_extension(ext.value, ext.critical)
        cert = builder.sign(ca._key, cert.signature_hash_algorithm)  # type: ignore[arg-type]
    out.mkdir(parents=True, exist_ok=True)
    (out / "svid.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "svid.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return SimAgent(SimulatedTpm.create(None), out / "svid.pem", out / "svid.key", spiffe_id)


def test_svid_of_an_agent_that_never_attested(env: JoinEnv, tmp_path: Path) -> None:
    ghost = _svid_for(env, "spiffe://example.org/spire/agent/tpm/" + "ab" * 32, tmp_path / "ghost")
    with pytest.raises(JoinRefusedError, match="has not attested"):
        join(env, ghost)


def test_expired_svid_is_refused_by_tls(env: JoinEnv, agent: SimAgent, tmp_path: Path) -> None:
    stale = _svid_for(env, agent.spiffe_id, tmp_path / "stale", expired=True)
    before = _token_files(env)
    with pytest.raises((ServerUnavailableError, ServerNotTrustedError, JoinRefusedError)):
        join(env, stale)
    assert _token_files(env) == before


def test_svid_from_another_ca_is_refused(env: JoinEnv, tmp_path: Path) -> None:
    other = start_join_env(tmp_path / "other")
    try:
        stranger = attest_sim(other.srv, SimulatedTpm.create(other.ek_ca), tmp_path / "stranger")
    finally:
        other.srv.stop()
    before = _token_files(env)
    with pytest.raises((ServerUnavailableError, ServerNotTrustedError, JoinRefusedError)):
        join(env, stranger)
    assert _token_files(env) == before


def test_no_client_certificate(env: JoinEnv, agent: SimAgent) -> None:
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    async def call() -> None:
        ch = Channel(
            "127.0.0.1",
            env.srv.app.ports.join,
            ssl=SpiffeTLSContext(env.srv.bundle, [server_id("example.org")]),
        )
        try:
            async with ch.request(
                "/nodetrust.join.v1.Join/RequestJoin",
                Cardinality.UNARY_UNARY,
                join_pb2.JoinRequest,
                join_pb2.JoinResponse,
            ) as stream:
                await stream.send_message(_request(agent), end=True)
                await stream.recv_message()
        finally:
            ch.close()

    before = _token_files(env)
    with pytest.raises(Exception):  # noqa: B017 - the handshake fails; the exact error is the TLS stack's
        asyncio.run(call())
    assert _token_files(env) == before


def test_join_metrics(env: JoinEnv, agent: SimAgent) -> None:
    import urllib.request

    join(env, agent)
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{env.srv.app.ports.metrics}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert 'nodeserver_joins_total{reason="joined",result="ok"}' in body


def test_pool_configuration_errors(tmp_path: Path) -> None:
    from server.errors import ConfigError
    from server.pools import join_settings

    cluster: dict[str, Any] = {
        "api_server_endpoint": "10.0.0.1:6443",
        "ca_cert_hashes": ["sha256:" + "0" * 64],
        "kubernetes_version": "v1.36.3",
    }
    base: dict[str, Any] = {
        "cluster": cluster,
        "token_backend": {"type": "file", "directory": str(tmp_path)},
        "pools": {"cpu": {"profile": CPU_POOL}},
    }
    assert join_settings(base) is not None
    bad_cases: list[tuple[dict[str, Any], str]] = [
        ({"pools": {"cpu": {"profile": {"preset": "nope"}}}}, "pools.cpu.profile"),
        ({"pools": {"cpu": {"profile": CPU_POOL, "colour": 1}}}, "unknown key"),
        ({"pools": {"Bad_Name": {"profile": CPU_POOL}}}, "not a valid pool name"),
        ({"cluster": {**cluster, "kubernetes_version": "1.36"}}, "v1.36.3"),
        ({"cluster": {"api_server_endpoint": "10.0.0.1:6443", "kubernetes_version": "v1.36.3"}}, "CA pin"),
        ({"join": {"token_ttl": "48h"}}, "between 1m and 24h"),
        ({"pools": {}}, "at least one pool"),
    ]
    for change, message in bad_cases:
        with pytest.raises(ConfigError, match=message):
            join_settings({**base, **change})
