"""`nodeserver names`, `nodeserver enrol` and `nodeserver agents ban` (the real CLI, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.joinenv import JoinEnv, SimAgent, attest_sim, join, join_config, start_join_env
from tests.support.simtpm import SimulatedTpm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.subprocess


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[JoinEnv, Path]]:
    e = start_join_env(tmp_path)
    doc, _ = join_config(tmp_path, e.ek_ca)
    doc["data_dir"] = str(e.srv.config.data_dir)
    config = tmp_path / "cli.json"
    config.write_text(json.dumps(doc))
    yield e, config
    e.srv.stop()


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args[:2], "--config", str(config), *args[2:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ban_revokes_and_deletes_the_live_token_at_once(env: tuple[JoinEnv, Path], tmp_path: Path) -> None:
    """Once, a banned agent's live token stayed valid until its TTL."""
    e, config = env
    agent = attest_sim(e.srv, SimulatedTpm.create(e.ek_ca), tmp_path / "agent")
    token_id = join(e, agent).token.split(".")[0]
    assert (e.tokens_dir / f"bootstrap-token-{token_id}.yaml").exists()
    done = cli(config, "agents", "ban", agent.spiffe_id, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["revoked_tokens"] == [token_id]
    assert not (e.tokens_dir / f"bootstrap-token-{token_id}.yaml").exists()
    store = e.srv.app.store
    assert store is not None and store.live_token(agent.spiffe_id, int(time.time())) is None


@pytest.mark.parametrize(
    "spiffe_id",
    [
        "spiffe://other.org/spire/agent/tpm/" + "a" * 64,
        "spiffe://example.org/spire/agent/tpm/" + "A" * 64,
        "spiffe://example.org/spire/agent/tpm/abc",
        "spiffe://example.org/spire/agent/aws_iid/" + "a" * 64,
        "spiffe://example.org/workload",
    ],
    ids=["another trust domain", "upper-case hash", "short hash", "another attestor", "not an agent"],
)
def test_ban_refuses_ids_no_agent_can_hold(env: tuple[JoinEnv, Path], spiffe_id: str) -> None:
    _e, config = env
    done = cli(config, "agents", "ban", spiffe_id)
    assert done.returncode == 1 and "can never be an agent of example.org" in done.stderr
    listed = cli(config, "agents", "list", "--json")
    assert spiffe_id not in listed.stdout  # no placeholder recorded


def test_names_list_and_release(env: tuple[JoinEnv, Path], tmp_path: Path) -> None:
    e, config = env
    agent = attest_sim(e.srv, SimulatedTpm.create(e.ek_ca), tmp_path / "agent")
    join(e, agent)
    listed = cli(config, "names", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert rows == [
        {"node_name": agent.node_name, "agent_id": agent.spiffe_id, "ek_hash": agent.sim.ek_hash,
         "bound_at": rows[0]["bound_at"]}
    ]  # fmt: skip
    assert cli(config, "names", "release", agent.node_name).returncode == 0
    again = cli(config, "names", "release", agent.node_name)
    assert again.returncode == 1 and "not bound" in again.stderr


def _agent(e: JoinEnv, tmp_path: Path, name: str) -> SimAgent:
    return attest_sim(e.srv, SimulatedTpm.create(e.ek_ca), tmp_path / name)


def test_enrol_add_list_remove(env: tuple[JoinEnv, Path]) -> None:
    _e, config = env
    ek = "ab" * 32
    added = cli(config, "enrol", "add", ek, "rack1-node1", "cpu", "--serial", "SN-1", "--json")
    assert added.returncode == 0, added.stderr
    listed = cli(config, "enrol", "list", "--json")
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["ek_hash"], row["node_name"], row["pool"], row["serial"]) == (
        ek,
        "rack1-node1",
        "cpu",
        "SN-1",
    )
    assert cli(config, "enrol", "remove", ek).returncode == 0
    assert cli(config, "enrol", "remove", ek).returncode == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zz" * 32, "rack1-node1", "cpu"), "is not 64 hex characters"),
        (("ab" * 32, "Rack1_Node1", "cpu"), "node name"),
        (("ab" * 32, "rack1-node1", "gpu-nope"), "is not configured"),
        (("ab" * 32 + "\n", "rack1-node1", "cpu"), "is not 64 hex characters"),
    ],
    ids=["bad hash", "bad node name", "unknown pool", "trailing newline"],
)
def test_enrol_add_refuses_bad_input(
    env: tuple[JoinEnv, Path], args: tuple[str, str, str], message: str
) -> None:
    _e, config = env
    done = cli(config, "enrol", "add", *args)
    assert done.returncode == 1 and message in done.stderr, done.stderr


def test_enrol_import_is_all_or_nothing(env: tuple[JoinEnv, Path], tmp_path: Path) -> None:
    _e, config = env
    good = tmp_path / "rack.csv"
    good.write_text(
        "ek_hash,node_name,pool,serial\n" + "".join(f"{i:064x},rack2-node{i},cpu,SN{i}\n" for i in range(5))
    )
    done = cli(config, "enrol", "import", str(good), "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == {"enrolled": 5}, done.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "ek_hash,node_name,pool\n"
        + f"{99:064x},rack3-node1,cpu\n"
        + f"{98:064x},rack3-node2,cpu\n"
        + "nothex,x,cpu\n"
    )
    done = cli(config, "enrol", "import", str(bad))
    assert done.returncode == 1 and "bad.csv:4" in done.stderr, done.stderr
    listed = cli(config, "enrol", "list", "--json")
    assert len(listed.stdout.splitlines()) == 5  # nothing of the bad file
    dup = tmp_path / "dup.csv"
    dup.write_text(
        "ek_hash,node_name,pool\n" + f"{97:064x},rack4-node1,cpu\n" + f"{96:064x},rack4-node1,cpu\n"
    )
    done = cli(config, "enrol", "import", str(dup))
    assert done.returncode == 1 and "also on line 2" in done.stderr
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("hash,name\nx,y\n")
    assert "the header must be" in cli(config, "enrol", "import", str(wrong)).stderr
