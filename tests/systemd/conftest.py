"""systemd fixtures: the shipped unit files, parsed; a throw-away root for ``systemd-analyze --root``."""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from agent import systemd

FIXTURES = Path(__file__).parent / "fixtures"
Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> key -> values in order (systemd allows repeated keys; an empty value resets a list)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert section, f"line {number}: a directive outside any section: {raw!r}"
        assert "=" in line, f"line {number}: not Key=Value: {raw!r}"
        assert not line.endswith("\\"), f"line {number}: continuation lines are not used here"
        key, _, value = line.partition("=")
        out[section][key.strip()].append(value.strip())
    return {s: dict(kv) for s, kv in out.items()}


@pytest.fixture(scope="session")
def unit() -> Unit:
    return parse_unit(systemd.read("nodeagent.service"))


@pytest.fixture(scope="session")
def dropin() -> Unit:
    return parse_unit(systemd.read("kubelet.service.d/10-nodeagent.conf"))


@pytest.fixture(scope="session")
def unit_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with the host's systemd units, our files where the image installs them, stand-in executables."""
    root = tmp_path_factory.mktemp("unit-root")
    host_units = next(
        (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None
    )
    assert host_units is not None, "systemd-analyze is installed but the host has no unit folder"
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    for name, installed in systemd.FILES.items():
        target = root / installed.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(systemd.read(name))
    # kubelet's own unit, where the kubelet package puts it; our drop-in sits beside it.
    (root / "usr/lib/systemd/system/kubelet.service").write_text((FIXTURES / "kubelet.service").read_text())
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)  # the administrator's layer, empty
    for exe in ("opt/nodeagent/venv/bin/nodeagent", "usr/bin/kubelet"):
        path = root / exe
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        os.chmod(path, 0o755)  # noqa: S103 - a stand-in executable
    return root
