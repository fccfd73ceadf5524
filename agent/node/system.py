"""Node preflight read from the kernel: clock, swap, modules, sysctls, cgroups, host name, network, disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import socket
import struct

from agent.host import Host
from protocol.report import JsonValue

log = logging.getLogger(__name__)
_DECIMAL = re.compile(r"[0-9]{1,20}")
_HEX32 = re.compile(r"[0-9A-Fa-f]{1,8}")

Obs = dict[str, JsonValue]

SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
)
DISK_PATHS = ("/var/lib/containerd", "/var/log")


class _Timex(ctypes.Structure):
    """``struct timex`` from <sys/timex.h> (glibc, LP64)."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time_sec", ctypes.c_long),
        ("time_usec", ctypes.c_long),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


def time_sync() -> Obs:
    """adjtimex(2) with no modes set: reads the kernel's NTP state, changes nothing.

    The kernel clock is shared by every container on the host, so this reads the
    host's clock even under ``--host-root``.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        tx = _Timex()
        state = libc.adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError) as exc:
        return {"state": None, "status": None, "max_error_us": None, "error": str(exc)}
    if state < 0:
        return {
            "state": None,
            "status": None,
            "max_error_us": None,
            "error": os.strerror(ctypes.get_errno()),
        }
    return {"state": int(state), "status": int(tx.status), "max_error_us": int(tx.maxerror), "error": None}


def swap(host: Host) -> Obs:
    try:
        lines = host.read_text("/proc/swaps").splitlines()[1:]
    except OSError as exc:
        return {"devices": [], "error": f"/proc/swaps: {exc.strerror}"}
    devices: list[JsonValue] = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and _DECIMAL.fullmatch(parts[2]):
            devices.append({"name": parts[0], "type": parts[1], "size_kib": int(parts[2])})
    return {"devices": devices, "error": None}


def kernel_modules(host: Host) -> Obs:
    try:
        listed = {ln.split()[0] for ln in host.read_text("/proc/modules").splitlines() if ln.strip()}
    except OSError:
        listed = set()
    try:
        filesystems = {
            ln.split()[-1] for ln in host.read_text("/proc/filesystems").splitlines() if ln.strip()
        }
    except OSError:
        filesystems = set()
    out: Obs = {}
    for name, builtin_sign, builtin_present in (
        ("overlay", "/proc/filesystems lists overlay", "overlay" in filesystems),
        (
            "br_netfilter",
            "/proc/sys/net/bridge/bridge-nf-call-iptables exists",
            host.path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists(),
        ),
    ):
        if name in listed:
            evidence: str | None = "/proc/modules"
        elif host.path(f"/sys/module/{name}").is_dir():
            evidence = f"/sys/module/{name}"
        elif builtin_present:
            evidence = builtin_sign
        else:
            evidence = None
        out[name] = {"available": evidence is not None, "evidence": evidence}
    return out


def sysctls(host: Host) -> Obs:
    values: dict[str, JsonValue] = {}
    for key in SYSCTLS:
        try:
            values[key] = host.read_text("/proc/sys/" + key.replace(".", "/")).strip()
        except OSError:
            values[key] = None
    return {"values": values}


def cgroup(host: Host) -> Obs:
    """The file system type mounted last at /sys/fs/cgroup in PID 1's mount namespace."""
    fs_type = None
    for source in ("/proc/1/mountinfo", "/proc/self/mountinfo"):
        try:
            text = host.read_text(source)
        except OSError:
            continue
        for line in text.splitlines():
            left, sep, right = line.partition(" - ")
            fields = left.split()
            if sep and len(fields) >= 5 and fields[4] == "/sys/fs/cgroup":
                fs_type = right.split()[0] if right.split() else None
        break
    try:
        controllers = host.read_text("/sys/fs/cgroup/cgroup.controllers").split()
    except OSError:
        controllers = []
    return {"fs_type": fs_type, "controllers": list(controllers)}


def hostname(host: Host) -> Obs:
    try:
        return {"hostname": host.read_text("/proc/sys/kernel/hostname").strip(), "error": None}
    except OSError as exc:
        return {"hostname": None, "error": f"/proc/sys/kernel/hostname: {exc.strerror}"}


def network(host: Host) -> Obs:
    """Local IPv4 addresses from /proc/net/fib_trie and the default route from /proc/net/route."""
    try:
        trie = host.read_text("/proc/net/fib_trie").splitlines()
        routes = host.read_text("/proc/net/route").splitlines()[1:]
    except OSError as exc:
        return {"ipv4_addresses": [], "default_route": None, "error": str(exc)}
    addresses: set[str] = set()
    last = None
    for line in trie:
        stripped = line.strip()
        if stripped.startswith(("|--", "+--")):
            last = stripped.split()[1]
        elif stripped.startswith("/32 host LOCAL") and last:
            addresses.add(last)
    default: JsonValue = None
    for line in routes:
        f = line.split()
        if len(f) < 8 or not all(_HEX32.fullmatch(x) for x in (f[2], f[3])):
            continue  # not a route line of the kernel's format
        if f[1] == "00000000" and f[7] == "00000000" and int(f[3], 16) & 0x1:
            gateway = socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))
            default = {"interface": f[0], "gateway": gateway}
            break
    ordered: list[JsonValue] = [a for a in sorted(addresses, key=socket.inet_aton)]
    return {
        "ipv4_addresses": ordered,
        "default_route": default,
        "error": None,
    }


def disk(host: Host) -> Obs:
    paths: list[JsonValue] = []
    for path in DISK_PATHS:
        measured = host.path(path)
        while not measured.exists() and measured != measured.parent:
            measured = measured.parent
        try:
            st = os.statvfs(measured)
        except OSError as exc:
            paths.append({"path": path, "measured": str(measured), "error": exc.strerror})
            continue
        paths.append(
            {
                "path": path,
                "measured": str(measured),
                "free_bytes": st.f_bavail * st.f_frsize,
                "total_bytes": st.f_blocks * st.f_frsize,
                "error": None,
            }
        )
    return {"paths": paths}
