"""The exit status table (agent.errors.EXIT_STATUSES): one meaning and one permanence per status.

The table is the one place that says what each exit status means; the error classes, the
systemd unit (tests/systemd/test_units.py), `nodeagent status --help` and docs/systemd.md
all follow it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import agent
import agent.errors
from agent.errors import EXIT_BY_CODE, EXIT_STATUSES, AgentError, exit_status, exit_status_help

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD_DOC = ROOT / "docs" / "systemd.md"


def all_error_classes() -> list[type[AgentError]]:
    """Every AgentError subclass defined anywhere in the agent package."""
    for info in pkgutil.walk_packages(agent.__path__, "agent."):
        if info.name.startswith("agent.gpu.nvml") or info.name == "agent.cli":
            continue  # NVML needs the driver; the CLI imports every command
        try:
            importlib.import_module(info.name)
        except ImportError:  # pragma: no cover - an optional native dependency
            continue
    seen: set[type[AgentError]] = set()
    stack: list[type[AgentError]] = [AgentError]
    while stack:
        cls = stack.pop()
        if cls.__module__.startswith("agent.") and cls not in seen:
            seen.add(cls)
            stack.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: (c.__module__, c.__name__))


def test_codes_are_unique_and_names_are_slugs() -> None:
    codes = [e.code for e in EXIT_STATUSES]
    assert len(codes) == len(set(codes))
    assert len({e.name for e in EXIT_STATUSES}) == len(EXIT_STATUSES)
    for e in EXIT_STATUSES:
        assert re.fullmatch(r"[a-z][a-z_]*", e.name) and e.meaning
        assert not 200 <= e.code <= 255, "systemd uses 200..255 for its own failures"
    assert exit_status(0).name == "ok" and not exit_status(1).permanent


def test_every_error_class_has_a_row_of_its_own_permanence() -> None:
    classes = all_error_classes()
    assert len(classes) > 15
    for cls in classes:
        row = EXIT_BY_CODE.get(cls.exit_code)
        assert row is not None, f"{cls.__name__} exits {cls.exit_code}, which the table does not list"
        assert row.permanent == cls.permanent, (
            f"{cls.__module__}.{cls.__name__} is {'permanent' if cls.permanent else 'transient'} but exits "
            f"{cls.exit_code} ({row.name}, {'permanent' if row.permanent else 'transient'})"
        )


def test_permanence_is_a_class_property() -> None:
    """No error class takes ``permanent`` per instance: that is how one status came to mean two things."""
    for cls in all_error_classes():
        assert "permanent" not in inspect.signature(cls.__init__).parameters, cls.__name__


def test_permanent_and_transient_failures_exit_differently() -> None:
    permanent = {c.exit_code for c in all_error_classes() if c.permanent}
    transient = {c.exit_code for c in all_error_classes() if not c.permanent}
    assert permanent and transient and not permanent & transient


def test_help_lists_the_table() -> None:
    text = exit_status_help()
    for e in EXIT_STATUSES:
        assert re.search(rf"^\s+{e.code}\s+{e.name}\s", text, re.M), e


@pytest.mark.subprocess
@pytest.mark.parametrize("command", [[], ["status"]], ids=["nodeagent", "nodeagent status"])
def test_help_shows_the_table(command: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", *command, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    for e in EXIT_STATUSES:
        assert re.search(rf"^\s+{e.code}\s+{e.name}\s", out, re.M), e


def doc_table() -> dict[int, tuple[str, str]]:
    """The exit status table of docs/systemd.md: status -> (name, permanent|transient)."""
    text = SYSTEMD_DOC.read_text()
    section = text.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    rows: dict[int, tuple[str, str]] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*`([a-z_]+)`\s*\|\s*(permanent|transient|-)\s*\|", line)
        if m:
            rows[int(m.group(1))] = (m.group(2), m.group(3))
    return rows


def test_the_docs_table_is_the_table() -> None:
    expected = {
        e.code: (e.name, "permanent" if e.permanent else "transient" if e.code else "-")
        for e in EXIT_STATUSES
    }
    assert doc_table() == expected
    assert agent.errors.permanent_exit_codes() == [
        c for c, (_, kind) in sorted(expected.items()) if kind == "permanent"
    ]
