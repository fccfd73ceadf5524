"""GPU-tier fixtures: the NVML test double, built once per session, and case preparation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from protocol.policy import PoolPolicy, policy_from_mapping
from protocol.report import Report
from tests.gpu.harness import POOLS, Prepared, load_case, prepare, require, run_check
from tests.nvml_double import build


@pytest.fixture(scope="session")
def nvml_double(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the NVML test double as libnvidia-ml.so.1."""
    require("gcc", "build-essential")
    require("umockdev-run", "umockdev")
    return build(tmp_path_factory.mktemp("nvml-test-double"))


@pytest.fixture
def prepared_case(tmp_path: Path) -> object:
    def _prepare(name: str) -> Prepared:
        return prepare(load_case(name), tmp_path / name)

    return _prepare


@pytest.fixture(scope="session")
def healthy_report(nvml_double: Path, tmp_path_factory: pytest.TempPathFactory) -> Report:
    """The report the real agent writes for the healthy HGX H200 fixture (rule tests mutate its observations)."""
    run = run_check(prepare(load_case("healthy-hgx-h200"), tmp_path_factory.mktemp("healthy")), nvml_double)
    assert run.returncode == 0, run.stderr
    return run.report()


@pytest.fixture(scope="session")
def h200_policy() -> PoolPolicy:
    return policy_from_mapping(yaml.safe_load((POOLS / "hgx-h200.yaml").read_text()))
