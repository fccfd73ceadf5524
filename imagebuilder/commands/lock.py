"""``imagebuilder lock DEFINITION``: resolve every input to URL, SHA-256 and size in a lock file."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from imagebuilder.cache import Cache, default_cache_dir
from imagebuilder.commands.options import COMMAND_OPTIONS, TABLE
from imagebuilder.definition import load_definition
from imagebuilder.lock import create_lock, default_lock_path

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lock",
        help="resolve and verify every input of a definition into a lock file",
        description=(
            "Resolve the installer ISO, the artifacts, the OS and Kubernetes packages and the agent's wheels of "
            "DEFINITION to URL, SHA-256 and size; verify upstream checksum files, their signatures and signed apt "
            "indexes; download everything into the cache; write the lock file (default: next to the definition, "
            "<name>.lock.json). Needs the network; `imagebuilder build` then needs none for inputs."
        ),
    )
    parser.add_argument("definition", type=Path, help="definition YAML (see examples/)")
    TABLE.add_arguments(parser, COMMAND_OPTIONS["lock"], typed=True)
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"lock", "inputs", "name", "architecture"} as one JSON object instead of the summary',
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.verbose == 0:
        logging.getLogger("imagebuilder").setLevel(logging.INFO)
    defn = load_definition(args.definition)
    lock_path = args.lock or default_lock_path(defn.path)
    lock = create_lock(defn, Cache(args.cache_dir or default_cache_dir()), lock_path)
    if args.json:
        summary = {
            "lock": str(lock.path),
            "inputs": len(lock.inputs),
            "name": defn.name,
            "architecture": defn.architecture,
        }
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"{lock.path}: {len(lock.inputs)} inputs locked for {defn.name} ({defn.architecture})")
    return 0
