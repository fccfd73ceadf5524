"""Node-preflight fixtures: a copy of a healthy node's /proc, /sys/fs and /var to edit per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.host import Host

HEALTHY_ROOT = Path(__file__).resolve().parents[1] / "gpu" / "fixtures" / "cpu-node" / "root"


@pytest.fixture
def node_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(HEALTHY_ROOT, root, symlinks=True)
    return root


@pytest.fixture
def host(node_root: Path) -> Host:
    return Host(node_root)
