"""``nodeagent``: the node agent's command line.

Each sub-command lives in its own module under ``agent.commands`` and exposes
``register(subparsers)``; this module only builds the parser, sets up logging
and turns :class:`AgentError` into a message, a hint and an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from agent.commands import KeepLinesFormatter
from agent.errors import AgentError, exit_status_help
from protocol.version import add_version_argument

COMMAND_MODULES = (
    "agent.commands.run",
    "agent.commands.status",
    "agent.commands.attest",
    "agent.commands.check",
    "agent.commands.reattest",
    "agent.commands.devid",
)

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeagent",
        description=(
            "Node agent: proves this machine's identity with its TPM to a SPIRE-compatible server, "
            "verifies its GPUs and readiness, and only then fetches kubeadm join credentials."
        ),
        epilog="Run `nodeagent COMMAND --help` for the options of each command; every setting: docs/settings.md.\n\n"
        + exit_status_help(),
        formatter_class=KeepLinesFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    add_version_argument(parser, "nodeagent")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from agent.journal import setup_logging

    setup_logging(args.verbose)
    try:
        rc: int = args.func(args)
    except AgentError as exc:
        print(f"nodeagent: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"nodeagent: hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nodeagent: interrupted", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
