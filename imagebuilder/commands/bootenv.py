"""``imagebuilder bootenv``: the imager's boot environment (kernel + initramfs) from pinned Debian packages.

``imagebuilder bootenv lock --lock FILE`` resolves the recipe against Debian's signed archive (and its
wheels against PyPI) and writes the lock; ``imagebuilder bootenv build --lock FILE --out DIR [--bake-key
PUB]`` builds ``vmlinuz``, ``initrd.img`` and ``bootenv.json`` from exactly the locked packages and wheels.
``DIR`` is what ``imagebuilder release --imager DIR`` takes. docs/bare-metal.md, "The boot environment".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bootenv",
        help="lock and build the imager's boot environment (kernel + initramfs)",
        description="The imager's boot environment from pinned, signature-checked Debian packages, with "
        "nodeimager from a clean wheel of this repository.",
        epilog="Exit status: 0 done; 3 the lock is missing or stale; 4 a download failed or its digest does not "
        "match; 5 a signature does not verify; 10 a tool failed; 11 a tool is missing.",
    )
    sub = parser.add_subparsers(dest="bootenv_command", metavar="STEP", required=True)
    lock = sub.add_parser(
        "lock", help="resolve the packages against Debian's signed archive and write the lock"
    )
    lock.add_argument("--lock", type=Path, required=True, help="the lock file to write")
    build = sub.add_parser("build", help="build vmlinuz, initrd.img and bootenv.json from the lock")
    build.add_argument("--lock", type=Path, required=True, help="the lock file")
    build.add_argument(
        "--out", type=Path, required=True, help="the folder to write (imagebuilder release --imager)"
    )
    build.add_argument("--bake-key", type=Path, action="append", default=[], metavar="PUB",
                       help="a release signing key (public) the imager trusts without a pin (repeat)")  # fmt: skip
    for step in (lock, build):
        step.add_argument("--cache-dir", type=Path, help="the download cache (default: the builder's)")
        step.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from imagebuilder.bootenv import build, lock
    from imagebuilder.cache import Cache, default_cache_dir

    cache = Cache(args.cache_dir or default_cache_dir())
    if args.bootenv_command == "lock":
        locked = lock.lock(cache, args.lock)
        summary: dict[str, Any] = {
            "ok": True,
            "lock": str(args.lock),
            "packages": len(locked.packages),
            "wheels": len(locked.wheels),
            "bytes": sum(p.size for p in locked.packages) + sum(w.size for w in locked.wheels),
        }
    else:
        manifest = build.build(args.lock, cache, args.out, keys=args.bake_key)
        summary = {
            "ok": True,
            "out": str(args.out),
            "kernel": manifest["kernel"],
            "initrd": manifest["initrd"],
        }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        for key, value in summary.items():
            if key != "ok":
                print(f"{key:8} {value}")
    return 0
