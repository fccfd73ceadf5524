"""Fixtures of the wire transport's tests (tests/server/wire/helpers.py has the bench)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.wire.helpers import (
    RawFactory,
    WireFactory,
    WireThread,
)
from tests.support.h2raw import (
    RawH2,
)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WireThread]:
    srv = WireThread(tmp_path_factory.mktemp("wire") / "data").start()
    yield srv
    srv.stop()


@pytest.fixture
def make_wire(tmp_path: Path) -> Iterator[WireFactory]:
    """Factory: ``make_wire(limits=..., max_connections=...)`` starts a server of its own."""
    started: list[WireThread] = []
    counter = itertools.count()

    def make(**kwargs: Any) -> WireThread:
        srv = WireThread(tmp_path / f"data{next(counter)}", **kwargs).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def raws() -> Iterator[RawFactory]:
    """Factory of raw connections, all closed at the end."""
    opened: list[RawH2] = []

    def make(srv: WireThread, **kwargs: Any) -> RawH2:
        conn = srv.raw(**kwargs)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close()
