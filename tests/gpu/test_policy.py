"""Pool profiles: presets, strict parsing with clear messages, and the agent's loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.errors import PoolProfileError
from agent.pool import load_pool
from protocol.errors import PolicyError
from protocol.policy import (
    PRESETS,
    MigPolicy,
    PoolPolicy,
    Taint,
    policy_from_mapping,
    policy_to_mapping,
    preset,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "pools").glob("*.yaml"))


def test_presets_from_the_seed_requirements() -> None:
    gpu_taint = (Taint("nvidia.com/gpu", "NoSchedule"),)
    assert set(PRESETS) == {
        "nvke",
        "lepton-byok",
        "domino",
        "cpu",
        "domino-platform",
        "domino-compute",
        "domino-gpu",
    }
    assert PRESETS["nvke"].taints == gpu_taint
    lepton = PRESETS["lepton-byok"]
    assert lepton.taints == gpu_taint and lepton.allowed_taint_keys == frozenset({"nvidia.com/gpu"})
    assert lepton.kubelet_skew_required
    assert (
        lepton.severity("node.time_sync").value == "fatal"
        and lepton.severity("node.kubelet").value == "fatal"
    )
    domino = PRESETS["domino"]
    assert domino.label_map == {"dominodatalab.com/node-pool": "default-gpu", "nvidia.com/gpu": "true"}
    assert domino.severity("node.time_sync").value == "fatal" and domino.taints == ()
    assert PRESETS["cpu"].gpu_count == 0
    assert str(gpu_taint[0]) == "nvidia.com/gpu:NoSchedule"


def test_the_domino_preset_set() -> None:
    """Domino's platform, compute and GPU pools, with the labels its hardware tiers select and the GPU taint."""
    platform, compute, gpu = (PRESETS[f"domino-{n}"] for n in ("platform", "compute", "gpu"))
    assert platform.label_map == {"dominodatalab.com/node-pool": "platform"} and platform.gpu_count == 0
    assert compute.label_map == {"dominodatalab.com/node-pool": "default"} and compute.gpu_count == 0
    assert gpu.label_map == {"dominodatalab.com/node-pool": "default-gpu", "nvidia.com/gpu": "true"}
    assert [str(t) for t in gpu.taints] == ["nvidia.com/gpu=true:NoSchedule"] and gpu.gpu_count is None
    assert platform.taints == compute.taints == ()
    assert all(p.severity("node.time_sync").value == "fatal" for p in (platform, compute, gpu))


def test_full_profile() -> None:
    policy = policy_from_mapping(
        {
            "name": "h200",
            "preset": "nvke",
            "gpu": {
                "model": "NVIDIA H200",
                "count": 8,
                "min_driver": "570.86.15",
                "min_cuda": "12.8",
                "mig": "disabled",
                "fabric_required": True,
                "persistence_required": True,
                "nvlink_count": 18,
            },
            "node": {"control_plane_version": "v1.31.4", "min_free_disk_gib": 50},
            "checks": {"fatal": ["node.time_sync"], "warn": ["gpu.pcie"]},
            "join": {
                "labels": {"example.com/pool": "h200"},
                "taints": [{"key": "example.com/x", "effect": "NoExecute"}],
            },
        }
    )
    assert policy.gpu_count == 8 and policy.mig is MigPolicy.DISABLED and policy.fabric_required is True
    assert policy.nvlink_count == 18
    assert policy.severity("node.time_sync").value == "fatal" and policy.severity("gpu.pcie").value == "warn"
    assert policy.taints == (Taint("example.com/x", "NoExecute"),)
    assert policy.label_map == {"example.com/pool": "h200"}
    assert policy_from_mapping(policy_to_mapping(policy)) == policy


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "p", "gpus": {}}, "unknown key 'gpus'; allowed: name, preset"),
        ({"name": "p", "gpu": {"modle": "x"}}, "unknown key gpu.modle; allowed in gpu: model, count"),
        ({"name": "p", "gpu": {"count": "8"}}, "gpu.count: expected an integer, got str '8'"),
        ({"name": "p", "gpu": {"count": True}}, "gpu.count: expected an integer, got bool"),
        (
            {"name": "p", "gpu": {"min_cuda": 12.8}},
            "gpu.min_cuda: expected a string, got float 12.8 (quote version",
        ),
        (
            {"name": "p", "gpu": {"min_driver": "570"}},
            "gpu.min_driver: '570' is not a version like 570.124.06",
        ),
        ({"name": "p", "gpu": {"mig": "off"}}, "gpu.mig: 'off' is not one of disabled, enabled, any"),
        ({"name": "p", "gpu": {"count": -1}}, "gpu.count: must be 0"),
        (
            {"name": "p", "gpu": {"nvlink_count": "18"}},
            "gpu.nvlink_count: expected an integer, got str '18'",
        ),
        ({"name": "p", "gpu": {"nvlink_count": True}}, "gpu.nvlink_count: expected an integer, got bool"),
        ({"name": "p", "gpu": {"nvlink_count": 0}}, "gpu.nvlink_count: must be 1 to 36"),
        ({"name": "p", "gpu": {"nvlink_count": 37}}, "gpu.nvlink_count: must be 1 to 36"),
        ({"name": "p", "gpu": {"nvlinks": 18}}, "unknown key gpu.nvlinks; allowed in gpu: model, count"),
        ({"name": "p", "gpu": []}, "gpu: expected a mapping with keys model, count"),
        (
            {"name": "p", "node": {"control_plane_version": "latest"}},
            "is not a version like 1.31 or v1.31.4",
        ),
        ({"name": "p", "checks": {"fatal": ["gpu.nope"]}}, "checks.fatal: 'gpu.nope' names no check"),
        (
            {"name": "p", "checks": {"fatal": ["gpu.mig"], "warn": ["gpu.mig"]}},
            "gpu.mig listed as both fatal and warn",
        ),
        ({"name": "p", "join": {"labels": {"bad key!": "x"}}}, "'bad key!' is not a valid label key"),
        (
            {"name": "p", "join": {"labels": {"a": 1}}},
            "join.labels.a: expected a string value, got int 1 (quote it)",
        ),
        (
            {"name": "p", "join": {"taints": ["nvidia.com/gpu:Never"]}},
            "effect 'Never' is not one of NoSchedule",
        ),
        ({"name": "p", "join": {"taints": ["nvidia.com/gpu"]}}, "has no effect; write key[=value]:Effect"),
        ({"name": "Pool_1"}, "name: 'Pool_1' must be a lower-case DNS name"),
        ({"gpu": {}}, "name: '' must be a lower-case DNS name (required unless a preset gives one)"),
        (
            {"preset": "gke"},
            "unknown preset 'gke'; presets: cpu, domino, domino-compute, domino-gpu, domino-platform, lepton-byok, nvke",
        ),
        (
            {
                "preset": "lepton-byok",
                "join": {"taints": ["nvidia.com/gpu:NoSchedule", "dedicated=ml:NoSchedule"]},
            },
            "join.taints: dedicated=ml:NoSchedule not allowed in a lepton-byok pool (allowed keys: nvidia.com/gpu)",
        ),
        ([], "a pool profile must be a mapping"),
    ],
)
def test_bad_profiles_say_which_key_and_what_is_expected(data: Any, message: str) -> None:
    with pytest.raises(PolicyError) as err:
        policy_from_mapping(data)
    assert message in str(err.value)


def test_profile_overrides_preset_severity() -> None:
    policy = policy_from_mapping({"preset": "domino", "checks": {"warn": ["node.time_sync"]}})
    assert policy.severity("node.time_sync").value == "warn"
    assert policy.name == "domino"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_profiles_load_and_round_trip(path: Path) -> None:
    policy = load_pool(str(path))
    assert isinstance(policy, PoolPolicy)
    assert policy_from_mapping(policy_to_mapping(policy)) == policy
    assert policy == policy_from_mapping(yaml.safe_load(path.read_text()))


def test_loader_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "pool.yaml"
    bad.write_text("name: p\ngpu:\n  count: eight\n")
    with pytest.raises(PoolProfileError) as err:
        load_pool(str(bad))
    assert str(bad) in err.value.message and "gpu.count: expected an integer" in err.value.message
    assert err.value.exit_code == 2
    bad.write_text("name: [unclosed\n")
    with pytest.raises(PoolProfileError, match="not valid YAML"):
        load_pool(str(bad))
    with pytest.raises(PoolProfileError, match="cannot read pool profile"):
        load_pool(str(tmp_path / "missing.yaml"))
    with pytest.raises(PoolProfileError, match="unknown preset 'h100'"):
        load_pool("h100")
    assert load_pool("nvke") == preset("nvke")
