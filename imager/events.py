"""Events: what the imager is doing, POSTed as JSON to the URL the release names and printed on the console.

Each event is one JSON object::

    {"event": "disk-chosen", "time": 1764620000.1, "machine": {"uuid": "...", "serial": "..."},
     "release": "k8s-1.36.3-amd64-h200", "disk": {"serial": "S1", "wwn": "...", "size": 8589934592}}

``event`` is one of ``started``, ``verified`` (release, build, signer), ``disk-chosen`` (the disk by
identity), ``written`` (digest, bytes, seconds, rate), ``boot-entry`` (number, order), ``done``,
``failed`` (``reason``: the stable token of :class:`imager.errors.Reason`, ``message``, ``exit_code``,
and details such as every disk candidate). ``machine`` comes from the firmware's SMBIOS tables
(``/sys/class/dmi/id``). Delivery is best effort: a POST that fails is logged and never stops or
fails the imaging (the console line is always printed, so a serial console log has them all).
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from imager.errors import ImagerError
from imager.http import USER_AGENT, check_url

log = logging.getLogger(__name__)

CONSOLE_PREFIX = "nodeimager-event: "
DMI = Path("/sys/class/dmi/id")
POST_TIMEOUT_S = 5.0


def machine_identity(dmi: Path = DMI) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, name in (("uuid", "product_uuid"), ("serial", "product_serial"), ("vendor", "sys_vendor"),
                      ("product", "product_name")):  # fmt: skip
        try:
            value = (dmi / name).read_text(errors="replace").strip()
        except OSError:
            continue
        if value:
            out[key] = value[:128]
    return out


@dataclass
class Events:
    url: str = ""
    console: TextIO | None = None
    machine: dict[str, str] = field(default_factory=dict)
    release: str = ""
    sent: list[dict[str, Any]] = field(default_factory=list)
    post: Callable[[str, bytes], None] | None = None

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"event": event, "time": round(time.time(), 3), "machine": self.machine}
        if self.release:
            record["release"] = self.release
        record.update(fields)
        self.sent.append(record)
        line = json.dumps(record, sort_keys=True)
        stream = self.console if self.console is not None else sys.stderr
        try:
            stream.write(CONSOLE_PREFIX + line + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass
        if self.url:
            try:
                (self.post or _post)(self.url, line.encode("utf-8"))
            except (OSError, http.client.HTTPException, ImagerError) as exc:
                log.warning("could not send the %s event to %s: %s", event, self.url, exc)
        return record


def _post(url: str, body: bytes) -> None:
    parts = check_url(url, what="events URL")
    host, port = parts.hostname or "", parts.port
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=POST_TIMEOUT_S)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=POST_TIMEOUT_S)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(
            "POST", path, body=body, headers={"Content-Type": "application/json", "User-Agent": USER_AGENT}
        )
        response = conn.getresponse()
        response.read(64 << 10)
        if response.status >= 300:
            raise OSError(f"HTTP {response.status} {response.reason}")
    finally:
        conn.close()
