"""Fixtures for the image builder's fast tests (no VM boots).

Real subprocesses are banned unless a test is marked ``subprocess``: the builder's one
chokepoint (:func:`imagebuilder.run._execute`) raises instead. The fixture payloads are
built once per session and served on a loopback port.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.payload_server import PayloadServer, build_payloads

REPO = Path(__file__).resolve().parents[2]


class UnexpectedSubprocess(BaseException):
    """A unit test ran a real command without the ``subprocess`` marker."""


@pytest.fixture(autouse=True)
def _no_subprocess(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("subprocess") is not None:
        return

    def refuse(args: list[str], **_kw: Any) -> None:
        raise UnexpectedSubprocess(f"unit test ran {args[0]}; mark it @pytest.mark.subprocess if it must")

    monkeypatch.setattr("imagebuilder.run._execute", refuse)


@pytest.fixture(scope="session")
def payload_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_payloads(tmp_path_factory.mktemp("payloads") / "tree")


@pytest.fixture
def payloads(payload_root: Path) -> Iterator[PayloadServer]:
    server = PayloadServer(payload_root)
    try:
        yield server
    finally:
        server.close()
