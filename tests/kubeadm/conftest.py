"""kubeadm-join fixtures: the kubeadm test double on a private PATH, and a valid set of join inputs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.kubeadm_double import install_kubeadm_double

TOKEN = "abcdef.0123456789abcdef"
SECRET = "0123456789abcdef"
CA_HASH = "sha256:" + "0f" * 32


def join_inputs(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "token": TOKEN,
        "api_server_endpoint": "10.0.0.10:6443",
        "ca_cert_hashes": [CA_HASH],
        "node_name": "gpu-node-01",
        "taints": [
            ("nodetrust.io/validating", "", "NoSchedule"),
            ("nvidia.com/gpu", "present", "NoSchedule"),
        ],
        "labels": {"nodetrust.io/pool": "h200", "node.kubernetes.io/instance-type": "hgx-h200"},
        "kubelet_extra_args": [("max-pods", "110")],
    }
    base.update(overrides)
    return base


Installer = Callable[..., Path]


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "kubeadm-calls.jsonl"


@pytest.fixture
def kubeadm_double(tmp_path: Path, record: Path, monkeypatch: pytest.MonkeyPatch) -> Installer:
    """Install the double as ``kubeadm`` in a private bin folder put first on PATH; return its path."""
    bin_dir = tmp_path / "bin"

    def install(**kwargs: Any) -> Path:
        path = install_kubeadm_double(bin_dir, record, **kwargs)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        return path

    return install


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog
