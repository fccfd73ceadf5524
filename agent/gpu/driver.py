"""The NVIDIA kernel driver as the host shows it: modules, version file, device nodes, daemons."""

from __future__ import annotations

import logging
import os
import re
import stat

from agent.host import Host
from protocol.report import JsonValue

log = logging.getLogger(__name__)

MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_peermem")
VERSION_FILE = "/proc/driver/nvidia/version"
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 ..." or
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build ..."
_VERSION_RE = re.compile(r"NVRM version:.*?(Open )?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
# /proc/<pid>/comm holds at most 15 characters.
COMM_LEN = 15


def loaded_modules(host: Host) -> dict[str, bool]:
    """Which NVIDIA modules are loaded: ``/sys/module/<name>`` or a ``/proc/modules`` line."""
    try:
        listed = {line.split()[0] for line in host.read_text("/proc/modules").splitlines() if line.strip()}
    except OSError:
        listed = set()
    return {m: m in listed or host.path(f"/sys/module/{m}").is_dir() for m in MODULES}


def driver_version(host: Host) -> dict[str, JsonValue]:
    """The first line of /proc/driver/nvidia/version, parsed."""
    try:
        first = host.read_text(VERSION_FILE).splitlines()[0].strip()
    except OSError as exc:
        return {"version": None, "flavor": None, "banner": None, "error": f"{VERSION_FILE}: {exc.strerror}"}
    except IndexError:
        return {"version": None, "flavor": None, "banner": "", "error": f"{VERSION_FILE} is empty"}
    match = _VERSION_RE.search(first)
    if not match:
        return {
            "version": None,
            "flavor": None,
            "banner": first,
            "error": f"unrecognised banner in {VERSION_FILE}",
        }
    return {
        "version": match.group(2),
        "flavor": "open" if match.group(1) else "proprietary",
        "banner": first,
        "error": None,
    }


def device_nodes(host: Host, minors: list[int]) -> dict[str, JsonValue]:
    """``char``, ``other`` or ``missing`` for the control, UVM and per-GPU nodes."""
    paths = ["/dev/nvidiactl", "/dev/nvidia-uvm", *(f"/dev/nvidia{m}" for m in sorted(set(minors)))]
    out: dict[str, JsonValue] = {}
    for path in paths:
        try:
            mode = os.stat(host.path(path)).st_mode
        except OSError:
            out[path] = "missing"
            continue
        out[path] = "char" if stat.S_ISCHR(mode) else "other"
    return out


def processes(host: Host, names: tuple[str, ...]) -> dict[str, list[int]]:
    """PIDs whose ``/proc/<pid>/comm`` is each name (compared on the kernel's 15 characters)."""
    wanted = {name[:COMM_LEN]: name for name in names}
    found: dict[str, list[int]] = {name: [] for name in names}
    proc = host.path("/proc")
    try:
        entries = os.listdir(proc)
    except OSError as exc:
        log.warning("cannot list %s: %s", proc, exc)
        return found
    for entry in entries:
        if not entry.isascii() or not entry.isdigit():
            continue
        try:
            comm = (proc / entry / "comm").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue  # the process ended while we looked
        if comm in wanted:
            found[wanted[comm]].append(int(entry))
    return {name: sorted(pids) for name, pids in found.items()}
