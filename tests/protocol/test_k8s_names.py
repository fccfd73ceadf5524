"""Kubernetes names (protocol.k8s): full matches only; a trailing newline is never part of a valid name."""

from __future__ import annotations

import pytest

from protocol.errors import PolicyError
from protocol.k8s import Taint, label_key_ok, label_value_ok, node_name_problem, parse_labels, parse_taints


@pytest.mark.parametrize("name", ["node-b", "gpu-node-01.rack7.example", "a", "0", "a" * 63])
def test_valid_node_names(name: str) -> None:
    assert node_name_problem(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "node-b\n",  # issue 11: got a token
        "node-b\r\n",
        "\nnode-b",
        "node-b.\nrack7",
        "node-b\nrack7",
        "node-b ",
        "Node-B",
        "-node",
        "node-",
        "node..b",
        "",
        "a" * 64,
        "n\u00f6de",
        "node_b",
    ],
)
def test_invalid_node_names(name: str) -> None:
    assert node_name_problem(name) is not None


@pytest.mark.parametrize("value", ["h200\n", "\nh200", "h200\r"])
def test_label_keys_and_values_refuse_a_newline(value: str) -> None:
    assert label_value_ok("h200") and not label_value_ok(value)
    assert label_key_ok("nodetrust.dev/pool") and not label_key_ok(f"nodetrust.dev/{value}")
    assert not label_key_ok("nodetrust.dev\n/pool")
    with pytest.raises(PolicyError, match="not a valid label"):
        parse_labels({"nodetrust.dev/pool": value})
    with pytest.raises(PolicyError, match="not a valid taint"):
        parse_taints([f"nodetrust.dev/gpu={value}:NoSchedule"])


def test_taints() -> None:
    assert parse_taints(["nodetrust.dev/gpu=h200:NoSchedule", {"key": "k", "effect": "NoExecute"}]) == (
        Taint("nodetrust.dev/gpu", "NoSchedule", "h200"),
        Taint("k", "NoExecute"),
    )
    with pytest.raises(PolicyError, match="effect 'NoSchedule\\\\n'"):
        parse_taints(["k=v:NoSchedule\n"])
