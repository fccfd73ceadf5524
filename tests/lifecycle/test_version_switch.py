"""``nodeagent run`` with a pool on another Kubernetes version than the image installs: the switch, end to end.

A real swtpm, a real server whose pools run v1.35.3 and v1.33.1, the kubeadm double, and the apt/dpkg
double (tests/support/apt_double.py: the real apt would change this machine's packages; the VM tier runs
the real one). The node's image installs 1.36.3 and stages 1.34.2 and 1.35.3 as real debs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from agent.kubeversion import PACKAGES
from tests.support.apt_double import install_apt_double, load
from tests.support.joinenv import JoinEnv, start_join_env
from tests.support.kubeadm_double import install_kubeadm_double
from tests.support.payload_server import _deb
from tests.support.swtpm import LocalCa, Swtpm, manufacture

pytestmark = [pytest.mark.swtpm, pytest.mark.subprocess]
ROOT = Path(__file__).resolve().parents[2]
# The pool's profile as a Domino-like pool on 1.35 would have it: the skew check fatal, the other node
# checks only warn (this test machine is no Kubernetes node).
PROFILE = {"preset": "cpu", "node": {"control_plane_version": "1.35"},
           "checks": {"warn": ["node.*"], "fatal": ["node.kubelet"]}}  # fmt: skip


@dataclass
class Node:
    env: JoinEnv
    tpm: Swtpm
    dir: Path
    pool: str
    apt: Path

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_")}
        env.update(
            PATH=f"{self.dir / 'bin'}:/usr/bin:/bin:/usr/sbin:/sbin",
            NODEAGENT_SERVER=self.env.srv.address,
            NODEAGENT_JOIN_SERVER=self.env.join_address,
            NODEAGENT_TRUST_DOMAIN="example.org",
            NODEAGENT_BUNDLE=str(self.dir / "bundle.pem"),
            NODEAGENT_TCTI=self.tpm.tcti,
            NODEAGENT_POOL=self.pool,
            NODEAGENT_POOL_PROFILE=str(self.dir / "pool.yaml"),
            NODEAGENT_NODE_NAME=f"switch-{self.pool}",
            NODEAGENT_STATE_DIR=str(self.dir / "state"),
            NODEAGENT_KUBEADM=str(self.dir / "bin" / "kubeadm"),
            NODEAGENT_JOIN_CONFIG=str(self.dir / "run" / "kubeadm-join.yaml"),
            NODEAGENT_IMAGE_INFO=str(self.dir / "image.json"),
            NODEAGENT_RETRY_INITIAL_S="0.2",
            NODEAGENT_RETRY_MAX_S="1",
            NODEAGENT_DEADLINE_S="60",
        )
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", *args, "--config-dir", str(self.dir / "etc")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def kubeadm_calls(self) -> list[dict[str, object]]:
        record = self.dir / "kubeadm-calls.jsonl"
        return [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    pools = {
        "on135": {"profile": PROFILE, "kubernetes_version": "v1.35.3"},
        "on133": {"profile": PROFILE, "kubernetes_version": "v1.33.1"},
    }
    e = start_join_env(tmp_path_factory.mktemp("switch-server"), pools=pools)
    yield e
    e.srv.stop()


@pytest.fixture(scope="module")
def ek_ca(tmp_path_factory: pytest.TempPathFactory, env: JoinEnv) -> LocalCa:
    ca = LocalCa(tmp_path_factory.mktemp("switch-ekca"))
    manufacture(tmp_path_factory.mktemp("warm"), ca)
    ca.install_into(env.base / "ek-ca")
    env.srv.app.ek_trust.reload()  # type: ignore[union-attr]
    return ca


def _node(env: JoinEnv, ek_ca: LocalCa, tmp_path: Path, pool: str) -> Node:
    manufacture(tmp_path / "tpm", ek_ca)
    tpm = Swtpm(tmp_path / "tpm").start()
    (tmp_path / "etc").mkdir()
    (tmp_path / "bundle.pem").write_bytes(env.srv.bundle)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"name": pool, **PROFILE}))
    staged = {}
    for version in ("1.34.2", "1.35.3"):
        for package in PACKAGES:
            _deb(
                tmp_path / "staged" / version,
                package,
                f"{version}-1.1",
                {f"/usr/bin/{package}": b"#!/bin/sh\n"},
            )
        staged[version] = f"{tmp_path / 'staged' / version}/"
    image = {"installed": "1.36.3", "staged": list(staged), "staged_paths": staged}
    (tmp_path / "image.json").write_text(json.dumps({"build_id": "t", "kubernetes": image}))
    apt = tmp_path / "packages.json"
    install_apt_double(tmp_path / "bin", apt, {p: "1.36.3-1.1" for p in PACKAGES})
    install_kubeadm_double(tmp_path / "bin", tmp_path / "kubeadm-calls.jsonl")
    return Node(env, tpm, tmp_path, pool, apt)


@pytest.fixture
def node(env: JoinEnv, ek_ca: LocalCa, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    made = _node(env, ek_ca, tmp_path, request.param)
    yield made
    made.tpm.stop()


@pytest.mark.parametrize("node", ["on135"], indirect=True)
def test_a_pool_on_1_35_gets_a_node_whose_kubelet_is_1_35_when_kubeadm_runs(node: Node) -> None:
    joined = node.run("-v", "run")
    assert joined.returncode == 0, joined.stderr
    # the staged 1.35.3 debs were installed offline and held before kubeadm ran
    packages = load(node.apt)["packages"]
    assert {p: (v["version"], v["held"]) for p, v in packages.items()} == {
        p: ("1.35.3-1.1", True) for p in PACKAGES
    }
    order = [
        c[0] if c[0] != "apt-get" else ("simulate" if "--simulate" in c else "install")
        for c in load(node.apt)["calls"]
    ]
    assert order.index("simulate") < order.index("install")
    assert len(node.kubeadm_calls()) == 1
    assert "installing the staged Kubernetes 1.35.3" in joined.stderr
    # the state, the status and its JSON say which version the node runs
    assert json.loads((node.dir / "state" / "state.json").read_text())["kubernetes_version"] == "1.35.3"
    assert "kubernetes: 1.35.3 (the join answer's, installed and held)" in node.run("status").stdout
    assert json.loads(node.run("status", "--json").stdout)["kubernetes_version"] == "1.35.3"
    # the pool's verdict (recomputed by the server) judged the kubelet that runs, with node.kubelet fatal:
    # the installed 1.36.3 is newer than the pool's control plane 1.35 and would have been refused
    check = json.loads(node.run("check", "--json").stdout)
    kubelet = next(c for c in check["checks"] if c["name"] == "node.kubelet")
    assert kubelet["status"] == "pass" and kubelet["observations"]["will_run"] == "1.35.3", kubelet


@pytest.mark.parametrize("node", ["on133"], indirect=True)
def test_a_version_the_image_does_not_carry_is_refused_without_installing_anything(node: Node) -> None:
    refused = node.run("run")
    assert refused.returncode == 12, (
        refused.stderr
    )  # join_config_invalid: permanent, systemd does not restart
    assert "asks for Kubernetes 1.33.1; this image carries only 1.34.2, 1.35.3, 1.36.3" in refused.stderr
    assert [c for c in load(node.apt)["calls"] if c[0] in ("apt-get", "apt-mark")] == []
    assert {v["version"] for v in load(node.apt)["packages"].values()} == {"1.36.3-1.1"}
    assert node.kubeadm_calls() == []
    doc = json.loads(node.run("status", "--json").stdout)
    assert (
        doc["last_error"]["exit_class"] == "join_config_invalid" and doc["last_error"]["permanent"] is True
    )
    assert doc["kubernetes_version"] is None
