"""``nodeagent run``: preflight, attest, verify, request credentials, kubeadm join; resumable."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agent.config import add_arguments, config_for


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="go from power-on to joined: attest, verify, get credentials, kubeadm join",
        description=(
            "Run the node's join lifecycle (preflight -> attest -> verify -> join_request -> kubeadm_join -> "
            "joined), resuming where a crash or reboot left it, retrying transient failures with backoff and "
            "stopping with the reason on a permanent refusal. When configured (devid_enrol, spire_agent_unit), a "
            "stage follows the join: devid_enrol -> spire_agent (a DevID for SPIRE's tpm_devid, then the image's "
            "SPIRE agent unit); its failures never undo the join. Once joined (and that stage done) it does "
            "nothing. Settings come from "
            "/etc/nodeagent/config.yaml and config.d/*.yaml, then nodeagent.<key>=<value> on the kernel command "
            "line, then NODEAGENT_<KEY> variables, then these flags; every setting has a flag (docs/settings.md). "
            "Durations are written like 30s, 1h30m or 300ms (or a number of seconds)."
        ),
    )
    add_arguments(p, "run")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.lifecycle import Lifecycle

    config, _ = config_for(args, "run")
    outcome = Lifecycle(config).run()
    if args.json:
        doc = {"joined": outcome.joined, "node_name": config.effective_node_name}
        if outcome.after_join:
            doc["after_join"] = outcome.after_join
        print(json.dumps(doc))
    else:
        print(
            f"nodeagent: joined as {config.effective_node_name}"
            if outcome.joined
            else "nodeagent: not joined"
        )
    return 0 if outcome.joined else 1
