"""Fixtures for the attestation tiers: a local EK CA, real swtpm TPMs, and a running server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerThread, server_config
from tests.support.swtpm import LocalCa, Swtpm, manufacture, missing_tools


@pytest.fixture(scope="session")
def local_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCa:
    missing = missing_tools()
    if missing:
        pytest.fail(
            f"swtpm tools missing: {', '.join(missing)}; install the Debian packages swtpm and swtpm-tools"
        )
    ca = LocalCa(tmp_path_factory.mktemp("swtpm-localca"))
    manufacture(tmp_path_factory.mktemp("warm-up-tpm"), ca)  # swtpm-localca creates its CA on first use
    assert ca.root_cert.exists() and ca.issuer_cert.exists()
    return ca


@pytest.fixture
def ek_ca_dir(local_ca: LocalCa, tmp_path: Path) -> Path:
    d = tmp_path / "ek-ca"
    local_ca.install_into(d)
    return d


@pytest.fixture
def tpms(local_ca: LocalCa, tmp_path: Path) -> Iterator[Callable[..., Swtpm]]:
    """Factory: ``tpms()`` starts a freshly manufactured swtpm (with an EK certificate unless cert=False)."""
    started: list[Swtpm] = []
    counter = iter(range(10_000))

    def make(*, cert: bool = True, state: Path | None = None) -> Swtpm:
        if state is None:
            state = tmp_path / f"tpm{next(counter)}"
            manufacture(state, local_ca if cert else None)
        tpm = Swtpm(state).start()
        started.append(tpm)
        return tpm

    yield make
    for tpm in started:
        tpm.stop()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Factory: ``servers(ek_trust={...}, **config)`` starts a nodeserver on loopback."""
    started: list[ServerThread] = []
    counter = iter(range(1000))

    def make(data_dir: Path | None = None, **overrides: Any) -> ServerThread:
        cfg = server_config(data_dir or tmp_path / f"server{next(counter)}", **overrides)
        srv = ServerThread(cfg).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
