"""What ``--version`` prints: the distribution's version and the wire versions it speaks.

The version comes from the installed distribution's metadata (``importlib.metadata``); a source
checkout that was never installed says ``unknown``. No import-time work: call :func:`version_info`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata
from typing import Any

DISTRIBUTION = "nodetrust"
# The contracts a program speaks; a fleet tool compares these, not the release number.
AGENT_API = "spire.api.server.agent.v1"
JOIN_API = "nodetrust.join.v1"


def distribution_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def version_info(program: str) -> dict[str, Any]:
    """``{"program", "version", "agent_api", "join_api", "report_schema"}`` for ``--version``."""
    from protocol.report import REPORT_SCHEMA_VERSION

    return {
        "program": program,
        "version": distribution_version(),
        "agent_api": AGENT_API,
        "join_api": JOIN_API,
        "report_schema": REPORT_SCHEMA_VERSION,
    }


def version_text(program: str) -> str:
    """``nodeagent 0.1.0 (agent API spire.api.server.agent.v1, join API nodetrust.join.v1, report schema 1)``."""
    info = version_info(program)
    return (
        f"{program} {info['version']} (agent API {info['agent_api']}, join API {info['join_api']}, "
        f"report schema {info['report_schema']})"
    )


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` on one line (argparse's own action rewraps it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, program: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.program = program

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text(self.program))
        parser.exit()


def add_version_argument(parser: argparse.ArgumentParser, program: str) -> None:
    parser.add_argument(
        "--version",
        action=_VersionAction,
        program=program,
        help="print the version and the contracts it speaks (agent API, join API, report schema), then exit",
    )
