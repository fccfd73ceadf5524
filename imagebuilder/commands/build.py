"""``imagebuilder build DEFINITION``: the installer under libvirt to a published, pinned QCOW2."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from imagebuilder import interrupt
from imagebuilder.build import BuildOptions, build
from imagebuilder.cache import default_cache_dir
from imagebuilder.commands.options import COMMAND_OPTIONS, TABLE
from imagebuilder.errors import DefinitionError
from imagebuilder.watch import PHASES

log = logging.getLogger(__name__)


def _idle_limit(value: str) -> tuple[str, int]:
    phase, _, seconds = value.partition("=")
    if phase not in (*PHASES, "total") or not seconds.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected PHASE=SECONDS with PHASE one of {', '.join(PHASES)}, total"
        )
    return phase, int(seconds)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "build",
        help="build the image of a locked definition",
        description=(
            "Verify every locked input, boot the installer ISO's kernel under libvirt with autoinstall and a NoCloud "
            "seed, stage the artifacts and the node agent from a staging medium, watch the install, and publish "
            "<out>/<build-id>/ atomically: the compacted QCOW2, console.log, manifest.json, SHA256SUMS (and the "
            "SBOM, provenance and signature when imagebuilder.trust is present)."
        ),
    )
    parser.add_argument("definition", type=Path, help="definition YAML, locked by `imagebuilder lock`")
    parser.add_argument(
        "--out", type=Path, default=Path("out"), help="where build folders are published (default: out/)"
    )
    TABLE.add_arguments(parser, COMMAND_OPTIONS["build"], typed=True)
    parser.add_argument(
        "--network",
        choices=("listener", "none"),
        default=None,
        help="override the definition: user-mode network to the event listener only, or none",
    )
    parser.add_argument(
        "--idle-limit",
        type=_idle_limit,
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help=f"override a watchdog idle limit ({', '.join(PHASES)}, total); repeatable",
    )
    parser.add_argument(
        "--base-cache",
        type=Path,
        default=None,
        help="where installed bases are cached and reused (default: <cache-dir>/bases)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run the installer again even when the base cache has this definition's installed base "
        "(the new base replaces the cached one)",
    )
    parser.add_argument("--key", type=Path, default=None, help="sign the build folder with this private key")
    parser.add_argument(
        "--progress",
        type=Path,
        default=None,
        metavar="FILE",
        help="append one JSON object per line to FILE as the build starts and ends each phase (and each phase "
        "of its VMs), then its result: for CI and tests (docs/building-images.md, Progress events)",
    )
    parser.add_argument(
        "--no-test",
        dest="boot_test",
        action="store_false",
        help="publish without the boot test (by default the image is booted once and checked from inside, "
        "like `imagebuilder test`, and nothing is published unless every check passes)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.verbose == 0:
        logging.getLogger("imagebuilder").setLevel(logging.INFO)
    if args.definition.suffix not in (".yaml", ".yml"):
        raise DefinitionError(f"{args.definition}: expected a .yaml definition")
    with interrupt.stop_on_signals():  # Ctrl-C and SIGTERM, even if inherited ignored, stop and clean up
        result = build(
            BuildOptions(
                definition=args.definition,
                out=args.out,
                cache_dir=args.cache_dir or default_cache_dir(),
                lock=args.lock,
                work_root=args.work_dir,
                libvirt_uri=args.libvirt_uri,
                accel=args.accel,
                key=args.key,
                network=args.network,
                idle_limits=dict(args.idle_limit),
                keep_work=args.keep_work,
                base_cache=args.base_cache,
                full=args.full,
                boot_test=args.boot_test,
                progress=args.progress,
            )
        )
    print(result.folder)
    return 0
