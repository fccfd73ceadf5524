"""Run every GPU and node check and build the verification report.

The statuses and the verdict come from :func:`protocol.policy.assess`, the same
code the server runs (through :func:`protocol.policy.evaluate`) on the report.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from importlib import metadata

from agent import node
from agent.gpu import observe
from agent.host import Host
from protocol.policy import PoolPolicy, assess
from protocol.report import REPORT_SCHEMA_VERSION, Observation, Report

log = logging.getLogger(__name__)


def agent_version() -> str:
    try:
        return metadata.version("nodetrust")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def collect(host: Host) -> list[Observation]:
    return observe.collect(host) + node.collect(host)


def run_checks(policy: PoolPolicy, host: Host | None = None) -> Report:
    host = host or Host()
    started = time.monotonic()
    collected_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    observations = collect(host)
    checks, verdict = assess(observations, policy)
    hostname = next(
        (str(o.observations.get("hostname") or "") for o in observations if o.name == "node.hostname"), ""
    )
    report = Report(
        schema_version=REPORT_SCHEMA_VERSION,
        agent_version=agent_version(),
        hostname=hostname,
        pool=policy.name,
        collected_at=collected_at,
        duration_ms=int((time.monotonic() - started) * 1000),
        checks=checks,
        verdict=verdict,
    )
    log.info("checks done in %d ms: %s", report.duration_ms, "passed" if verdict.passed else "failed")
    return report
