"""Defect 5: a KubeletConfiguration handed out through the kubelet-config ConfigMap must survive kubeadm.

kubeadm marshals the cluster's KubeletConfiguration into the ConfigMap with empty lists left out, so
``enforceNodeAllocatable: []`` arrives as "unset", the kubelet defaults it to ``[pods]``, and with
``cgroupsPerQOS: false`` refuses to start. These tests put configurations through the real kubeadm's
upload (dry run) and give what arrives to the real kubelet's own validation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.control_plane import KUBELET_CONFIG, ControlPlane
from tests.support.kubelet_config import kubelet_verdict, lost_in_round_trip, round_trip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kubelet-config")


def test_the_clusters_kubelet_configuration_survives_and_the_kubelet_accepts_it(
    control_plane: ControlPlane, work: Path
) -> None:
    """What the test control plane (and `make cluster`, `make demo`) hands every joining kubelet."""
    received = round_trip(control_plane, KUBELET_CONFIG, work / "cluster")
    assert lost_in_round_trip(KUBELET_CONFIG, received) == {}
    accepted, output = kubelet_verdict(received, work / "cluster-kubelet")
    assert accepted, output


def test_an_empty_enforce_node_allocatable_does_not_survive_and_stops_the_kubelet(
    control_plane: ControlPlane, work: Path
) -> None:
    broken = {**KUBELET_CONFIG, "enforceNodeAllocatable": []}
    received = round_trip(control_plane, broken, work / "empty")
    assert lost_in_round_trip(broken, received) == {"enforceNodeAllocatable": ([], None)}
    # The same file with the list kept is fine for the kubelet: it is the round trip that breaks it.
    assert kubelet_verdict(broken, work / "empty-as-sent")[0] is True
    accepted, output = kubelet_verdict(received, work / "empty-as-received")
    assert accepted is False
    assert "cgroupsPerQOS (--cgroups-per-qos) must be set to true" in output
