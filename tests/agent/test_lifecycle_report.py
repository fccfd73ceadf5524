"""The lifecycle's last steps in-process against the tiny broker: kubeadm join, then Join.ReportJoined.

The report tells the broker to revoke the token at once; a failed report is logged and retried a
few times and never undoes the join. A JoinConfiguration (it holds a token) never outlives a run,
whichever way the run ends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from agent.config import AgentConfig
from agent.errors import ConfigError
from agent.lifecycle import Lifecycle
from agent.state import State, StateStore, Step
from protocol import status_details
from protocol._gen.nodetrust.join.v1 import join_pb2
from protocol.reasons import get
from tests.agent.conftest import TRUST_DOMAIN, TinyServer, abort_with, joined_reply
from tests.support.joinenv import CPU_POOL
from tests.support.kubeadm_double import install_kubeadm_double

pytestmark = pytest.mark.subprocess  # the kubeadm test double is a real subprocess
TOKEN = "abcdef.0123456789abcdef"
Servers = Callable[..., TinyServer]


def grant(request: Any, context: Any) -> Any:
    return join_pb2.JoinResponse(
        token=TOKEN,
        token_expires_at=2_000_000_000,
        ca_cert_hashes=["sha256:" + "0f" * 32],
        api_server_endpoint="10.0.0.10:6443",
        kubernetes_version="v1.36.3",
        verdict="pass",
    )


def unavailable() -> Any:
    raw = status_details.encode("UNAVAILABLE", "store down", get("store"))
    return abort_with(grpc.StatusCode.UNAVAILABLE, "store down", raw)


class Node:
    def __init__(self, srv: TinyServer, tmp: Path) -> None:
        self.srv, self.tmp = srv, tmp
        tmp.mkdir()
        self.record = tmp / "kubeadm-calls.jsonl"
        pool = tmp / "pool.yaml"
        pool.write_text(yaml.safe_dump({"name": "cpu", **CPU_POOL}))
        self.sleeps: list[float] = []
        self.config = replace(
            AgentConfig(),
            server="127.0.0.1:9",
            join_server=srv.address,
            trust_domain=TRUST_DOMAIN,
            bundle=str(srv.bundle_path),
            pool="cpu",
            pool_profile=str(pool),
            node_name="worker-1",
            state_dir=str(srv.base),  # the tiny server issued a valid SVID there: no attestation needed
            kubeadm=str(install_kubeadm_double(tmp / "bin", self.record)),
            join_config=str(tmp / "run" / "kubeadm-join.yaml"),
            retry_initial_s=0.01,
            retry_max_s=0.02,
            deadline_s=30.0,
        )
        StateStore(srv.base).save(State(step=Step.VERIFY))

    def lifecycle(self, sleep: Callable[[float], None] | None = None) -> Lifecycle:
        return Lifecycle(
            self.config, sleep=sleep or self.sleeps.append, kubelet_conf=self.tmp / "kubelet.conf"
        )

    def kubeadm_calls(self) -> list[dict[str, Any]]:
        return (
            [json.loads(line) for line in self.record.read_text().splitlines()]
            if self.record.exists()
            else []
        )


@pytest.fixture
def make_node(tiny_server: Servers, tmp_path: Path) -> Callable[..., Node]:
    def make(**handlers: Any) -> Node:
        srv = tiny_server(**handlers)
        return Node(srv, tmp_path / f"node-{srv.port}")

    return make


def test_the_join_is_reported_with_the_tokens_public_id(make_node: Callable[..., Node]) -> None:
    node = make_node(RequestJoin=grant, ReportJoined=joined_reply(revoked=True))
    outcome = node.lifecycle().run()
    assert outcome.joined and len(node.kubeadm_calls()) == 1
    [report] = node.srv.calls.of("ReportJoined")
    assert (report.token_id, report.node_name) == ("abcdef", "worker-1")
    assert "0123456789abcdef" not in str(report), "the secret half never goes back to the broker"
    seen = [name for name, _, _ in node.srv.calls.seen]
    assert seen == ["BeginJoin", "RequestJoin", "ReportJoined"], "reported after kubeadm join, once"


def test_a_failing_report_is_retried_and_never_undoes_the_join(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "agent.lifecycle")
    node = make_node(RequestJoin=grant, ReportJoined=unavailable())
    outcome = node.lifecycle().run()
    assert outcome.joined and StateStore(node.srv.base).joined()
    assert len(node.srv.calls.of("ReportJoined")) == 3
    assert len(node.sleeps) == 2, "a pause between the tries"
    assert any("was not told of the join" in r.getMessage() for r in caplog.records)
    assert StateStore(node.srv.base).load().step is Step.JOINED


def test_a_permanent_report_refusal_is_not_retried(make_node: Callable[..., Node]) -> None:
    raw = status_details.encode("NOT_FOUND", "not yours", get("unknown_token"))
    node = make_node(RequestJoin=grant, ReportJoined=abort_with(grpc.StatusCode.NOT_FOUND, "not yours", raw))
    assert node.lifecycle().run().joined
    assert len(node.srv.calls.of("ReportJoined")) == 1


def test_a_broker_without_report_joined_still_joins(make_node: Callable[..., Node]) -> None:
    node = make_node(RequestJoin=grant)  # an older broker: UNIMPLEMENTED
    assert node.lifecycle().run().joined
    assert len(node.srv.calls.of("ReportJoined")) == 1


# -- the JoinConfiguration never outlives a run ------------------------------------------------


def test_a_stale_join_configuration_is_removed_at_the_start(make_node: Callable[..., Node]) -> None:
    node = make_node(RequestJoin=grant, ReportJoined=joined_reply())
    stale = Path(node.config.join_config)
    stale.parent.mkdir(mode=0o700)
    stale.write_text(f"token: {TOKEN}\n")
    StateStore(node.srv.base).mark_joined()
    assert node.lifecycle().run().joined  # the early "already joined" return
    assert not stale.exists()


def test_the_join_configuration_is_removed_on_a_permanent_failure(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.config = replace(node.config, trust_domain="")  # preflight refuses: a missing setting
    StateStore(node.srv.base).save(State())
    stale = Path(node.config.join_config)
    stale.parent.mkdir(mode=0o700)
    stale.write_text(f"token: {TOKEN}\n")
    with pytest.raises(ConfigError):
        node.lifecycle().run()
    assert not stale.exists()


def test_the_join_configuration_is_removed_when_the_run_is_interrupted(
    make_node: Callable[..., Node],
) -> None:
    """Whatever ends the run (here Ctrl-C while it waits to retry), no JoinConfiguration is left."""
    node = make_node(RequestJoin=unavailable())
    path = Path(node.config.join_config)

    def interrupted(delay: float) -> None:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_text(f"token: {TOKEN}\n")  # as if a join had been under way
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        node.lifecycle(sleep=interrupted).run()
    assert not path.exists()
