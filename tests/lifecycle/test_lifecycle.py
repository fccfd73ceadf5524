"""``nodeagent run`` end to end: a real swtpm, a real server with a join broker, the kubeadm double.

The agent runs as a separate process, as under systemd, and is SIGKILLed between every pair of
steps; every time the next run finishes the join exactly once.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.joinenv import CPU_POOL, JoinEnv, start_join_env
from tests.support.kubeadm_double import install_kubeadm_double
from tests.support.swtpm import LocalCa, Swtpm, manufacture

pytestmark = [pytest.mark.swtpm, pytest.mark.subprocess]
ROOT = Path(__file__).resolve().parents[2]
_NAMES = itertools.count(1)


@dataclass
class Node:
    env: JoinEnv
    tpm: Swtpm
    dir: Path
    kubeadm: Path
    record: Path
    # Each test's machine (a new TPM) has a name of its own: a name belongs to the first EK granted it.
    name: str = "worker-1"

    def run(
        self, *args: str, fault: str = "", extra_env: dict[str, str] | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_")}
        env.update(
            NODEAGENT_SERVER=self.env.srv.address,
            NODEAGENT_JOIN_SERVER=self.env.join_address,
            NODEAGENT_TRUST_DOMAIN="example.org",
            NODEAGENT_BUNDLE=str(self.dir / "bundle.pem"),
            NODEAGENT_TCTI=self.tpm.tcti,
            NODEAGENT_POOL="cpu",
            NODEAGENT_POOL_PROFILE=str(self.dir / "pool.yaml"),
            NODEAGENT_NODE_NAME=self.name,
            NODEAGENT_STATE_DIR=str(self.dir / "state"),
            NODEAGENT_KUBEADM=str(self.kubeadm),
            NODEAGENT_JOIN_CONFIG=str(self.dir / "run" / "kubeadm-join.yaml"),
            NODEAGENT_RETRY_INITIAL_S="0.2",
            NODEAGENT_RETRY_MAX_S="1",
            NODEAGENT_DEADLINE_S="60",
        )
        if fault:
            env["NODEAGENT_FAULT_KILL_AFTER"] = fault
        env.update(extra_env or {})
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", *args, "--config-dir", str(self.dir / "etc")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def kubeadm_calls(self) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    e = start_join_env(tmp_path_factory.mktemp("lifecycle-server"))
    yield e
    e.srv.stop()


@pytest.fixture(scope="module")
def ek_ca(tmp_path_factory: pytest.TempPathFactory, env: JoinEnv) -> LocalCa:
    ca = LocalCa(tmp_path_factory.mktemp("lifecycle-ekca"))
    manufacture(tmp_path_factory.mktemp("warm"), ca)
    # The server trusts the swtpm local CA as well as the simulated one.
    ca_dir = env.base / "ek-ca"
    ca.install_into(ca_dir)
    env.srv.app.ek_trust.reload()  # type: ignore[union-attr]
    return ca


@pytest.fixture
def node(env: JoinEnv, ek_ca: LocalCa, tmp_path: Path) -> Iterator[Node]:
    manufacture(tmp_path / "tpm", ek_ca)
    tpm = Swtpm(tmp_path / "tpm").start()
    (tmp_path / "etc").mkdir()
    (tmp_path / "bundle.pem").write_bytes(env.srv.bundle)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"name": "cpu", **CPU_POOL}))
    record = tmp_path / "kubeadm-calls.jsonl"
    kubeadm = install_kubeadm_double(tmp_path / "bin", record)
    yield Node(env, tpm, tmp_path, kubeadm, record, name=f"worker-{next(_NAMES)}")
    tpm.stop()


def test_power_on_to_joined_and_never_again(node: Node) -> None:
    first = node.run("run")
    assert first.returncode == 0, first.stderr
    assert f"joined as {node.name}" in first.stdout
    calls = node.kubeadm_calls()
    assert len(calls) == 1
    assert not (node.dir / "run" / "kubeadm-join.yaml").exists(), (
        "the JoinConfiguration must be removed after use"
    )
    assert (node.dir / "state" / "joined").exists()
    status = node.run("status")
    assert "step: joined" in status.stdout
    doc = json.loads(node.run("status", "--json").stdout)
    assert doc["joined"] is True and doc["step"] == "joined" and doc["last_error"] is None
    assert (
        doc["identity"].startswith("spiffe://example.org/spire/agent/tpm/") and doc["svid_expired"] is False
    )
    assert doc["last_verification"] == "pass"
    again = node.run("run")
    assert again.returncode == 0 and len(node.kubeadm_calls()) == 1, (
        "a completed join must never be repeated"
    )


@pytest.mark.parametrize("step", ["preflight", "attest", "verify", "join_request", "kubeadm_join"])
def test_killed_after_each_step_resumes_and_joins_once(node: Node, step: str) -> None:
    killed = node.run("run", fault=step)
    assert killed.returncode == -9, killed.stderr
    state = json.loads((node.dir / "state" / "state.json").read_text())
    assert state["step"] != "preflight" or step == "preflight"
    resumed = node.run("run")
    assert resumed.returncode == 0, resumed.stderr
    assert len(node.kubeadm_calls()) == 1
    assert (node.dir / "state" / "joined").exists()


def test_server_unreachable_is_retried_then_reported(node: Node) -> None:
    down = node.run("run", extra_env={"NODEAGENT_SERVER": "127.0.0.1:9", "NODEAGENT_DEADLINE_S": "2"})
    assert down.returncode != 0
    status = node.run("status").stdout
    assert "attest" in status and "cannot reach the server" in status and "transient" in status
    assert "what to do:" in status
    assert node.run("run").returncode == 0


def test_join_broker_unreachable_after_attesting(node: Node) -> None:
    down = node.run("run", extra_env={"NODEAGENT_JOIN_SERVER": "127.0.0.1:9", "NODEAGENT_DEADLINE_S": "2"})
    assert down.returncode != 0
    status = node.run("status").stdout
    assert "join_request" in status and "cannot reach the join broker" in status
    assert node.run("run").returncode == 0
    assert len(node.kubeadm_calls()) == 1


def test_permanent_refusal_stops_with_the_reason(node: Node, env: JoinEnv) -> None:
    # Attest first, then ban: the join is refused for good and the status says why.
    assert node.run("run", fault="attest").returncode == -9
    state = json.loads((node.dir / "state" / "state.json").read_text())
    assert env.srv.app.store is not None
    env.srv.app.store.ban_agent(state["spiffe_id"])
    refused = node.run("run")
    # A ban has its own exit status, which the unit's RestartPreventExitStatus= lists (it used to exit 8
    # like any join refusal, and before the one table systemd restarted it for ever).
    assert refused.returncode == 11, refused.stderr
    assert "banned" in refused.stderr and "hint:" in refused.stderr and "unban" in refused.stderr
    status = node.run("status").stdout
    assert "permanent" in status and "banned" in status
    doc = json.loads(node.run("status", "--json").stdout)
    assert doc["joined"] is False and doc["step"] == "join_request"
    err = doc["last_error"]
    assert (err["reason"], err["permanent"], err["exit_status"], err["exit_class"]) == (
        "banned",
        True,
        11,
        "banned",
    )
    assert err["code"] == "PERMISSION_DENIED" and "unban" in err["hint"]
    assert node.kubeadm_calls() == []


def test_a_server_that_forgot_the_node_gets_a_fresh_attestation(node: Node, env: JoinEnv) -> None:
    """The broker no longer knows the (still valid) SVID: the agent attests anew at once, then joins.

    Before, the lifecycle went back to the attest step, which kept the valid SVID, and asked the
    broker again with it until the deadline.
    """
    assert node.run("run", fault="verify").returncode == -9
    first = json.loads((node.dir / "state" / "state.json").read_text())
    assert env.srv.app.store is not None and env.srv.app.store.delete_agent(first["spiffe_id"])
    joined = node.run("run", extra_env={"NODEAGENT_DEADLINE_S": "30"})
    assert joined.returncode == 0, joined.stderr
    assert "not_attested" in joined.stderr
    history = json.loads((node.dir / "state" / "state.json").read_text())["history"]
    refused = next(i for i, h in enumerate(history) if h.get("reason") == "not_attested")
    assert history[refused + 1] == {"at": history[refused + 1]["at"], "step": "attest", "ok": True}
    assert env.srv.app.store.get_agent(first["spiffe_id"]) is not None, "the node attested again"
    assert len(node.kubeadm_calls()) == 1


def test_a_stale_join_configuration_is_removed_even_when_already_joined(node: Node) -> None:
    """A run killed inside kubeadm join leaves the JoinConfiguration (it holds the token); the next run,
    which finds the node joined and returns at once, removes it."""
    assert node.run("run").returncode == 0
    stale = node.dir / "run" / "kubeadm-join.yaml"
    stale.write_text("discovery: {bootstrapToken: {token: abcdef.0123456789abcdef}}\n")
    stale.chmod(0o600)
    again = node.run("run")
    assert again.returncode == 0, again.stderr
    assert not stale.exists(), "the stale join configuration must not outlive the run"
    assert "removed a join configuration left behind" in again.stderr


def test_kubeadm_failure_is_retried_with_new_credentials(node: Node, tmp_path: Path) -> None:
    failing = install_kubeadm_double(tmp_path / "bin-fail", node.record, exit_code=1)
    out = node.run("run", extra_env={"NODEAGENT_KUBEADM": str(failing), "NODEAGENT_DEADLINE_S": "3"})
    assert out.returncode != 0
    assert len(node.kubeadm_calls()) >= 1
    assert not (node.dir / "run" / "kubeadm-join.yaml").exists()
    ok = node.run("run")
    assert ok.returncode == 0
