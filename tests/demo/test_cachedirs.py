"""tests.support.cachedirs: the machine-wide cache of the slow fixtures, keyed by what makes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import cachedirs, payload_server


def test_the_cache_root_follows_nodetrust_cache_then_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NODETRUST_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cachedirs.shared("x") == tmp_path / "xdg" / "nodetrust" / "x"
    monkeypatch.setenv("NODETRUST_CACHE", str(tmp_path / "nt"))
    assert cachedirs.root() == tmp_path / "nt"


def test_the_key_changes_with_any_byte_or_name_of_an_input(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    key = cachedirs.inputs_key("7", "real", files=[a, b], base=tmp_path)
    assert len(key) == 16 and int(key, 16) >= 0
    assert cachedirs.inputs_key("7", "real", files=[a, b], base=tmp_path) == key
    assert cachedirs.inputs_key("8", "real", files=[a, b], base=tmp_path) != key
    assert cachedirs.inputs_key("7", "stand-in", files=[a, b], base=tmp_path) != key
    b.write_bytes(b"twO")
    assert cachedirs.inputs_key("7", "real", files=[a, b], base=tmp_path) != key
    b.write_bytes(b"two")
    b.rename(tmp_path / "c.py")
    assert cachedirs.inputs_key("7", "real", files=[a, tmp_path / "c.py"], base=tmp_path) != key


def test_prune_keeps_the_newest_and_always_the_current_entry(tmp_path: Path) -> None:
    names = ["e0", "e1", "e2", "e3"]
    for age, name in enumerate(names):  # e0 newest
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1_000_000 - age * 10, 1_000_000 - age * 10))
    (tmp_path / ".lock-e3").write_text("")
    cachedirs.prune(tmp_path, keep=2, current=tmp_path / "e3")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock-e3", "e0", "e3"]


def test_the_payload_tree_is_named_by_its_recipe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another kernel, kind or FORMAT is another folder: a clone with other payload code never serves a stale
    tree from the shared cache (the build itself is the VM tier's; here it is recorded, not run)."""
    built: list[tuple[Path, str, str]] = []

    def fake_build(root: Path, *, kind: str = "stand-in", kernel: str = "") -> Path:
        built.append((root, kind, kernel))
        root.mkdir(parents=True, exist_ok=True)
        return root

    monkeypatch.setattr(payload_server, "PAYLOADS", tmp_path)
    monkeypatch.setattr(payload_server, "build_payloads", fake_build)
    one = payload_server.cached_payloads(kind="stand-in", kernel="6.1.0-50-amd64")
    assert one.parent == tmp_path and one.name.startswith("stand-in-")
    assert payload_server.cached_payloads(kind="stand-in", kernel="6.1.0-50-amd64") == one
    other_kernel = payload_server.cached_payloads(kind="stand-in", kernel="6.8.0-1-generic")
    runtime = payload_server.cached_payloads(kind="runtime", kernel="6.1.0-50-amd64")
    assert runtime.name.startswith("runtime-")
    monkeypatch.setattr(payload_server, "FORMAT", payload_server.FORMAT + "x")
    other_format = payload_server.cached_payloads(kind="stand-in", kernel="6.1.0-50-amd64")
    assert len({one, other_kernel, runtime, other_format}) == 4
    assert [(b[1], b[2]) for b in built] == [
        ("stand-in", "6.1.0-50-amd64"),
        ("stand-in", "6.1.0-50-amd64"),
        ("stand-in", "6.8.0-1-generic"),
        ("runtime", "6.1.0-50-amd64"),
        ("stand-in", "6.1.0-50-amd64"),
    ]
    with pytest.raises(ValueError, match="kind 'fake'"):
        payload_server.cached_payloads(kind="fake", kernel="6.1.0-50-amd64")  # type: ignore[arg-type]


def test_a_kinds_tree_is_made_from_its_own_peers_pins() -> None:
    """A runtime tree is made from the cri-tools peer only: a Kubernetes or SPIRE pin leaves its key alone."""
    interop = payload_server.REPO / "interop"
    names = {kind: {p.relative_to(interop).as_posix() for p in payload_server.recipe_files(kind) if p.is_relative_to(interop)}
             for kind in payload_server.KINDS}  # fmt: skip
    assert names["stand-in"] == set()
    assert names["runtime"] == {"critools/go.sum", "critools/peer.conf"}
    assert names["real"] == {
        f"{m}/{f}" for m in ("critools", "kube", "spire") for f in ("go.sum", "peer.conf")
    }
    assert all(p.is_file() for kind in payload_server.KINDS for p in payload_server.recipe_files(kind))
