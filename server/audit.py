"""The audit log: one JSON object per line for every attestation and join attempt.

Each line says when, what (``event``), who (peer address, SPIFFE ID, EK hash),
the result (``ok`` or ``denied``/``error``), the gRPC status, a stable
``reason`` slug and a human ``message``. Secrets (challenge secrets, tokens,
keys) are never written: callers pass only the fields below, and
:meth:`AuditLog.write` refuses keys that look secret.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

_FORBIDDEN = ("secret", "token", "key", "password", "credential")
_ALLOWED_WITH_FORBIDDEN_WORD = {"token_id", "token_expires_at"}


class AuditLog:
    """Append-only JSON-lines audit log, mode 0600, safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.chmod(path, 0o600)
        self._fh: TextIO = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        for k in fields:
            if k not in _ALLOWED_WITH_FORBIDDEN_WORD and any(w in k.lower() for w in _FORBIDDEN):
                raise ValueError(f"refusing to audit a field named {k!r}")
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
        with self._lock:
            self._fh.write(line + "\n")
        return record

    def close(self) -> None:
        with self._lock:
            self._fh.close()
