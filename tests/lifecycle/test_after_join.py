"""``nodeagent run``'s stage after the join: a DevID from nodeserver, then the image's SPIRE agent unit.

A real swtpm, a real nodeserver (join broker and DevID CA), the kubeadm double, and the systemctl
double first on PATH (tests/support/systemctl_double.py: there is no systemd on these machines), which
records every call the agent makes through its subprocess chokepoint. The agent runs as a separate
process, as under systemd, and is SIGKILLed between the stage's steps.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.lifecycle.test_lifecycle import Node
from tests.support.joinenv import CPU_POOL, JoinEnv, start_join_env
from tests.support.kubeadm_double import install_kubeadm_double
from tests.support.swtpm import LocalCa, Swtpm, manufacture
from tests.support.systemctl_double import calls, fail_while, install_systemctl_double

pytestmark = [pytest.mark.swtpm, pytest.mark.subprocess]
_NAMES = itertools.count(1)
UNIT = "spire-agent.service"
START = ["start", "--no-block", UNIT]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    e = start_join_env(tmp_path_factory.mktemp("after-join-server"))
    yield e
    e.srv.stop()


@pytest.fixture(scope="module")
def ek_ca(tmp_path_factory: pytest.TempPathFactory, env: JoinEnv) -> LocalCa:
    ca = LocalCa(tmp_path_factory.mktemp("after-join-ekca"))
    manufacture(tmp_path_factory.mktemp("warm"), ca)
    ca.install_into(env.base / "ek-ca")
    env.srv.app.ek_trust.reload()  # type: ignore[union-attr]
    return ca


class StagedNode(Node):
    """A node whose agent has the stage after the join configured and systemctl recorded."""

    def stage(self, *args: str, fault: str = "", extra: dict[str, str] | None = None, **kw: Any) -> Any:
        env = {
            "PATH": f"{self.dir / 'sbin'}:{os.environ['PATH']}",
            "NODEAGENT_DEVID_ENROL": "true",
            "NODEAGENT_SPIRE_AGENT_UNIT": UNIT,
        }
        env.update(extra or {})
        return self.run(*args, fault=fault, extra_env=env, **kw)

    @property
    def systemctl_record(self) -> Path:
        return self.dir / "systemctl-calls.jsonl"

    def systemctl_calls(self) -> list[list[str]]:
        return calls(self.systemctl_record)

    def status(self) -> dict[str, Any]:
        done = self.run("status", "--json")
        assert done.returncode == 0, done.stderr
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc

    @property
    def devid_cert(self) -> Path:
        return self.dir / "state" / "devid" / "devid.crt.pem"

    @property
    def pending(self) -> Path:
        return self.dir / "state" / "after-join-pending"

    @property
    def joined(self) -> Path:
        return self.dir / "state" / "joined"


@pytest.fixture
def node(env: JoinEnv, ek_ca: LocalCa, tmp_path: Path) -> Iterator[StagedNode]:
    manufacture(tmp_path / "tpm", ek_ca)
    tpm = Swtpm(tmp_path / "tpm").start()
    (tmp_path / "etc").mkdir()
    (tmp_path / "bundle.pem").write_bytes(env.srv.bundle)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"name": "cpu", **CPU_POOL}))
    record = tmp_path / "kubeadm-calls.jsonl"
    kubeadm = install_kubeadm_double(tmp_path / "bin", record)
    install_systemctl_double(tmp_path / "sbin", tmp_path / "systemctl-calls.jsonl", (UNIT,))
    yield StagedNode(env, tpm, tmp_path, kubeadm, record, name=f"staged-{next(_NAMES)}")
    tpm.stop()


def _devid_events(env: JoinEnv, spiffe_id: str) -> list[dict[str, Any]]:
    return [
        line
        for line in env.srv.audit_lines()
        if line.get("event") == "devid" and line.get("spiffe_id") == spiffe_id and line.get("result") == "ok"
    ]


def _leaf(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificates(path.read_bytes())[0]


def _tpm_devid_id(path: Path) -> str:
    der = _leaf(path).public_bytes(serialization.Encoding.DER)
    return (
        f"spiffe://example.org/spire/agent/tpm_devid/{hashlib.sha1(der, usedforsecurity=False).hexdigest()}"
    )


def test_joins_then_enrols_a_devid_then_starts_the_spire_agent(node: StagedNode, env: JoinEnv) -> None:
    done = node.stage("run", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"joined": True, "node_name": node.name, "after_join": "done"}
    assert len(node.kubeadm_calls()) == 1
    # The DevID files spire-agent's tpm_devid reads, in <state_dir>/devid; then the unit, never blocking.
    for name in ("devid.crt.pem", "devid.priv.blob", "devid.pub.blob", "devid-ca.pem"):
        assert (node.dir / "state" / "devid" / name).is_file(), name
    assert node.systemctl_calls() == [START]
    assert node.joined.exists() and not node.pending.exists()
    doc = node.status()
    assert doc["joined"] is True and doc["step"] == "joined" and doc["last_error"] is None
    stage, devid = doc["after_join"], doc["devid"]
    assert stage["step"] == "done" and stage["done"] is True and stage["last_error"] is None
    assert stage["spire_agent_unit"] == UNIT and stage["spire_agent_started"]
    # What SPIRE's tpm_devid will name the node: the SHA-1 of the DevID leaf certificate.
    assert devid["spiffe_id"] == _tpm_devid_id(node.devid_cert)
    assert devid["expires_at"] == int(_leaf(node.devid_cert).not_valid_after_utc.timestamp())
    assert devid["expired"] is False and devid["enrolled"]
    issued = _devid_events(env, doc["identity"])
    assert len(issued) == 1 and issued[0]["devid_agent_id"] == devid["spiffe_id"]
    text = node.run("status").stdout
    assert f"DevID (SPIRE tpm_devid): {devid['spiffe_id']}" in text
    assert (
        "after the join: done" in text
        and "DevID expires: " in text
        and f"SPIRE agent: {UNIT} started" in text
    )

    # Done: another run neither joins, nor enrols, nor asks systemd again.
    again = node.stage("run")
    assert again.returncode == 0, again.stderr
    assert len(node.kubeadm_calls()) == 1 and node.systemctl_calls() == [START]
    assert len(_devid_events(env, doc["identity"])) == 1


def test_a_valid_devid_in_devid_dir_is_used_as_it_is(node: StagedNode, env: JoinEnv) -> None:
    # Joined without the stage, then a DevID enrolled by hand (nodeagent devid enrol).
    joined = node.run("run")
    assert joined.returncode == 0, joined.stderr
    assert node.systemctl_calls() == [] and not node.pending.exists()
    enrolled = node.run("devid", "enrol", "--json")
    assert enrolled.returncode == 0, enrolled.stderr
    before = node.devid_cert.read_bytes()
    identity = node.status()["identity"]
    assert len(_devid_events(env, identity)) == 1

    done = node.stage("run")  # the stage on a joined node, run by hand
    assert done.returncode == 0, done.stderr
    assert node.devid_cert.read_bytes() == before, "a valid DevID must not be replaced"
    assert len(_devid_events(env, identity)) == 1
    assert node.systemctl_calls() == [START]
    doc = node.status()
    assert doc["devid"]["spiffe_id"] == json.loads(enrolled.stdout)["tpm_devid_id"]
    assert doc["devid"]["enrolled"] is None  # used as found
    assert len(node.kubeadm_calls()) == 1


def test_an_expiring_devid_is_enrolled_again_and_the_unit_restarted(node: StagedNode, env: JoinEnv) -> None:
    assert node.stage("run").returncode == 0
    first = _leaf(node.devid_cert)
    # The server's DevIDs live a year: renewing within 400 days makes the one there "expiring".
    renew = node.stage("run", extra={"NODEAGENT_DEVID_RENEW_BEFORE_S": "9600h"})
    assert renew.returncode == 0, renew.stderr
    second = _leaf(node.devid_cert)
    assert second.serial_number != first.serial_number
    identity = node.status()["identity"]
    assert len(_devid_events(env, identity)) == 2
    # The running spire-agent read the old DevID: restarted, not merely started.
    assert node.systemctl_calls() == [START, ["restart", "--no-block", UNIT]]
    assert node.status()["devid"]["spiffe_id"] == _tpm_devid_id(node.devid_cert)
    assert len(node.kubeadm_calls()) == 1


def test_enrolment_failing_is_retried_and_shown_and_the_join_stands(node: StagedNode, env: JoinEnv) -> None:
    killed = node.stage("run", fault="kubeadm_join")  # joined; killed before the stage
    assert killed.returncode == -9
    down = node.stage("run", extra={"NODEAGENT_SERVER": "127.0.0.1:9", "NODEAGENT_DEADLINE_S": "6"})
    assert down.returncode == 4, down.stderr  # server_unreachable, transient: systemd restarts the unit
    assert node.joined.exists() and node.pending.exists()
    doc = node.status()
    assert doc["joined"] is True and doc["step"] == "joined" and doc["last_error"] is None
    stage = doc["after_join"]
    assert stage["step"] == "devid_enrol" and stage["done"] is False and stage["attempts"] >= 2
    err = stage["last_error"]
    assert (err["step"], err["exit_class"], err["permanent"], err["reason"]) == (
        "devid_enrol",
        "server_unreachable",
        False,
        "server_unreachable",
    )
    text = node.run("status").stdout
    assert "after the join: devid_enrol (the join stands)" in text
    assert "last error (after the join: devid_enrol, transient, attempt" in text
    assert node.systemctl_calls() == [] and not node.devid_cert.exists()

    resumed = node.stage("run")
    assert resumed.returncode == 0, resumed.stderr
    assert len(node.kubeadm_calls()) == 1, "the stage never joins again"
    assert node.systemctl_calls() == [START] and not node.pending.exists()
    assert node.status()["after_join"]["last_error"] is None


def test_the_unit_failing_to_start_is_retried_then_done(node: StagedNode, env: JoinEnv) -> None:
    fail_while(node.systemctl_record, True)
    failed = node.stage("run", extra={"NODEAGENT_DEADLINE_S": "5"})
    assert failed.returncode == 16, failed.stderr  # unit_start_failed: transient
    assert len(node.systemctl_calls()) >= 2, "retried with backoff"
    doc = node.status()
    assert doc["joined"] is True and doc["after_join"]["step"] == "spire_agent"
    assert doc["after_join"]["last_error"]["exit_class"] == "unit_start_failed"
    assert doc["devid"]["spiffe_id"] == _tpm_devid_id(node.devid_cert)
    fail_while(node.systemctl_record, False)
    tries = len(node.systemctl_calls())
    done = node.stage("run")
    assert done.returncode == 0, done.stderr
    assert node.systemctl_calls()[tries:] == [START]
    assert len(_devid_events(env, doc["identity"])) == 1, "the DevID enrolled before is kept"
    assert len(node.kubeadm_calls()) == 1


def test_a_unit_the_image_lacks_stops_the_stage_for_good(node: StagedNode) -> None:
    missing = node.stage("run", extra={"NODEAGENT_SPIRE_AGENT_UNIT": "no-such.service"})
    assert missing.returncode == 2, missing.stderr  # config, permanent: systemd does not restart the unit
    assert "no loadable unit no-such.service" in missing.stderr
    err = node.status()["after_join"]["last_error"]
    assert (err["exit_class"], err["permanent"]) == ("config", True)
    assert node.joined.exists() and node.pending.exists()  # the next boot tries again
    assert len(node.kubeadm_calls()) == 1


@pytest.mark.parametrize("step", ["devid_enrol", "spire_agent"])
def test_killed_after_each_step_of_the_stage_resumes_once(node: StagedNode, env: JoinEnv, step: str) -> None:
    killed = node.stage("run", fault=step)
    assert killed.returncode == -9, killed.stderr
    assert node.joined.exists() and node.pending.exists(), "the unit must run again after the crash"
    state = json.loads((node.dir / "state" / "state.json").read_text())
    assert state["after_join"]["step"] == {"devid_enrol": "spire_agent", "spire_agent": "done"}[step]
    assert node.systemctl_calls() == ([] if step == "devid_enrol" else [START])
    resumed = node.stage("run")
    assert resumed.returncode == 0, resumed.stderr
    assert node.systemctl_calls() == [START]
    assert not node.pending.exists()
    assert len(_devid_events(env, node.status()["identity"])) == 1, "resuming does not enrol again"
    assert len(node.kubeadm_calls()) == 1


def test_a_server_that_forgot_the_node_gets_an_ek_attestation_then_the_enrolment(
    node: StagedNode, env: JoinEnv
) -> None:
    """DevId/Enrol refuses a node whose EK identity the server does not know (``not_attested``): the
    stage attests with the EK again, once, and enrols; it never goes back to the join."""
    assert node.run("run").returncode == 0  # joined, no stage
    identity = node.status()["identity"]
    assert env.srv.app.store is not None and env.srv.app.store.delete_agent(identity)
    done = node.stage("run", extra={"NODEAGENT_DEADLINE_S": "30"})
    assert done.returncode == 0, done.stderr
    history = json.loads((node.dir / "state" / "state.json").read_text())["history"]
    refused = [h for h in history if h.get("step") == "devid_enrol" and h.get("reason") == "not_attested"]
    assert len(refused) == 1, history
    assert env.srv.app.store.get_agent(identity) is not None, "the node attested with its EK again"
    assert len(_devid_events(env, identity)) == 1
    assert node.systemctl_calls() == [START] and len(node.kubeadm_calls()) == 1
