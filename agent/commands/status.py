"""``nodeagent status``: where the lifecycle is, the last error and what to do about it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agent.config import CONFIG_DIR, describe, load_config


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="show the join lifecycle's step, the last error and what to do",
        description="Show the step the agent reached, its identity and SVID expiry, and the last error with its fix.",
    )
    p.add_argument(
        "--config-dir", default=str(CONFIG_DIR), help=f"configuration folder (default {CONFIG_DIR})"
    )
    p.add_argument("--state-dir", default=None, help="state folder (default: from the configuration)")
    p.add_argument("--config", action="store_true", help="also print every setting and where it came from")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.lifecycle import status_lines

    overrides = {"state_dir": args.state_dir} if args.state_dir else None
    config, origin = load_config(config_dir=Path(args.config_dir), overrides=overrides)
    for line in status_lines(Path(config.state_dir)):
        print(line)
    if args.config:
        print("settings:")
        for key, value, source in describe(config, origin):
            print(f"  {key:<18} {value:<40} ({source})")
    return 0
