"""``nodeagent check``: verify the GPUs and the node against a pool profile.

Exit status: 0 when every fatal check passes (warnings allowed), 1 when the
verdict fails, 2 for a bad pool profile or option, 7 when the checks cannot read the
host at all (no ``/proc`` under ``--host-root``).
``--json`` prints the report in its canonical form (what the join request carries).

The profile is ``--pool-profile`` (or its older spelling ``--pool``), else the ``pool_profile``
setting from the same layers ``nodeagent run`` reads, else /etc/nodeagent/pool.yaml, else the
``pool`` setting as a preset: the profile ``run`` would check against.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from agent.checks import run_checks
from agent.config import add_arguments, config_for
from agent.errors import AgentError, CheckError, ConfigError
from agent.host import Host
from agent.pool import load_pool
from agent.state import StateStore
from protocol.report import Report, Status, canonical_json

EXIT_FAILED = 1
_MARK = {Status.PASS: "pass", Status.FAIL: "FAIL", Status.WARN: "warn", Status.SKIP: "skip"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check",
        help="verify the GPUs, the driver and the node against a pool profile",
        description=(
            "Run every GPU and node check and judge them against a pool profile. "
            "Exit 0 only when every fatal check passes. The profile is --pool-profile (--pool is its older "
            "spelling), else pool_profile from /etc/nodeagent/config.yaml, config.d, the kernel command line "
            "(nodeagent.pool_profile=) or NODEAGENT_POOL_PROFILE, else /etc/nodeagent/pool.yaml, else the pool "
            "setting as a preset (docs/settings.md)."
        ),
    )
    add_arguments(p, "check")
    p.add_argument("--json", action="store_true", help="print the report as canonical JSON")
    p.add_argument(
        "--host-root",
        metavar="DIR",
        default="/",
        help="read the host's /proc, /dev, /run and /var under DIR (when running in a container "
        "that mounts the host there); libudev still reads /sys",
    )
    p.set_defaults(func=run)


def _host(root: str) -> Host:
    path = Path(root)
    if not path.is_dir():
        raise ConfigError(f"--host-root {root} is not a directory")
    if not (path / "proc").is_dir():
        raise CheckError(
            f"{path / 'proc'} does not exist: the checks cannot read the host",
            hint="mount the host's /proc under the host root (docker run -v /proc:/host/proc ...)",
        )
    return Host(path)


def run(args: argparse.Namespace) -> int:
    host = _host(args.host_root)
    config, _ = config_for(args, "check")
    policy = load_pool(config.pool_profile_spec())
    selected = ""  # the Kubernetes version a join answer selected (agent.kubeversion), for the skew check
    with contextlib.suppress(
        AgentError
    ):  # no readable state: judge the version the node would run at its join
        selected = StateStore(Path(config.state_dir)).load().kubernetes_version
    report = run_checks(policy, host, selected_kubernetes=selected, image_info=host.path(config.image_info))
    try:
        if args.json:
            sys.stdout.buffer.write(canonical_json(report) + b"\n")
        else:
            sys.stdout.write(render(report, width=shutil.get_terminal_size((120, 40)).columns) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader (`| head`) went away; the verdict still decides the exit status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.verdict.passed else EXIT_FAILED


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def render(report: Report, width: int = 120) -> str:
    """A readable table: one line per check; reason and expectation under every non-pass."""
    name_w = max(len(c.name) for c in report.checks) if report.checks else 10
    room = max(width - name_w - 9, 30)
    lines = [
        f"pool {report.pool}  host {report.hostname or '?'}  {len(report.checks)} checks "
        f"in {report.duration_ms / 1000:.2f} s",
        f"{'STATUS':<6}  {'CHECK':<{name_w}}  OBSERVED",
    ]
    pad = " " * (name_w + 10)
    for c in report.checks:
        shown = f"skipped: {c.reason}" if c.status is Status.SKIP else c.observed
        lines.append(f"{_MARK[c.status]:<6}  {c.name:<{name_w}}  {_clip(shown, room)}")
        if c.status in (Status.FAIL, Status.WARN):
            lines.append(f"{pad}why: {c.reason}")
            lines.append(f"{pad}expected: {c.expected}")
    v = report.verdict
    lines.append("")
    summary = f"{len(v.failures)} failed, {len(v.warnings)} warning(s)"
    lines.append(f"verdict: {'PASS' if v.passed else 'FAIL'} ({summary})")
    lines.extend(f"  - {f.check}: {f.reason}" for f in v.failures)
    return "\n".join(lines)
