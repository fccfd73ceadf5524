"""The rules and the verdict, on the real agent's observations with one thing changed at a time.

The server recomputes every status from the observations, so these tests also
show what a tampered or truncated report gets: the statuses an agent writes
count for nothing.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.policy import PRESETS, PoolPolicy, assess, evaluate, evaluate_checks, policy_from_mapping
from protocol.report import Check, Observation, Report, Status, Verdict, canonical_json, parse_report
from protocol.rules import CHECK_NAMES, PER_GPU_CHECKS, RULES
from tests.gpu.harness import load_case, prepare, run_check

# Collectors run programs (journalctl, containerd, kubelet) or the agent itself through agent.proc.
pytestmark = pytest.mark.subprocess

Mutator = Callable[[dict[str, Any]], None]


def observations(report: Report) -> list[Observation]:
    return [Observation(c.name, c.source, copy.deepcopy(dict(c.observations))) for c in report.checks]


def changed(report: Report, name: str, fn: Mutator) -> list[Observation]:
    out = observations(report)
    for o in out:
        if o.name == name:
            data = dict(o.observations)
            fn(data)
            out[out.index(o)] = Observation(o.name, o.source, data)
    return out


def verdict_of(obs: list[Observation], policy: PoolPolicy) -> tuple[dict[str, Check], Verdict]:
    checks, verdict = assess(obs, policy)
    return {c.name: c for c in checks}, verdict


def failures(verdict: Verdict) -> dict[str, str]:
    return {f.check: f.reason for f in verdict.failures}


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = data["gpus"]
    return result


def test_healthy_observations_pass(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    checks, verdict = verdict_of(observations(healthy_report), h200_policy)
    assert verdict.passed
    assert checks["gpu.xid"].status is Status.PASS
    assert "application XIDs: Xid 13" in checks["gpu.xid"].observed


def test_every_rule_has_a_name_source_and_pass_condition() -> None:
    assert len(CHECK_NAMES) == len(set(CHECK_NAMES)) == len(RULES)
    for rule in RULES:
        assert rule.source and rule.passes_when


def test_tampered_statuses_and_verdict_are_ignored(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def unsupported_link(d: dict[str, Any]) -> None:
        rows(d)[0]["curr_width"] = 4

    bad_checks, bad_verdict = assess(changed(healthy_report, "gpu.pcie", unsupported_link), h200_policy)
    assert not bad_verdict.passed
    # The agent lies: every status pass, verdict passed.
    forged = replace(
        healthy_report,
        checks=tuple(replace(c, status=Status.PASS, reason="") for c in bad_checks),
        verdict=Verdict(passed=True),
    )
    received = parse_report(canonical_json(forged))
    verdict = evaluate(received, h200_policy)
    assert not verdict.passed
    assert "link trained to x4, capable of x16" in failures(verdict)["gpu.pcie"]


def test_missing_check_fails_that_check(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    truncated = replace(
        healthy_report, checks=tuple(c for c in healthy_report.checks if c.name != "gpu.ecc.errors")
    )
    assert failures(evaluate(truncated, h200_policy)) == {
        "gpu.ecc.errors": "the report has no result for this check"
    }


def test_dependency_missing_fails_dependants(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    truncated = replace(
        healthy_report, checks=tuple(c for c in healthy_report.checks if c.name != "gpu.nvml.devices")
    )
    f = failures(evaluate(truncated, h200_policy))
    assert f["gpu.nvml.devices"] == "the report has no result for this check"
    assert "gpu.nvml.devices is missing from the report" in f["gpu.ecc.mode"]


def test_malformed_observations_fail_the_check(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def wrong_type(d: dict[str, Any]) -> None:
        rows(d)[3]["current"] = "1"

    _, verdict = verdict_of(changed(healthy_report, "gpu.ecc.mode", wrong_type), h200_policy)
    assert failures(verdict) == {
        "gpu.ecc.mode": "observations malformed: gpu.ecc.mode.gpus[3].current: expected an integer"
    }


def test_per_gpu_rows_must_cover_the_reachable_gpus(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def drop_one(d: dict[str, Any]) -> None:
        del rows(d)[5]

    _, verdict = verdict_of(changed(healthy_report, "gpu.memory", drop_one), h200_policy)
    assert "are not the GPUs NVML reaches" in failures(verdict)["gpu.memory"]


def test_unknown_check_only_warns(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    obs = [*observations(healthy_report), Observation("gpu.future_check", "somewhere", {})]
    _, verdict = verdict_of(obs, h200_policy)
    assert verdict.passed
    assert ("gpu.future_check", "unknown check, not evaluated by this version") in [
        (w.check, w.reason) for w in verdict.warnings
    ]


def _thermal_slowdown(d: dict[str, Any]) -> None:
    rows(d)[1]["clocks_event_reasons"] = 0x41
    rows(d)[1]["temperature_c"] = 91


def test_severity_defaults_and_overrides(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    obs = changed(healthy_report, "gpu.thermal", _thermal_slowdown)
    checks, verdict = verdict_of(obs, h200_policy)
    assert verdict.passed and checks["gpu.thermal"].status is Status.WARN
    assert "91 °C, hardware thermal slowdown" in checks["gpu.thermal"].observed
    strict = replace(h200_policy, fatal=h200_policy.fatal | {"gpu.thermal"})
    _, verdict = verdict_of(obs, strict)
    assert failures(verdict) == {
        "gpu.thermal": "GPU 1 (0000:2a:00.0): clocks held back: hardware thermal slowdown"
    }
    lenient = replace(h200_policy, warn=h200_policy.warn | {"gpu.*"})

    def pending(d: dict[str, Any]) -> None:
        rows(d)[0]["remapped_rows"]["pending"] = 1

    _, verdict = verdict_of(changed(healthy_report, "gpu.memory", pending), lenient)
    assert verdict.passed and [w.check for w in verdict.warnings if w.check.startswith("gpu.")] == [
        "gpu.memory"
    ]


def test_exact_name_beats_pattern() -> None:
    policy = PoolPolicy(name="p", warn=frozenset({"gpu.*"}), fatal=frozenset({"gpu.memory"}))
    assert policy.severity("gpu.memory").value == "fatal"
    assert policy.severity("gpu.ecc.mode").value == "warn"
    assert policy.severity("node.swap").value == "fatal"
    assert policy.severity("node.time_sync").value == "warn"


def test_count_model_and_cpu_pool(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    obs = observations(healthy_report)
    f = failures(verdict_of(obs, replace(h200_policy, gpu_count=4))[1])
    assert f == {"gpu.pci.inventory": "found 8 NVIDIA GPUs on the PCI bus, the pool expects 4"}
    f = failures(verdict_of(obs, replace(h200_policy, gpu_model="NVIDIA B200"))[1])
    assert f["gpu.model"].startswith("GPU 0 (0000:18:00.0): is NVIDIA H200, the pool expects NVIDIA B200")
    assert verdict_of(obs, replace(h200_policy, gpu_count=None, gpu_model=None))[1].passed
    cpu = replace(PRESETS["cpu"], warn=frozenset({"node.container_runtime", "node.kubelet"}))
    f = failures(verdict_of(obs, cpu)[1])
    assert f == {"gpu.pci.inventory": "found 8 NVIDIA GPUs but the pool expects none"}


def test_fabric_required_follows_nvswitches_when_unset(
    healthy_report: Report, h200_policy: PoolPolicy
) -> None:
    def not_started(d: dict[str, Any]) -> None:
        for r in rows(d):
            r["state"] = 1

    obs = changed(healthy_report, "gpu.fabric", not_started)
    auto = replace(h200_policy, fabric_required=None)
    assert "fabric training not started" in failures(verdict_of(obs, auto)[1])["gpu.fabric"]

    def no_switches(d: dict[str, Any]) -> None:
        d["functions"] = [f for f in d["functions"] if f["class"] != "0x068000"]

    fabric = {o.name: o for o in changed(healthy_report, "gpu.fabric", not_started)}["gpu.fabric"]
    obs = [
        fabric if o.name == "gpu.fabric" else o
        for o in changed(healthy_report, "gpu.pci.inventory", no_switches)
    ]
    checks, verdict = verdict_of(obs, auto)
    assert verdict.passed and checks["gpu.fabric"].status is Status.WARN


@pytest.mark.parametrize(
    ("cuda", "minimum", "ok"),
    [(12080, "12.8", True), (12040, "12.8", False), (13000, "12.8", True), (12090, "12.10", False)],
)
def test_cuda_versions_compare_numerically(
    healthy_report: Report, h200_policy: PoolPolicy, cuda: int, minimum: str, ok: bool
) -> None:
    def set_cuda(d: dict[str, Any]) -> None:
        d["cuda_driver_version"] = cuda

    obs = changed(healthy_report, "gpu.cuda.version", set_cuda)
    checks, _ = verdict_of(obs, replace(h200_policy, min_cuda_version=minimum))
    assert (checks["gpu.cuda.version"].status is Status.PASS) is ok


@pytest.mark.parametrize(
    ("minimum", "ok"), [("570.86.15", True), ("570.124.06", True), ("570.124.7", False), ("575.0", False)]
)
def test_driver_versions_compare_numerically(
    healthy_report: Report, h200_policy: PoolPolicy, minimum: str, ok: bool
) -> None:
    checks, _ = verdict_of(observations(healthy_report), replace(h200_policy, min_driver_version=minimum))
    assert (checks["gpu.driver.version"].status is Status.PASS) is ok


@pytest.mark.parametrize(
    ("xids", "status"),
    [([13, 31, 43, 45, 68, 109], Status.PASS), ([48], Status.FAIL), ([13, 94], Status.FAIL)],
)
def test_xid_ignore_list(
    healthy_report: Report, h200_policy: PoolPolicy, xids: list[int], status: Status
) -> None:
    def events(d: dict[str, Any]) -> None:
        d["events"] = [{"address": "0000:18:00", "xid": x, "count": 2, "message": "m"} for x in xids]

    checks, _ = verdict_of(changed(healthy_report, "gpu.xid", events), h200_policy)
    assert checks["gpu.xid"].status is status


def test_unreadable_kernel_log_warns(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def unreadable(d: dict[str, Any]) -> None:
        d["events"], d["error"] = [], "/dev/kmsg: Operation not permitted"

    checks, verdict = verdict_of(changed(healthy_report, "gpu.xid", unreadable), h200_policy)
    assert verdict.passed and checks["gpu.xid"].status is Status.WARN


PER_GPU = (
    "gpu.model",
    "gpu.identity",
    "gpu.pcie",
    "gpu.ecc.mode",
    "gpu.ecc.errors",
    "gpu.memory",
    "gpu.persistence_mode",
    "gpu.mig",
    "gpu.thermal",
    "gpu.fabric",
    "gpu.inforom",
    "gpu.recovery_action",
    "gpu.nvlink",
    "gpu.processes",
)


def test_per_gpu_list_matches_the_agent() -> None:
    from agent.gpu.observe import PER_GPU_CHECKS

    assert set(PER_GPU) == {name for name, _ in PER_GPU_CHECKS}


def test_lost_gpu_fails_once_with_a_hint(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def lost(d: dict[str, Any]) -> None:
        rows(d)[2]["error"] = "NVML_ERROR_GPU_IS_LOST"

    def without_gpu_2(d: dict[str, Any]) -> None:
        d["gpus"] = [r for r in rows(d) if r["index"] != 2]

    obs = changed(healthy_report, "gpu.nvml.devices", lost)
    by_name = {o.name: o for o in obs}
    for name in PER_GPU:
        data = copy.deepcopy(dict(by_name[name].observations))
        without_gpu_2(data)
        by_name[name] = Observation(name, by_name[name].source, data)
    f = failures(verdict_of(list(by_name.values()), h200_policy)[1])
    assert f == {
        "gpu.nvml.devices": "GPU 2 (0000:3a:00.0): NVML_ERROR_GPU_IS_LOST "
        "(the GPU is lost: reboot the node; replace the GPU if it recurs) "
        "(PCI GPUs NVML does not reach: 0000:3a:00.0)"
    }


def test_policy_from_every_preset_judges_the_healthy_node(healthy_report: Report) -> None:
    obs = observations(healthy_report)
    for name, policy in PRESETS.items():
        relaxed = replace(policy, warn=frozenset({"node.*"}), fatal=frozenset())
        _, verdict = verdict_of(obs, relaxed)
        # an 8-GPU node fails exactly the pools that expect none (gpu.count 0)
        assert verdict.passed is (policy.gpu_count != 0), (name, verdict.failures)
    assert (
        policy_from_mapping({"preset": "lepton-byok", "checks": {"warn": ["node.*"]}}).name == "lepton-byok"
    )


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=12,
)


@given(
    which=st.sampled_from(CHECK_NAMES),
    key=st.sampled_from(
        ["gpus", "functions", "events", "nodes", "modules", "values", "error", "count", "x"]
    ),
    value=_json,
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_observation_shape_gives_a_verdict(
    healthy_report: Report, h200_policy: PoolPolicy, which: str, key: str, value: Any
) -> None:
    """The server evaluates whatever a parseable report holds: odd shapes fail a check, never the server."""

    def scramble(d: dict[str, Any]) -> None:
        d[key] = value

    checks, verdict = verdict_of(changed(healthy_report, which, scramble), h200_policy)
    assert set(checks) == set(CHECK_NAMES)
    assert all(c.status in Status for c in checks.values())
    assert verdict.passed is not any(c.status is Status.FAIL for c in checks.values())


NEW_CHECKS = ("gpu.inforom", "gpu.recovery_action", "gpu.nvlink", "gpu.processes")


def test_report_of_an_agent_without_the_new_checks_fails_closed(
    healthy_report: Report, h200_policy: PoolPolicy
) -> None:
    """An older agent's report lacks the new observations: fatal ones fail, warn ones warn, as for any check."""
    old = replace(healthy_report, checks=tuple(c for c in healthy_report.checks if c.name not in NEW_CHECKS))
    verdict = evaluate(old, h200_policy)
    missing = "the report has no result for this check"
    assert failures(verdict) == {n: missing for n in NEW_CHECKS if n != "gpu.processes"}
    assert ("gpu.processes", missing) in [(w.check, w.reason) for w in verdict.warnings]


def test_a_cpu_pool_skips_per_gpu_checks_an_older_agent_did_not_report(
    nvml_double: Path, tmp_path: Path
) -> None:
    """On a pool that expects no GPU, a missing per-GPU check is a skip; any other missing check still fails."""
    cpu = replace(PRESETS["cpu"], warn=frozenset({"node.*"}), fatal=frozenset())
    assert cpu.gpu_count == 0
    run = run_check(prepare(load_case("no-gpu-cpu-pool"), tmp_path / "case"), nvml_double)
    report = run.report()
    assert evaluate(report, cpu).passed, failures(evaluate(report, cpu))
    old = replace(report, checks=tuple(c for c in report.checks if c.name not in NEW_CHECKS))
    checks = {c.name: c for c in evaluate_checks(old, cpu)}
    for name in NEW_CHECKS:
        assert checks[name].status is Status.SKIP, checks[name]
        assert "older agent" in checks[name].reason
    assert evaluate(old, cpu).passed
    # gpu.pci.inventory is what proves there is no GPU: without it the report still fails.
    blind = replace(old, checks=tuple(c for c in old.checks if c.name != "gpu.pci.inventory"))
    blind_failures = failures(evaluate(blind, cpu))
    assert blind_failures["gpu.pci.inventory"] == "the report has no result for this check"
    # A GPU pool never takes a missing check as a skip.
    gpu_pool = replace(cpu, gpu_count=8)
    assert {n for n in NEW_CHECKS if n != "gpu.processes"} <= set(failures(evaluate(old, gpu_pool)))


def test_per_gpu_checks_are_exactly_the_rules_judging_each_gpu() -> None:
    judged_per_gpu = {r.name for r in RULES if "_per_gpu(" in inspect.getsource(r.fn)}
    assert judged_per_gpu == PER_GPU_CHECKS


@pytest.mark.parametrize(
    ("error", "status", "fragment"),
    [
        (None, Status.PASS, ""),
        ("NVML_ERROR_CORRUPTED_INFOROM", Status.FAIL, "infoROM corrupted (NVML_ERROR_CORRUPTED_INFOROM)"),
        ("NVML_ERROR_UNKNOWN", Status.FAIL, "infoROM validation failed: NVML_ERROR_UNKNOWN"),
        ("NVML_ERROR_NOT_SUPPORTED", Status.SKIP, "infoROM validation is not supported"),
    ],
)
def test_inforom(
    healthy_report: Report, h200_policy: PoolPolicy, error: str | None, status: Status, fragment: str
) -> None:
    def set_error(d: dict[str, Any]) -> None:
        for r in rows(d):
            r["error"] = error if r["index"] == 3 or status is Status.SKIP else None

    check = verdict_of(changed(healthy_report, "gpu.inforom", set_error), h200_policy)[0]["gpu.inforom"]
    assert check.status is status
    assert fragment in check.reason
    if status is Status.FAIL:
        assert (
            check.reason.startswith("GPU 3 (0000:5d:00.0): ")
            and "reflashed or the board RMAed" in check.reason
        )
    if status is Status.SKIP:
        assert check.reason.startswith("8 GPUs: ")


@pytest.mark.parametrize(
    ("action", "name", "todo"),
    [
        (1, "GPU_RESET", "nvidia-smi -r -i 6"),
        (2, "NODE_REBOOT", "reboot the node"),
        (3, "DRAIN_P2P", "drain peer-to-peer"),
        (4, "DRAIN_AND_RESET", "drain the GPU's work, then reset it"),
        (99, "99", "an action this version does not know"),
    ],
)
def test_recovery_action_names_what_to_do(
    healthy_report: Report, h200_policy: PoolPolicy, action: int, name: str, todo: str
) -> None:
    def set_action(d: dict[str, Any]) -> None:
        rows(d)[6]["action"] = action

    f = failures(verdict_of(changed(healthy_report, "gpu.recovery_action", set_action), h200_policy)[1])
    assert list(f) == ["gpu.recovery_action"]
    reason = f["gpu.recovery_action"]
    assert reason.startswith(f"GPU 6 (0000:ba:00.0): the driver requests recovery action {name} ")
    assert todo in reason


@pytest.mark.parametrize(
    ("error", "field_error", "status"),
    [
        (None, "NVML_ERROR_NOT_SUPPORTED", Status.SKIP),
        (None, "NVML_ERROR_INVALID_ARGUMENT", Status.SKIP),
        ("NVML_ERROR_FUNCTION_NOT_FOUND", None, Status.SKIP),
        (None, "NVML_ERROR_UNKNOWN", Status.FAIL),
        ("NVML_ERROR_GPU_IS_LOST", None, Status.FAIL),
    ],
)
def test_recovery_action_unreadable(
    healthy_report: Report,
    h200_policy: PoolPolicy,
    error: str | None,
    field_error: str | None,
    status: Status,
) -> None:
    def unreadable(d: dict[str, Any]) -> None:
        for r in rows(d):
            r["action"], r["error"], r["field_error"] = None, error, field_error

    checks = verdict_of(changed(healthy_report, "gpu.recovery_action", unreadable), h200_policy)[0]
    assert checks["gpu.recovery_action"].status is status


def _links(d: dict[str, Any], index: int, down: list[int], count: int = 18) -> None:
    row = rows(d)[index]
    row["link_count"] = count
    row["links"] = [{"link": n, "state": 0 if n in down else 1, "error": None} for n in range(count)]


def test_nvlink_down_names_gpu_and_links(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    obs = changed(healthy_report, "gpu.nvlink", lambda d: _links(d, 2, [3, 11]))
    reason = failures(verdict_of(obs, h200_policy)[1])["gpu.nvlink"]
    assert reason.startswith("GPU 2 (0000:3a:00.0): NVLink 3, 11 inactive")
    assert "16 active links, the pool expects 18" in reason


def test_nvlink_count_from_the_pool(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    obs = observations(healthy_report)
    assert verdict_of(obs, h200_policy)[0]["gpu.nvlink"].status is Status.PASS
    f = failures(verdict_of(obs, replace(h200_policy, nvlink_count=12))[1])
    assert f["gpu.nvlink"].startswith("GPU 0 (0000:18:00.0): 18 active links, the pool expects 12")
    assert verdict_of(obs, replace(h200_policy, nvlink_count=None))[1].passed


def _no_nvlink(d: dict[str, Any]) -> None:
    for r in rows(d):
        r["link_count"], r["count_error"], r["links"] = None, "NVML_ERROR_NOT_SUPPORTED", []


def _no_switches(d: dict[str, Any]) -> None:
    d["functions"] = [f for f in d["functions"] if f["class"] != "0x068000"]


def test_gpu_without_nvlink_skips_unless_the_fabric_is_required(
    healthy_report: Report, h200_policy: PoolPolicy
) -> None:
    nvlink = {o.name: o for o in changed(healthy_report, "gpu.nvlink", _no_nvlink)}["gpu.nvlink"]
    pcie_only = [
        nvlink if o.name == "gpu.nvlink" else o
        for o in changed(healthy_report, "gpu.pci.inventory", _no_switches)
    ]
    auto = replace(h200_policy, fabric_required=None, nvlink_count=None)
    check = verdict_of(pcie_only, auto)[0]["gpu.nvlink"]
    assert check.status is Status.SKIP and check.reason == "8 GPUs: no NVLink (NVML_ERROR_NOT_SUPPORTED)"
    # NVSwitches on the bus make the fabric (and so NVLink) required.
    with_switches = changed(healthy_report, "gpu.nvlink", _no_nvlink)
    assert (
        "the pool requires the NVSwitch fabric" in failures(verdict_of(with_switches, auto)[1])["gpu.nvlink"]
    )
    # So does the profile, and so does an expected link count.
    required = replace(auto, fabric_required=True)
    assert "requires the NVSwitch fabric" in failures(verdict_of(pcie_only, required)[1])["gpu.nvlink"]
    counted = replace(auto, nvlink_count=4)
    assert "the pool expects 4 active links" in failures(verdict_of(pcie_only, counted)[1])["gpu.nvlink"]


def test_all_links_inactive_without_requirement_warns(
    healthy_report: Report, h200_policy: PoolPolicy
) -> None:
    def bridge_missing(d: dict[str, Any]) -> None:
        for i in range(8):
            _links(d, i, list(range(12)), count=12)

    nvlink = {o.name: o for o in changed(healthy_report, "gpu.nvlink", bridge_missing)}["gpu.nvlink"]
    obs = [
        nvlink if o.name == "gpu.nvlink" else o
        for o in changed(healthy_report, "gpu.pci.inventory", _no_switches)
    ]
    checks, verdict = verdict_of(obs, replace(h200_policy, fabric_required=None, nvlink_count=None))
    assert checks["gpu.nvlink"].status is Status.WARN and verdict.passed
    assert "no NVLink is active" in checks["gpu.nvlink"].reason


def test_nvlink_rows_must_match_their_count(healthy_report: Report, h200_policy: PoolPolicy) -> None:
    def short(d: dict[str, Any]) -> None:
        del rows(d)[1]["links"][-1]

    reason = failures(verdict_of(changed(healthy_report, "gpu.nvlink", short), h200_policy)[1])["gpu.nvlink"]
    assert reason.startswith("observations malformed:") and "17 links for a link count of 18" in reason


def _process(d: dict[str, Any]) -> None:
    rows(d)[0]["compute"] = [{"pid": 4242, "used_memory": 3 * 2**30}]
    rows(d)[0]["graphics"] = [{"pid": 77, "used_memory": None}]


def test_processes_warn_by_default_and_fail_when_the_pool_says(
    healthy_report: Report, h200_policy: PoolPolicy
) -> None:
    obs = changed(healthy_report, "gpu.processes", _process)
    checks, verdict = verdict_of(obs, h200_policy)
    assert verdict.passed and checks["gpu.processes"].status is Status.WARN
    assert checks["gpu.processes"].reason.startswith(
        "GPU 0 (0000:18:00.0): running: compute pid 4242 (3072 MiB), graphics pid 77 (memory unknown)"
    )
    for name in PRESETS:
        assert PRESETS[name].severity("gpu.processes").value == "warn"
    strict = policy_from_mapping(
        {"name": "strict", "preset": "nvke", "checks": {"fatal": ["gpu.processes"], "warn": ["node.*"]}}
    )
    assert list(failures(verdict_of(obs, replace(strict, gpu_count=8))[1])) == ["gpu.processes"]


def test_new_checks_default_severity() -> None:
    policy = PoolPolicy(name="p")
    assert [policy.severity(n).value for n in NEW_CHECKS] == ["fatal", "fatal", "fatal", "warn"]
    for name, preset_policy in PRESETS.items():
        assert [preset_policy.severity(n).value for n in NEW_CHECKS] == [
            "fatal",
            "fatal",
            "fatal",
            "warn",
        ], name
