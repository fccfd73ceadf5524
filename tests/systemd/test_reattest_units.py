"""The re-attestation timer and its service: systemd's own verdict, and what they promise about the agent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent import systemd
from agent.cli import build_parser
from agent.state import JOINED_MARKER
from tests.systemd.conftest import parse_unit

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def test_the_service_runs_only_on_a_joined_node_and_runs_reattest() -> None:
    unit = parse_unit(systemd.read("nodeagent-reattest.service"))
    assert unit["Unit"]["ConditionPathExists"] == [f"/var/lib/nodeagent/{JOINED_MARKER}"]
    [exec_start] = unit["Service"]["ExecStart"]
    argv = exec_start.split()
    assert argv[0] == "/opt/nodeagent/venv/bin/nodeagent" and argv[1:] == ["reattest"]
    build_parser().parse_args(argv[1:])  # the command exists with no further arguments
    assert unit["Service"]["Type"] == ["oneshot"] and unit["Service"]["TimeoutStartSec"]
    assert "Install" not in unit, "the service is started by its timer, never enabled on its own"
    # Its state is the agent's; nothing else is writable.
    assert unit["Service"]["ProtectSystem"] == ["strict"]
    assert unit["Service"]["ReadWritePaths"] == ["/var/lib/nodeagent"]


def test_the_timer_renews_well_before_the_svid_expires() -> None:
    from agent.config import AgentConfig
    from server.config import ServerConfig

    timer = parse_unit(systemd.read("nodeagent-reattest.timer"))
    assert timer["Install"]["WantedBy"] == ["timers.target"]

    def seconds(value: str) -> float:
        return (
            float(value.removesuffix("min")) * 60
            if value.endswith("min")
            else float(value.removesuffix("s"))
        )

    period = seconds(timer["Timer"]["OnUnitActiveSec"][0]) + seconds(timer["Timer"]["RandomizedDelaySec"][0])
    # A run falls inside every window of reattest_before_s before the SVID expires, and that window is
    # shorter than the server's default SVID lifetime (so it does not re-attest at every run).
    assert (
        period
        < AgentConfig().reattest_before_s
        < ServerConfig("example.org", Path("/nonexistent")).agent_svid_ttl.total_seconds()
    )


@pytest.mark.subprocess
def test_systemd_analyze_verify_the_timer(unit_root: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        for name in ("nodeagent-reattest.service", "nodeagent-reattest.timer"):
            assert set(parse_unit(systemd.read(name))) <= {"Unit", "Service", "Timer", "Install"}
        return
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={unit_root}", "nodeagent-reattest.timer", "nodeagent-reattest.service"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Only lines about the other units (nodeagent.service's keys newer than this host's systemd).
    ours = [line for line in result.stderr.splitlines() if "nodeagent-reattest" in line]
    assert ours == [], "\n".join(ours)
