"""``nodeserver``: the attestation server's command line.

Sub-commands live in ``server.commands``; each module exposes
``register(subparsers)``. :class:`ServerError` becomes a message and exit
status 1 (2 for configuration errors); nothing else prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from protocol.version import add_version_argument
from server.errors import ConfigError, ServerError

COMMAND_MODULES = (
    "server.commands.run",
    "server.commands.bundle",
    "server.commands.agents",
    "server.commands.identity",
    "server.commands.devid_ca",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeserver",
        description=(
            "SPIRE-compatible attestation server (TPM node attestation, X509-SVIDs) and join-credential broker "
            "(one-time kubeadm bootstrap tokens for attested, verified nodes)."
        ),
        epilog=(
            "Run `nodeserver COMMAND --help` for the options of each command. Every configuration key: "
            "docs/settings.md; running the server: docs/attestation.md."
        ),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    add_version_argument(parser, "nodeserver")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    if args.command == "run":
        level = min(level, logging.INFO)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        print(f"nodeserver: configuration error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"nodeserver: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
