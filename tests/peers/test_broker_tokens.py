"""The join broker with the ``kubernetes`` backend against the real API server: what its tokens may do.

A nodeserver (in a thread, SQLite store) with docs/join.md's GPU pool shape, whose ``extra_groups`` name
only the pool's own group, and the documented identity. A simulated TPM attests and asks to join; the
token it gets is then put to the real API server the way ``kubeadm join`` would use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.join_client import report_joined_async, token_id
from server.tokens.token import KUBEADM_NODE_GROUP
from tests.support.control_plane import ControlPlane
from tests.support.joinenv import CPU_POOL, JoinEnv, SimAgent, attest_sim, join, start_join_env
from tests.support.kube_identities import service_account
from tests.support.peers import KUBE_VERSION
from tests.support.simtpm import SimulatedTpm

POOL = "hgx-h200"
POOL_GROUP = "system:bootstrappers:nodetrust:hgx-h200"


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    work = tmp_path_factory.mktemp("broker")
    who = service_account(control_plane, "nodeserver-broker", work)
    e = start_join_env(
        work,
        cluster={
            "api_server_endpoint": control_plane.endpoint,
            "ca_cert": str(control_plane.ca_cert),
            "kubernetes_version": KUBE_VERSION,
        },
        token_backend={"type": "kubernetes", "kubeconfig": str(who.kubeconfig), "timeout": "30s"},
        pools={POOL: {"profile": CPU_POOL, "extra_groups": [POOL_GROUP]}},  # as docs/join.md shows it
    )
    yield e
    e.srv.stop()
    control_plane.kubectl(
        "-n", "kube-system", "delete", "secret", "-l", "app.kubernetes.io/managed-by=nodetrust"
    )


@pytest.fixture
def agent(env: JoinEnv, tmp_path: Path) -> SimAgent:
    return attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "agent")


def _secret_exists(cp: ControlPlane, tid: str) -> bool:
    got = cp.kubectl(
        "-n", "kube-system", "get", "secret", f"bootstrap-token-{tid}", "--ignore-not-found", "-o", "name"
    )
    return bool(got.stdout.strip())


def test_a_pool_token_carries_kubeadms_group_and_may_do_what_kubeadm_join_does(
    control_plane: ControlPlane, env: JoinEnv, agent: SimAgent
) -> None:
    """Defect 2: with only the pool's group, the token authenticated but kubeadm join was forbidden."""
    grant = join(env, agent, pool=POOL, node_name="gpu-node-01")
    status, review = control_plane.whoami(grant.token)
    assert status == 201, review
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:bootstrap:{token_id(grant.token)}"
    assert user["groups"] == ["system:bootstrappers", KUBEADM_NODE_GROUP, POOL_GROUP, "system:authenticated"]
    # What kubeadm join v1.36.3 does with the token before the kubelet has its own certificate.
    for name in ("kubeadm-config", "kubelet-config"):
        assert control_plane.may(
            grant.token, verb="get", resource="configmaps", namespace="kube-system", name=name
        )
    assert control_plane.may(grant.token, verb="get", resource="nodes")
    csr = {"group": "certificates.k8s.io", "resource": "certificatesigningrequests"}
    assert control_plane.may(grant.token, verb="create", **csr)
    assert control_plane.may(grant.token, verb="create", subresource="nodeclient", **csr)  # auto-approval
    # ... and nothing beyond it.
    assert not control_plane.may(grant.token, verb="get", resource="secrets", namespace="kube-system")
    assert not control_plane.may(grant.token, verb="create", resource="nodes")


def test_the_token_is_refused_once_the_node_reports_it_joined(
    control_plane: ControlPlane, env: JoinEnv, agent: SimAgent
) -> None:
    """Defect 4: a used token stayed valid for its whole lifetime."""
    grant = join(env, agent, pool=POOL, node_name="gpu-node-02")
    tid = token_id(grant.token)
    assert control_plane.whoami(grant.token)[0] == 201
    assert _secret_exists(control_plane, tid)

    revoked = asyncio.run(
        report_joined_async(
            env.join_address,
            trust_domain="example.org",
            bundle_pem=env.srv.bundle,
            svid_cert=agent.cert,
            svid_key=agent.key,
            token_id=tid,
            node_name="gpu-node-02",
        )
    )
    assert revoked is True
    assert not _secret_exists(control_plane, tid)  # deleted before ReportJoined answered
    # The bootstrap authenticator reads Secrets through a watch: once it has seen the delete, 401.
    control_plane.wait_for(
        "the API server to refuse the revoked token",
        lambda: True if control_plane.whoami(grant.token)[0] == 401 else None,
    )
    line = env.srv.audit_lines()[-1]
    assert (line["event"], line["reason"], line["token_id"]) == ("joined", "token_revoked", tid)
