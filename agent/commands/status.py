"""``nodeagent status``: where the lifecycle is, the last error and what to do about it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agent.commands import KeepLinesFormatter
from agent.config import CONFIG_DIR, describe, load_config
from agent.errors import exit_status_help


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="show the join lifecycle's step, the last error and what to do",
        description=(
            "Show the step the agent reached, its identity and SVID expiry, the last verification, and the "
            "last error with its reason, whether it is permanent, the exit status it leads to and its fix. "
            "--json prints the same as one JSON document with stable keys, for fleet tooling (docs/join.md)."
        ),
        epilog=exit_status_help(),
        formatter_class=KeepLinesFormatter,
    )
    p.add_argument(
        "--config-dir", default=str(CONFIG_DIR), help=f"configuration folder (default {CONFIG_DIR})"
    )
    p.add_argument("--state-dir", default=None, help="state folder (default: from the configuration)")
    p.add_argument("--config", action="store_true", help="also print every setting and where it came from")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (keys: schema, step, joined, identity, svid_expires_at, after_join, devid, "
        "last_verification, last_error, ...; see docs/join.md)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.status import status_doc, status_lines

    overrides = {"state_dir": args.state_dir} if args.state_dir else None
    config, origin = load_config(config_dir=Path(args.config_dir), overrides=overrides)
    if args.json:
        doc = status_doc(Path(config.state_dir))
        if args.config:
            doc["settings"] = {
                key: {"value": value, "source": source} for key, value, source in describe(config, origin)
            }
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    for line in status_lines(Path(config.state_dir)):
        print(line)
    if args.config:
        print("settings:")
        for key, value, source in describe(config, origin):
            print(f"  {key:<18} {value:<40} ({source})")
    return 0
