"""``nodeagent reattest``: a joined node attests again and its boot is re-checked (run by a systemd timer)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agent.config import add_arguments, config_for


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "reattest",
        help="on a joined node: attest again before the SVID expires, and re-check measured boot",
        description=(
            "On a joined node (nodeagent-reattest.timer runs this): when the SVID expires within reattest_before_s "
            "(or with --force), attest again with the TPM (a new AK and SVID), then, if the pool checks measured "
            "boot, quote the PCRs the broker names over its nonce and send the quote and the event log for the "
            "server to compare with the releases the pool accepts. A node whose measurements changed is refused "
            "(exit 8). On a node that has not joined it does nothing. Reads the same settings as `nodeagent run`."
        ),
    )
    add_arguments(p, "reattest")
    p.add_argument(
        "--force", action="store_true", help="re-attest now, however long the SVID is still valid"
    )
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.reattest import reattest

    config, _ = config_for(args, "reattest")
    outcome = reattest(config, force=args.force)
    if args.json:
        print(json.dumps(outcome.to_json(), sort_keys=True))
    else:
        print(f"nodeagent: {outcome.detail}")
    return 0
