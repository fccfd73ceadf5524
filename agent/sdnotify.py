"""sd_notify(3) without a dependency: tell systemd what the agent is doing.

Public API::

    notify(**fields: str) -> bool    # notify(STATUS="attesting", READY="1"); False when not under systemd
    status(text: str) -> bool        # notify(STATUS=text)

Messages are ``KEY=value`` lines in one datagram to ``$NOTIFY_SOCKET`` (a path,
or an abstract socket when it starts with ``@``). The unit sets
``NotifyAccess=main``, so only the agent's own process may send; what it sends
shows in ``systemctl status nodeagent``. Sending is best effort: a missing or
broken socket is logged at debug level and never raises.
"""

from __future__ import annotations

import logging
import os
import re
import socket

log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"\A[A-Z][A-Z0-9_]*\Z")
_MAX_STATUS = 1024


def _address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock: and other forms systemd >= 254 may use are not needed here


def notify(**fields: str) -> bool:
    """Send ``fields`` to systemd; True if the datagram was sent."""
    target = os.environ.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    address = _address(target)
    if address is None:
        log.debug("NOTIFY_SOCKET %r is not a unix socket; not notifying", target)
        return False
    lines = []
    for key, value in fields.items():
        if not _KEY_RE.match(key):
            raise ValueError(f"sd_notify field names are upper-case identifiers, got {key!r}")
        # One field per line: a newline in a value would start a forged field.
        clean = " ".join(str(value).split())[:_MAX_STATUS]
        lines.append(f"{key}={clean}")
    if not lines:
        return False
    payload = ("\n".join(lines) + "\n").encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
    except OSError as exc:
        log.debug("could not notify systemd at %s: %s", target, exc)
        return False
    return True


def status(text: str) -> bool:
    """``STATUS=text``: the one-line state shown by ``systemctl status``."""
    return notify(STATUS=text)
