"""GPU-tier fixtures: the NVML test double, built once per session, and case preparation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.harness import Prepared, load_case, prepare, require
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
