"""XID errors the NVIDIA driver logged to the kernel log since boot.

The journal (``journalctl -k -b``) keeps every kernel message of this boot; the
kernel ring buffer (``/dev/kmsg``) may have wrapped, so it is the fallback when
the journal has no kernel messages (no journald, or journald without the kernel
log). Lines look like ``NVRM: Xid (PCI:0000:5d:00): 79, pid=..., GPU has fallen off the bus.``
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass

from agent.host import Host
from agent.proc import CommandError, run
from protocol.report import JsonValue, Observation

log = logging.getLogger(__name__)

XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(.*))?")
JOURNAL = "journalctl -k -b"
KMSG = "/dev/kmsg"
SOURCE = "journalctl -k -b (else /dev/kmsg): 'NVRM: Xid (PCI:<bdf>): <n>, ...'"
_MAX_MESSAGE = 300


@dataclass(frozen=True)
class KernelLog:
    source: str
    lines: list[str]
    error: str | None = None
    complete: bool = True  # False when /dev/kmsg no longer holds the first record of the boot


def _journal(host: Host) -> list[str] | None:
    argv = ["journalctl", "-k", "-b", "-o", "cat", "--no-pager", "-q"]
    if not host.is_live:
        argv += ["--root", str(host.root)]
    try:
        result = run(argv, timeout=30, check=False)
    except CommandError as exc:
        log.info("journal unavailable: %s", exc.message)
        return None
    if result.returncode != 0:
        log.info("journalctl exited %d: %s", result.returncode, result.stderr.strip()[:200])
        return None
    lines = [line for line in result.stdout.splitlines() if line and not line.startswith("-- ")]
    return lines or None  # a booted kernel always logs something: nothing means no kernel journal


def _kmsg(host: Host) -> KernelLog:
    path = host.path(KMSG)
    chunks: list[bytes] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return KernelLog(KMSG, [], error=f"{path}: {exc.strerror}")
    try:
        while True:
            try:
                chunk = os.read(fd, 16384)  # /dev/kmsg returns one record per read
            except BlockingIOError:
                break  # read everything there is
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records were overwritten while we read; carry on
                return KernelLog(KMSG, [], error=f"{path}: {exc.strerror}")
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    lines, first_seq = [], None
    for raw in b"".join(chunks).decode("utf-8", "replace").splitlines():
        if not raw or raw.startswith(" "):
            continue  # continuation lines carry KEY=value dictionaries
        header, sep, message = raw.partition(";")
        if not sep:
            continue
        fields = header.split(",")
        if first_seq is None and len(fields) > 1 and fields[1].isascii() and fields[1].isdigit():
            first_seq = int(fields[1])
        lines.append(message)
    return KernelLog(KMSG, lines, complete=first_seq == 0)


def read_kernel_log(host: Host) -> KernelLog:
    lines = _journal(host)
    if lines is not None:
        return KernelLog(JOURNAL, lines)
    return _kmsg(host)


def parse_xids(lines: list[str]) -> list[dict[str, JsonValue]]:
    """One entry per (PCI address, XID): how often, and the first message."""
    seen: dict[tuple[str, int], dict[str, JsonValue]] = {}
    for line in lines:
        match = XID_RE.search(line)
        if not match:
            continue
        key = (match.group(1).lower(), int(match.group(2)))
        entry = seen.get(key)
        if entry is None:
            message = (match.group(3) or "").strip()[:_MAX_MESSAGE] or None
            seen[key] = {"address": key[0], "xid": key[1], "count": 1, "message": message}
        else:
            count = entry["count"]
            entry["count"] = count + 1 if isinstance(count, int) else 1
    return [seen[k] for k in sorted(seen)]


def observe(host: Host) -> Observation:
    klog = read_kernel_log(host)
    return Observation(
        "gpu.xid",
        SOURCE,
        {
            "log": klog.source,
            "error": klog.error,
            "complete_since_boot": klog.complete,
            "events": list(parse_xids(klog.lines)),
        },
    )
