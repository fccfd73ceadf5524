"""``nodeagent run``: preflight, attest, verify, request credentials, kubeadm join; resumable."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agent.config import CONFIG_DIR, SETTINGS, load_config

FLAGS = (
    "server",
    "join_server",
    "trust_domain",
    "bundle",
    "tcti",
    "pool",
    "pool_profile",
    "node_name",
    "state_dir",
    "kubeadm",
)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="go from power-on to joined: attest, verify, get credentials, kubeadm join",
        description=(
            "Run the node's join lifecycle (preflight -> attest -> verify -> join_request -> kubeadm_join -> "
            "joined), resuming where a crash or reboot left it, retrying transient failures with backoff and "
            "stopping with the reason on a permanent refusal. Once joined it does nothing. Settings come from "
            "/etc/nodeagent/config.yaml and config.d/*.yaml, then nodeagent.<key>=<value> on the kernel command "
            "line, then NODEAGENT_<KEY> variables, then these flags (see docs/join.md)."
        ),
    )
    p.add_argument(
        "--config-dir", default=str(CONFIG_DIR), help=f"configuration folder (default {CONFIG_DIR})"
    )
    by_key = {s.key: s for s in SETTINGS}
    for key in FLAGS:
        p.add_argument("--" + key.replace("_", "-"), dest=key, default=None, help=by_key[key].help)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.lifecycle import Lifecycle

    overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    config, _ = load_config(config_dir=Path(args.config_dir), overrides=overrides)
    outcome = Lifecycle(config).run()
    print(
        f"nodeagent: joined as {config.effective_node_name}" if outcome.joined else "nodeagent: not joined"
    )
    return 0 if outcome.joined else 1
