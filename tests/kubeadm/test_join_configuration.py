"""The v1beta4 JoinConfiguration the agent renders: exact shape (reference §6.3) and refused inputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.errors import JoinConfigError, KubeadmError
from agent.kubeadm import join_configuration, write_join_config
from tests.kubeadm.conftest import CA_HASH, SECRET, TOKEN, join_inputs


def test_the_document_matches_the_reference() -> None:
    assert join_configuration(**join_inputs()) == {
        "apiVersion": "kubeadm.k8s.io/v1beta4",
        "kind": "JoinConfiguration",
        "discovery": {
            "bootstrapToken": {
                "token": TOKEN,
                "apiServerEndpoint": "10.0.0.10:6443",
                "caCertHashes": [CA_HASH],
                "unsafeSkipCAVerification": False,
            }
        },
        "nodeRegistration": {
            "name": "gpu-node-01",
            "criSocket": "unix:///run/containerd/containerd.sock",
            "taints": [
                {"key": "nodetrust.io/validating", "effect": "NoSchedule"},
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            ],
            "kubeletExtraArgs": [
                {"name": "max-pods", "value": "110"},
                {
                    "name": "node-labels",
                    "value": "node.kubernetes.io/instance-type=hgx-h200,nodetrust.io/pool=h200",
                },
            ],
        },
        "timeouts": {
            "discovery": "5m0s",
            "tlsBootstrap": "5m0s",
            "kubeletHealthCheck": "4m0s",
            "kubernetesAPICall": "1m0s",
        },
    }


def test_no_taints_is_an_explicit_empty_list_and_no_labels_no_arg(tmp_path: Path) -> None:
    doc = join_configuration(**join_inputs(taints=[], labels={}, kubelet_extra_args=[]))
    assert doc["nodeRegistration"]["taints"] == []
    assert doc["nodeRegistration"]["kubeletExtraArgs"] == []
    write_join_config(tmp_path / "join.yaml", doc)
    assert (
        "taints: []" in (tmp_path / "join.yaml").read_text()
    )  # [] = none; absent would mean kubeadm's defaults


def test_upper_case_hashes_are_normalised_and_several_are_kept() -> None:
    second = "sha256:" + "AB" * 32
    doc = join_configuration(**join_inputs(ca_cert_hashes=[CA_HASH, second]))
    assert doc["discovery"]["bootstrapToken"]["caCertHashes"] == [CA_HASH, second.lower()]


@pytest.mark.parametrize(
    "endpoint", ["10.0.0.10:6443", "api.cluster.example.org:6443", "[fd00::10]:6443", "API.Example.org:443"]
)
def test_good_endpoints(endpoint: str) -> None:
    assert (
        join_configuration(**join_inputs(api_server_endpoint=endpoint))["discovery"]["bootstrapToken"][
            "apiServerEndpoint"
        ]
        == endpoint
    )


@pytest.mark.parametrize(
    "label",
    [
        "kubernetes.io/arch",
        "node.kubernetes.io/instance-type",
        "kubelet.kubernetes.io/x",
        "topology.kubernetes.io/zone",
    ],
)
def test_labels_the_kubelet_may_set(label: str) -> None:
    join_configuration(**join_inputs(labels={label: "v"}))


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"token": "abcdef.0123456789ABCDEF"}, "bootstrap token is not of the form", "nodeserver"),
    ({"token": "abcdef0123456789abcdef"}, "bootstrap token", "nodeserver"),
    ({"token": ""}, "bootstrap token", "nodeserver"),
    ({"api_server_endpoint": "10.0.0.10"}, "not HOST:PORT", "nodeserver"),
    ({"api_server_endpoint": "10.0.0.10:0"}, "port must be 1..65535", "nodeserver"),
    ({"api_server_endpoint": "10.0.0.10:70000"}, "port must be", "nodeserver"),
    ({"api_server_endpoint": "bad_host:6443"}, "host must be", "nodeserver"),
    ({"api_server_endpoint": "[zz::1]:6443"}, "bad IPv6", "nodeserver"),
    ({"api_server_endpoint": "https://10.0.0.10:6443"}, "host must be", "nodeserver"),
    ({"ca_cert_hashes": []}, "no CA certificate hash", "CA pin"),
    ({"ca_cert_hashes": CA_HASH}, "no CA certificate hash", "CA pin"),
    ({"ca_cert_hashes": ["sha1:" + "0f" * 20]}, "is not sha256:<64 hex digits>", "nodeserver"),
    ({"ca_cert_hashes": ["sha256:" + "0f" * 31]}, "is not sha256", "nodeserver"),
    ({"node_name": "GPU-Node-01"}, "DNS-1123", "node_name"),
    ({"node_name": "gpu_node"}, "DNS-1123", "node_name"),
    ({"node_name": "-gpu"}, "DNS-1123", "node_name"),
    ({"node_name": "a" * 254}, "DNS-1123", "node_name"),
    ({"node_name": ""}, "DNS-1123", "node_name"),
    (
        {"taints": [("nvidia.com/gpu", "present", "NoScheduleAtAll")]},
        "effect 'NoScheduleAtAll'",
        "nodeserver",
    ),
    ({"taints": [("bad key!", "", "NoSchedule")]}, "qualified name", "nodeserver"),
    ({"taints": [("k", "x" * 64, "NoSchedule")]}, "label value", "nodeserver"),
    ({"taints": [("k", "NoSchedule")]}, "(key, value, effect)", "nodeserver"),
    ({"labels": {"Bad_Prefix.io/x": "1"}}, "qualified name", "nodeserver"),
    ({"labels": {"pool": "a,b=c"}}, "label value", "nodeserver"),
    ({"labels": {"node-role.kubernetes.io/worker": ""}}, "may not set label", "control plane"),
    ({"labels": {"k8s.io/anything": "x"}}, "may not set label", "control plane"),
    ({"kubelet_extra_args": [("node-labels", "a=b")]}, "node-labels is set from the labels", "nodeserver"),
    ({"kubelet_extra_args": [("--max-pods", "110")]}, "without dashes", "nodeserver"),
    ({"kubelet_extra_args": [("max-pods",)]}, "(name, value)", "nodeserver"),
    ({"cri_socket": "/run/containerd/containerd.sock"}, "unix:///", "cri_socket"),
    ({"cri_socket": "tcp://127.0.0.1:1"}, "unix:///", "cri_socket"),
]


@pytest.mark.parametrize(
    ("override", "message", "hint"), BAD, ids=[f"{i}-{next(iter(b[0]))}" for i, b in enumerate(BAD)]
)
def test_bad_inputs_are_refused_with_a_hint(override: dict[str, Any], message: str, hint: str) -> None:
    with pytest.raises(JoinConfigError) as exc:
        join_configuration(**join_inputs(**override))
    assert message in exc.value.message
    assert hint in exc.value.hint
    assert isinstance(exc.value, KubeadmError)
    assert exc.value.permanent


def test_a_malformed_token_is_not_echoed() -> None:
    near_miss = "abcdef.0123456789abcdeZ"
    with pytest.raises(JoinConfigError) as exc:
        join_configuration(**join_inputs(token=near_miss))
    assert "0123456789abcde" not in str(exc.value) + exc.value.hint


def test_write_join_config_is_0600_atomic_yaml(run_dir: Path) -> None:
    doc = join_configuration(**join_inputs())
    path = run_dir / "kubeadm-join.yaml"
    old = os.umask(0)
    try:
        write_join_config(path, doc)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        path.chmod(0o644)  # an old file with a bad mode is replaced by a private one
        write_join_config(path, doc)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == doc
    assert [p.name for p in run_dir.iterdir()] == ["kubeadm-join.yaml"]
    assert SECRET in path.read_text()  # the only place the secret is written


def test_write_join_config_into_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(KubeadmError, match=r"cannot write the join configuration"):
        write_join_config(tmp_path / "missing" / "join.yaml", join_configuration(**join_inputs()))
