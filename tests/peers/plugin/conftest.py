"""spire-tpm-plugin interop (opt-in): the plugin is in no registry this project uses, and its code and
any script that builds it stay out of the repository. Point ``NODETRUST_SPIRE_TPM_PLUGIN`` at a folder
holding ``tpm_attestor_server`` and ``tpm_attestor_agent`` (built from spiffe/spire-tpm-plugin v1.9.0
or v1.10.1: ../shared/reference/real-peers.md 1.5) to run these tests. Without it they are reported
as not run, once, in the session summary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "NODETRUST_SPIRE_TPM_PLUGIN"
_collected: list[str] = []


def plugin_dir() -> Path | None:
    value = os.environ.get(ENV, "")
    return Path(value) if value else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    _collected.extend(i.nodeid for i in items if here in Path(str(i.fspath)).parents)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _collected and plugin_dir() is None:
        terminalreporter.write_line(
            f"spire-tpm-plugin: {len(_collected)} interop tests NOT RUN: set {ENV}=<folder with "
            "tpm_attestor_server and tpm_attestor_agent> to run them (the plugin is in no registry here)"
        )
