"""``imagebuilder``: build, prove and test node images.

Each sub-command lives in ``imagebuilder.commands.<name>`` and exposes
``register(subparsers)``; the modules listed in :data:`COMMAND_MODULES` that
exist are registered. :class:`imagebuilder.errors.BuildError` becomes a message,
a hint and an exit status; nothing else prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence

from protocol.version import add_version_argument

COMMAND_MODULES = (
    "imagebuilder.commands.lock",
    "imagebuilder.commands.build",
    "imagebuilder.commands.test",
    "imagebuilder.commands.rebuild",
    "imagebuilder.commands.keygen",
    "imagebuilder.commands.verify",
    "imagebuilder.commands.release",
    "imagebuilder.commands.bootenv",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imagebuilder",
        description=(
            "Build a pinned Ubuntu 24.04 node image (QCOW2) by driving the Ubuntu installer under libvirt with "
            "autoinstall, and publish it with checksums, a manifest, an SBOM, provenance and a signature."
        ),
        epilog="Run `imagebuilder COMMAND --help` for each command. Guide: docs/building-images.md.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    add_version_argument(parser, "imagebuilder")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from imagebuilder.errors import BuildError

    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        rc: int = args.func(args)
    except BuildError as exc:
        print(f"imagebuilder: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"imagebuilder: hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("imagebuilder: interrupted; the build was cleaned up", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
