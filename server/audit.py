"""The audit log: one JSON object per line for every attestation and join attempt.

Each line says when, what (``event``), who (peer address, SPIFFE ID, EK hash),
the result (``ok`` or ``denied``/``error``/``cancelled``), the gRPC status, a stable
``reason`` slug and a human ``message``. Secrets (challenge secrets, tokens,
keys) are never written: callers pass only the fields below, and
:meth:`AuditLog.write` refuses keys that look secret.

A stranger decides some of these values (the attestor type, the pool and node
name it asks for), so every field is bounded before it is written: strings to
:data:`MAX_FIELD_CHARS` (longer ones keep their start and say how much was cut),
lists to :data:`MAX_LIST_ITEMS`. The file rotates at ``max_bytes`` keeping
``backups`` old files, and nothing is written while the file system holding it has
less than ``min_free_bytes`` free: :class:`AuditUnavailableError` then tells the
caller to refuse the request (``UNAVAILABLE``, reason ``audit_unavailable``), so the
server never fills its disk on a stranger's behalf and never acts without a trail.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from server.errors import ServerError

log = logging.getLogger(__name__)

_FORBIDDEN = ("secret", "token", "key", "password", "credential")
_ALLOWED_WITH_FORBIDDEN_WORD = {"token_id", "token_expires_at", "token_reused", "token_revoked"}
MAX_FIELD_CHARS = 256
MAX_MESSAGE_CHARS = 1024
MAX_LIST_ITEMS = 32
_FREE_CHECK_INTERVAL_S = 1.0


class AuditUnavailableError(ServerError):
    """The audit line cannot be written (disk full, I/O error): the request is refused."""

    grpc_code = "UNAVAILABLE"
    reason = "audit_unavailable"


def bound(value: Any, limit: int = MAX_FIELD_CHARS) -> Any:
    """``value`` cut to size for a log or audit line (strings, lists, nested mappings)."""
    if isinstance(value, str):
        if len(value) <= limit:
            return value
        return f"{value[:limit]}...(+{len(value) - limit} chars)"
    if isinstance(value, bytes):
        return bound(value.decode("utf-8", "replace"), limit)
    if isinstance(value, list | tuple):
        items = [bound(v, limit) for v in value[:MAX_LIST_ITEMS]]
        if len(value) > MAX_LIST_ITEMS:
            items.append(f"...(+{len(value) - MAX_LIST_ITEMS} items)")
        return items
    if isinstance(value, dict):
        return {bound(str(k), 64): bound(v, limit) for k, v in list(value.items())[:MAX_LIST_ITEMS]}
    return value


class AuditLog:
    """Append-only JSON-lines audit log, mode 0600, safe to call from several threads."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 256 * 1024 * 1024,
        backups: int = 4,
        min_free_bytes: int = 256 * 1024 * 1024,
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.min_free_bytes = min_free_bytes
        self._free_bytes = free_bytes or _free_bytes
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
        self._lock = threading.Lock()
        self._fh: TextIO = self._open()
        self._size = os.fstat(self._fh.fileno()).st_size
        self._free_checked = 0.0
        self._free_ok = True

    def _open(self) -> TextIO:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", buffering=1, encoding="utf-8")

    def healthy(self) -> bool:
        """False while a write would be refused (too little free space): refuse work early."""
        with self._lock:
            return self._space_ok()

    def _space_ok(self) -> bool:
        now = time.monotonic()
        if now - self._free_checked >= _FREE_CHECK_INTERVAL_S:
            self._free_checked = now
            try:
                self._free_ok = self._free_bytes(self.path.parent) >= self.min_free_bytes
            except OSError:
                self._free_ok = False
            if not self._free_ok:
                log.error(
                    "audit log %s: less than %d bytes free; refusing requests until space is freed",
                    self.path,
                    self.min_free_bytes,
                )
        return self._free_ok

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        for k in fields:
            if k not in _ALLOWED_WITH_FORBIDDEN_WORD and any(w in k.lower() for w in _FORBIDDEN):
                raise ValueError(f"refusing to audit a field named {k!r}")
        record: dict[str, Any] = {"ts": round(time.time(), 3), "event": event}
        for k, v in fields.items():
            record[k] = bound(v, MAX_MESSAGE_CHARS if k == "message" else MAX_FIELD_CHARS)
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._space_ok():
                raise AuditUnavailableError("the server cannot write its audit log: its disk is nearly full")
            try:
                if self._size + len(line) > self.max_bytes:
                    self._rotate()
                self._fh.write(line)
                self._fh.flush()
            except OSError as exc:
                log.error("cannot write the audit log %s: %s", self.path, exc)
                raise AuditUnavailableError("the server cannot write its audit log") from exc
            self._size += len(line.encode())
        return record

    def _rotate(self) -> None:
        """audit.jsonl -> audit.jsonl.1 -> ... -> audit.jsonl.<backups> (the oldest is dropped)."""
        self._fh.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            oldest = self.path.with_name(f"{self.path.name}.{self.backups}")
            oldest.unlink(missing_ok=True)
            for n in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{n}")
                if src.exists():
                    src.rename(self.path.with_name(f"{self.path.name}.{n + 1}"))
            self.path.rename(self.path.with_name(f"{self.path.name}.1"))
        self._fh = self._open()
        self._size = 0
        log.info("audit log rotated (%s, keeping %d)", self.path, self.backups)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
