"""Run every GPU and node check and build the verification report.

The statuses and the verdict come from :func:`protocol.policy.assess`, the same
code the server runs (through :func:`protocol.policy.evaluate`) on the report.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from agent import kubeversion, node
from agent.errors import KubernetesVersionError
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


def collect(
    host: Host, *, will_run: str | None = None, carried: list[str] | None = None
) -> list[Observation]:
    return observe.collect(host) + node.collect(host, will_run=will_run, carried=carried)


def run_checks(
    policy: PoolPolicy,
    host: Host | None = None,
    *,
    selected_kubernetes: str = "",
    image_info: Path | None = None,
) -> Report:
    """Every check under ``policy``. The ``node.kubelet`` skew check judges the Kubernetes version the node
    will run at its join (:func:`agent.kubeversion.predict`: ``selected_kubernetes``, a version an earlier
    join answer chose, else the carried version of the pool's control-plane minor), when the image says what
    it carries (``image_info``, default the image's /etc/nodetrust/image.json under the host root)."""
    host = host or Host()
    started = time.monotonic()
    collected_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        image = kubeversion.carried(image_info or host.path(str(kubeversion.IMAGE_INFO)))
    except KubernetesVersionError as exc:
        log.warning("the skew check judges the installed kubelet: %s", exc.message)
        image = None
    will_run = None
    if image is not None:
        will_run = kubeversion.predict(
            image, selected=selected_kubernetes, control_plane=policy.control_plane_version or ""
        )
    observations = collect(host, will_run=will_run, carried=image.versions if image is not None else None)
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
