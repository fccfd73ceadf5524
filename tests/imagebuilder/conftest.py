"""Fixtures for the image builder's fast tests (no VM boots).

Real subprocesses are banned unless a test is marked ``subprocess``: the builder's one
chokepoint (:func:`imagebuilder.run._execute`) raises instead. The fixture payloads are
built once per session and served on a loopback port.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
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


# -- one real lock of a small definition, for the tests that edit it or build from it ----------------------


@dataclass(frozen=True)
class Locked:
    server: PayloadServer
    definition: Path
    lock: Path
    cache: Path
    data: dict[str, Any]

    def write(self, tmp: Path, data: dict[str, Any]) -> Path:
        path = tmp / "edited.lock.json"
        path.write_text(json.dumps(data, indent=2))
        return path

    def edited(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)


@pytest.fixture(scope="session")
def locked(tmp_path_factory: pytest.TempPathFactory, payload_root: Path) -> Iterator[Locked]:
    """``imagebuilder lock`` of tests.imagebuilder.test_lock's definition (a tiny ISO, the fixture payloads
    on a loopback server kept for the session), made once."""
    from imagebuilder.cache import Cache
    from imagebuilder.definition import load_definition
    from imagebuilder.lock import create_lock
    from imagebuilder.media import make_iso
    from tests.imagebuilder.test_lock import BASE, definition

    tree = tmp_path_factory.mktemp("iso-tree")
    (tree / "casper").mkdir()
    (tree / "casper/minimal.manifest").write_text(BASE)
    (tree / "casper/vmlinuz").write_bytes(b"kernel")
    (tree / "casper/initrd").write_bytes(b"initrd")
    base = tmp_path_factory.mktemp("locked")
    iso = make_iso(tree, base / "installer.iso", label="TINY")
    server = PayloadServer(payload_root)
    try:
        path = definition(base, server, iso)
        lock = create_lock(load_definition(path), Cache(base / "cache"), base / "lock-test.lock.json")
        yield Locked(server, path, lock.path, base / "cache", json.loads(lock.path.read_text()))
    finally:
        server.close()
