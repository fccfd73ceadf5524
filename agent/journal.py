"""Logging for a process that may run under systemd: syslog priorities for journald, plain text otherwise.

Public API::

    setup_logging(verbosity: int) -> None      # 0: warnings (info under journald), 1: info, 2+: debug
    fields(**values: object) -> dict[str, Any]  # log.info("...", extra=fields(step="attest", attempt=2))
    under_journald(stream: TextIO | None = None) -> bool
    class JournalFormatter(logging.Formatter)   # "<4>agent.lifecycle: message STEP=attest"
    class HumanFormatter(logging.Formatter)     # "WARNING agent.lifecycle: message STEP=attest"
    PRIORITIES: dict[int, int]                  # logging level -> syslog priority

When stderr is the journal stream systemd gave the unit (``$JOURNAL_STREAM``
names its device and inode; both are compared, so a child whose stderr was
redirected does not believe it), every line starts with ``<N>``: journald
strips it and stores N as ``PRIORITY`` (``SyslogLevelPrefix=yes``, the default),
so ``journalctl -u nodeagent -p warning`` works. Structured hints go at the end
of the line as ``KEY=value`` pairs, sorted by key; a value with spaces, quotes or
``=`` is JSON-quoted. Keys are journal-style field names (upper case, digits, ``_``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any, TextIO

PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}
_EXTRA = "journal_fields"
_FIELD_RE = re.compile(r"\A[A-Z][A-Z0-9_]*\Z")
_PLAIN_VALUE = re.compile(r'\A[^\s"=\\]+\Z')
_HANDLER_MARK = "_nodeagent_journal_handler"


def fields(**values: object) -> dict[str, Any]:
    """``extra=`` for a logging call carrying structured hints; names become upper case."""
    out = {}
    for name, value in values.items():
        key = name.upper()
        if not _FIELD_RE.match(key):
            raise ValueError(
                f"journal field names are letters, digits and '_', starting with a letter: {name!r}"
            )
        out[key] = "" if value is None else str(value)
    return {_EXTRA: out}


def priority(levelno: int) -> int:
    """The syslog priority for a logging level (levels between the named ones round down in severity)."""
    for level in sorted(PRIORITIES, reverse=True):
        if levelno >= level:
            return PRIORITIES[level]
    return 7


def _suffix(record: logging.LogRecord) -> str:
    hints = getattr(record, _EXTRA, None)
    if not isinstance(hints, dict) or not hints:
        return ""
    parts = []
    for key in sorted(hints):
        value = str(hints[key])
        parts.append(f"{key}={value}" if _PLAIN_VALUE.match(value) else f"{key}={json.dumps(value)}")
    return " " + " ".join(parts)


class _Base(logging.Formatter):
    def _body(self, record: logging.LogRecord) -> str:
        text = f"{record.name}: {record.getMessage()}{_suffix(record)}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


class JournalFormatter(_Base):
    """Each line prefixed ``<N>`` (syslog priority), so a traceback keeps its record's priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in self._body(record).splitlines() or [""])


class HumanFormatter(_Base):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname} {self._body(record)}"


def under_journald(stream: TextIO | None = None) -> bool:
    """True if ``stream`` (default stderr) is the journal stream named by ``$JOURNAL_STREAM``."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    stream = stream if stream is not None else sys.stderr
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def setup_logging(verbosity: int) -> None:
    """Configure the root logger once (calling it again replaces what it installed)."""
    journald = under_journald()
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    if journald:
        level = min(level, logging.INFO)  # the journal is where an operator reads the progress
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if journald else HumanFormatter())
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(level)
