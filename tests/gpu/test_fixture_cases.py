"""Every fixture machine gives the expected verdict and reasons, end to end.

Each case runs the real ``nodeagent check`` in a subprocess under umockdev (real
libudev on fake PCI devices) with the NVML test double loaded by the real pynvml,
then the server's path is replayed on the JSON it printed: ``parse_report`` and
``evaluate`` must reach the same verdict.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from protocol.policy import evaluate, policy_from_mapping
from protocol.report import Status, canonical_json
from protocol.rules import CHECK_NAMES
from tests.gpu.harness import case_names, load_case, prepare, run_check

pytestmark = pytest.mark.subprocess

REQUIRED_CASES = {
    "healthy-hgx-h200",
    "gpu-fallen-off-bus",
    "pending-row-remap",
    "degraded-pcie-link",
    "fabric-in-progress",
    "driver-too-old",
    "mig-forbidden",
    "no-gpu-gpu-pool",
    "no-gpu-cpu-pool",
    "inforom-corrupted",
    "recovery-node-reboot",
    "nvlink-down",
    "compute-process-running",
}


def test_every_fixture_from_the_issue_exists() -> None:
    assert set(case_names()) >= REQUIRED_CASES


@pytest.mark.parametrize("name", case_names())
def test_case_gives_expected_verdict(name: str, tmp_path: Path, nvml_double: Path) -> None:
    case = load_case(name)
    prepared = prepare(case, tmp_path)
    run = run_check(prepared, nvml_double)
    report = run.report()

    assert run.returncode == (0 if case.expect.passed else 1), run.stderr
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert report.verdict.passed is case.expect.passed

    failures = {f.check: f.reason for f in report.verdict.failures}
    assert set(failures) == set(case.expect.failures), failures
    for check, fragment in case.expect.failures.items():
        assert fragment in failures[check], f"{check}: {failures[check]!r} lacks {fragment!r}"

    gpu_warnings = {f.check: f.reason for f in report.verdict.warnings if f.check.startswith("gpu.")}
    assert set(gpu_warnings) == set(case.expect.warnings), gpu_warnings
    for check, fragment in case.expect.warnings.items():
        assert fragment in gpu_warnings[check]

    # The host's own environment may only warn, and only in the checks that read it.
    for f in report.verdict.warnings:
        if f.check.startswith("node."):
            assert f.check in {"node.time_sync", "node.container_runtime", "node.kubelet"}, f

    # The server's side: same bytes back, same verdict recomputed from the observations alone.
    assert canonical_json(report) == run.stdout.strip()
    policy = policy_from_mapping(yaml.safe_load(prepared.pool.read_text()))
    assert evaluate(report, policy) == report.verdict


def test_fallen_gpu_is_left_out_of_per_gpu_checks(tmp_path: Path, nvml_double: Path) -> None:
    report = run_check(prepare(load_case("gpu-fallen-off-bus"), tmp_path), nvml_double).report()
    pcie = report.check("gpu.pcie")
    assert pcie is not None and pcie.status is Status.PASS
    assert "not evaluated: GPU 3" in pcie.observed
    rows = pcie.observations["gpus"]
    assert isinstance(rows, list) and [r["index"] for r in rows if isinstance(r, dict)] == [
        0,
        1,
        2,
        4,
        5,
        6,
        7,
    ]


def test_cpu_pool_skips_every_gpu_check_with_a_reason(tmp_path: Path, nvml_double: Path) -> None:
    report = run_check(prepare(load_case("no-gpu-cpu-pool"), tmp_path), nvml_double).report()
    for c in report.checks:
        if c.name == "gpu.pci.inventory":
            assert c.status is Status.PASS
        elif c.name.startswith("gpu."):
            assert c.status is Status.SKIP and c.reason == "the pool expects no GPUs and none is present", c


def test_healthy_report_carries_identities_for_the_server(tmp_path: Path, nvml_double: Path) -> None:
    case = load_case("healthy-hgx-h200")
    prepared = prepare(case, tmp_path)
    report = run_check(prepared, nvml_double).report()
    identity = report.check("gpu.identity")
    assert identity is not None
    rows = identity.observations["gpus"]
    assert isinstance(rows, list)
    uuids = [r["uuid"] for r in rows if isinstance(r, dict)]
    expected = [
        line.split("=", 1)[1]
        for line in prepared.nvml.read_text().splitlines()
        if line.startswith("gpu.") and ".uuid=" in line
    ]
    assert uuids == expected and len(uuids) == 8
    assert report.hostname == "gpu-node-01"
    inventory = report.check("gpu.pci.inventory")
    assert inventory is not None and inventory.observed == "8 NVIDIA GPUs (10de:2335), 4 NVSwitches"


def test_table_output_names_the_reason(tmp_path: Path, nvml_double: Path) -> None:
    run = run_check(prepare(load_case("degraded-pcie-link"), tmp_path), nvml_double, as_json=False)
    text = run.stdout.decode()
    assert run.returncode == 1
    assert "FAIL    gpu.pcie" in text
    assert "link trained to x8, capable of x16" in text
    assert "verdict: FAIL" in text


def test_nvml_is_initialised_once_per_run(tmp_path: Path, nvml_double: Path) -> None:
    log = tmp_path / "calls.log"
    run = run_check(
        prepare(load_case("healthy-hgx-h200"), tmp_path / "case"),
        nvml_double,
        env={"NVML_DOUBLE_CALL_LOG": str(log)},
    )
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["nvmlInitWithFlags", "nvmlShutdown"]
