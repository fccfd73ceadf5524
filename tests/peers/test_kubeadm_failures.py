"""Defect 3: the agent judges a failed kubeadm join from its phase and error line, never from its warnings.

Each test makes the real kubeadm v1.36.3 fail the way nodes do, through the agent's own
``agent.kubeadm.kubeadm_join`` (the node of tests/support/kube_node.py: Debian's containerd 1.6, no
systemd), and checks the failure and hint the agent derived from that output. Every such run prints
kubeadm's preflight warnings (``ContainerRuntimeVersion``: "You must update your container runtime
...", ``Service-kubelet``); matching the whole output once turned them into the hint "the container
runtime is not answering". Timeouts that kubeadm would wait out for minutes are shortened in the
JoinConfiguration the test writes (``timeouts.discovery``, ``timeouts.kubernetesAPICall``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import KubeadmFailedError
from agent.kubeadm import KubeadmFailure, join_configuration, kubeadm_join, kubeadm_reset, write_join_config
from server.pools import ca_cert_hash
from server.tokens.kubernetes import KubernetesBackend
from server.tokens.token import BootstrapToken, new_token
from tests.support.control_plane import ControlPlane
from tests.support.kube_node import HostNode

NODE = "fail-node-1"


@pytest.fixture(scope="module")
def node(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostNode]:
    with HostNode.start(control_plane, tmp_path_factory.mktemp("kubeadm-failures"), NODE) as n:
        yield n
    control_plane.kubectl("delete", "node", NODE, "--ignore-not-found")


@pytest.fixture(scope="module")
def admin(control_plane: ControlPlane) -> KubernetesBackend:
    return KubernetesBackend.from_kubeconfig(control_plane.admin_kubeconfig, timeout=30)


@pytest.fixture(scope="module")
def token(admin: KubernetesBackend, control_plane: ControlPlane) -> BootstrapToken:
    made = new_token(ttl_s=1800, now=int(time.time()))
    admin.create(made)
    key = f"jws-kubeconfig-{made.token_id}"
    control_plane.wait_for(
        "the BootstrapSigner to sign cluster-info",
        lambda: (
            True
            if key
            in control_plane.kubectl_json("-n", "kube-public", "get", "configmap", "cluster-info")["data"]
            else None
        ),
    )
    return made


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


def _fail(
    cp: ControlPlane,
    node: HostNode,
    token: BootstrapToken,
    work: Path,
    *,
    pin: str | None = None,
    endpoint: str | None = None,
    timeouts: dict[str, str] | None = None,
) -> KubeadmFailedError:
    doc: dict[str, Any] = join_configuration(
        token=token.value,
        api_server_endpoint=endpoint or cp.endpoint,
        ca_cert_hashes=[pin or ca_cert_hash(cp.ca_cert.read_bytes())],
        node_name=NODE,
        taints=[],
        labels={"nodetrust.io/pool": "cpu"},
        cri_socket=node.cri_socket,
    )
    doc["timeouts"].update(timeouts or {})
    path = work / "kubeadm-join.yaml"
    write_join_config(path, doc)
    with pytest.raises(KubeadmFailedError) as exc:
        kubeadm_join(path, kubeadm=str(node.kubeadm))
    assert not path.exists()
    return exc.value


def _failure(exc: KubeadmFailedError) -> KubeadmFailure:
    assert isinstance(exc.failure, KubeadmFailure)
    return exc.failure


def _warned(logs: pytest.LogCaptureFixture) -> list[str]:
    """The preflight warnings in the output the agent logged: they were there, and changed nothing."""
    return [line.strip() for line in logs.text.splitlines() if line.strip().startswith("[WARNING ")]


def test_a_wrong_ca_pin(
    control_plane: ControlPlane,
    node: HostNode,
    token: BootstrapToken,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
) -> None:
    exc = _fail(control_plane, node, token, tmp_path, pin="sha256:" + "0" * 64)
    failure = _failure(exc)
    assert (failure.status, failure.phase, failure.node_untouched) == (1, "preflight", True)
    assert failure.error.startswith("couldn't validate the identity of the API Server: cluster CA found in ")
    assert "caCertHashes" in exc.hint
    assert any(w.startswith("[WARNING ContainerRuntimeVersion]") for w in _warned(logs))
    assert exc.message.startswith("kubeadm join exited with status 1 in phase preflight: couldn't validate")


def test_a_token_without_kubeadms_group_is_forbidden(
    control_plane: ControlPlane,
    node: HostNode,
    admin: KubernetesBackend,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
) -> None:
    """What a pool without kubeadm's group got before nodeserver always added it (defect 2)."""
    lonely = BootstrapToken(
        "nogrp1",
        "0123456789abcdef",
        int(time.time()) + 1800,
        extra_groups=("system:bootstrappers:nodetrust:hgx-h200",),
    )
    admin.create(lonely)
    try:
        control_plane.wait_for(
            "the BootstrapSigner to sign cluster-info",
            lambda: (
                True
                if "jws-kubeconfig-nogrp1"
                in control_plane.kubectl_json("-n", "kube-public", "get", "configmap", "cluster-info")[
                    "data"
                ]
                else None
            ),
        )
        exc = _fail(control_plane, node, lonely, tmp_path, timeouts={"kubernetesAPICall": "5s"})
    finally:
        admin.delete(lonely.token_id, "")
    failure = _failure(exc)
    assert (failure.phase, failure.node_untouched) == ("preflight", True)
    assert 'configmaps "kubeadm-config" is forbidden: User "system:bootstrap:nogrp1"' in failure.error
    assert "system:bootstrappers:kubeadm:default-node-token" in exc.hint
    assert "container runtime" not in exc.hint  # what the warning once made of it
    assert any(w.startswith("[WARNING ContainerRuntimeVersion]") for w in _warned(logs))


def test_an_unreachable_api_server(
    control_plane: ControlPlane, node: HostNode, token: BootstrapToken, tmp_path: Path
) -> None:
    exc = _fail(
        control_plane, node, token, tmp_path, endpoint="127.0.0.1:6449", timeouts={"discovery": "3s"}
    )
    failure = _failure(exc)
    assert (failure.phase, failure.node_untouched) == ("preflight", True)
    assert failure.error.endswith("dial tcp 127.0.0.1:6449: connect: connection refused")
    assert "unreachable" in exc.hint


def test_a_token_the_cluster_does_not_know(
    control_plane: ControlPlane, node: HostNode, tmp_path: Path
) -> None:
    unknown = new_token(ttl_s=600, now=int(time.time()))
    exc = _fail(control_plane, node, unknown, tmp_path, timeouts={"discovery": "3s"})
    failure = _failure(exc)
    assert failure.phase == "preflight"
    assert (
        f'could not find a JWS signature in the cluster-info ConfigMap for token ID "{unknown.token_id}"'
        in failure.error
    )
    assert "expired or was deleted" in exc.hint
    assert unknown.secret not in exc.message + exc.hint


def test_a_join_killed_after_kubelet_start_leaves_a_partial_join_that_reset_undoes(
    control_plane: ControlPlane,
    node: HostNode,
    token: BootstrapToken,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
) -> None:
    node.fault_kill_kubeadm_after_kubelet_start()
    killed = _failure(_fail(control_plane, node, token, tmp_path))
    assert (killed.status, killed.phase, killed.node_untouched) == (-9, None, False)
    assert (node.etc() / "kubernetes" / "bootstrap-kubelet.conf").is_file()

    # What every later try met before the agent undid its own partial joins: preflight, at once.
    again = _fail(control_plane, node, token, tmp_path)
    leftovers = _failure(again)
    assert leftovers.phase == "preflight" and leftovers.error == "preflight checks failed"
    assert leftovers.preflight_errors == (
        "FileAvailable--etc-kubernetes-bootstrap-kubelet.conf",
        "FileAvailable--etc-kubernetes-pki-ca.crt",
    )
    assert "kubeadm reset -f" in again.hint

    kubeadm_reset(kubeadm=str(node.kubeadm), cri_socket=node.cri_socket)
    assert not (node.etc() / "kubernetes" / "bootstrap-kubelet.conf").exists()
    assert not (node.etc() / "kubernetes" / "pki" / "ca.crt").exists()
    assert not (node.var() / "lib" / "kubelet" / "config.yaml").exists()
    assert node.kubeadm_calls()[-1][:4] == ["reset", "-f", "--cri-socket", node.cri_socket]
