"""Tier 6, peers: one real control plane (etcd, kube-apiserver, kube-controller-manager) per test session.

Every test under tests/peers/ is marked ``peers``. The binaries come from ``make peers``; when they are
missing the tests fail with that command named, they never skip. The control plane starts at the first
test that asks for it and stops at the end of the session (API server first, then etcd).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.control_plane import ControlPlane
from tests.support.peers import PeerError, binary


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.peers)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kubeadm", "kubectl"):
            binary(name)
        cp = ControlPlane.start(tmp_path_factory.mktemp("control-plane"))
    except PeerError as exc:
        pytest.fail(f"the real control plane did not start: {exc}", pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()
