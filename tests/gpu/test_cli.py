"""``nodeagent check`` on the machine running the tests (no fixture, no double) and its error paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.report import Status, parse_report

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parents[2]


def nodeagent(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("NODEAGENT_POOL_PROFILE", "LD_LIBRARY_PATH")
    }
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", *args],
        cwd=REPO,
        capture_output=True,
        env=full_env,
        timeout=120,
        check=False,
    )


def host_gpus() -> int:
    base = Path("/sys/bus/pci/devices")
    if not base.is_dir():
        return 0
    return sum(
        1
        for p in base.iterdir()
        if (p / "vendor").read_text().strip() == "0x10de"
        and (p / "class").read_text().strip().startswith(("0x0300", "0x0302"))
    )


def test_cpu_pool_here() -> None:
    """The devbox CPU profile passes on a machine without GPUs; on a GPU machine it fails on the inventory."""
    run = nodeagent("--pool", "examples/pools/cpu-devbox.yaml", "--json")
    report = parse_report(run.stdout.strip())
    inventory = report.check("gpu.pci.inventory")
    assert inventory is not None
    if host_gpus() == 0:
        assert run.returncode == 0, report.verdict
        assert inventory.status is Status.PASS
    else:
        assert run.returncode == 1
        assert inventory.status is Status.FAIL and "the pool expects none" in inventory.reason


def test_gpu_pool_here() -> None:
    run = nodeagent("--pool", "nvke")
    text = run.stdout.decode()
    if host_gpus() == 0:
        assert run.returncode == 1
        assert "FAIL    gpu.pci.inventory" in text
        assert "no NVIDIA GPU (vendor 0x10de, class 0x0300/0x0302) on the PCI bus" in text
        assert "verdict: FAIL" in text
    else:
        assert "gpu.nvml.init" in text and "skipped: no NVIDIA GPU" not in text


def test_bad_profile_exit_code_and_message(tmp_path: Path) -> None:
    pool = tmp_path / "pool.yaml"
    pool.write_text("name: p\ngpu:\n  modle: NVIDIA H200\n")
    run = nodeagent("--pool", str(pool))
    assert run.returncode == 2
    assert f"nodeagent: error: {pool}: unknown key gpu.modle; allowed in gpu: model" in run.stderr.decode()


def test_pool_from_environment_and_missing_pool() -> None:
    run = nodeagent("--json", env={"NODEAGENT_POOL_PROFILE": "examples/pools/cpu-devbox.yaml"})
    assert parse_report(run.stdout.strip()).pool == "cpu-devbox"
    if not Path("/etc/nodeagent/pool.yaml").exists():
        run = nodeagent()
        assert run.returncode == 2
        assert b"no pool given" in run.stderr


def test_cli_imports_no_native_module() -> None:
    code = (
        "import sys, agent.cli; agent.cli.build_parser(); "
        "print(' '.join(m for m in ('pynvml', 'pyudev') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == ""


def test_host_root_must_hold_proc(tmp_path: Path) -> None:
    run = nodeagent("--pool", "cpu", "--host-root", str(tmp_path / "absent"))
    assert run.returncode == 2 and b"is not a directory" in run.stderr
    run = nodeagent("--pool", "cpu", "--host-root", str(tmp_path))
    assert run.returncode == 7
    assert f"nodeagent: error: {tmp_path / 'proc'} does not exist".encode() in run.stderr
