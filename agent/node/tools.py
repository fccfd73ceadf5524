"""Node preflight that asks programs: the container runtime and the kubelet (through agent.proc.run)."""

from __future__ import annotations

import logging
import re
import stat

from agent.host import Host
from agent.proc import CommandError, run
from protocol.report import JsonValue

log = logging.getLogger(__name__)

Obs = dict[str, JsonValue]

RUNTIMES = (
    ("containerd", ["containerd", "--version"], "/run/containerd/containerd.sock"),
    ("cri-o", ["crio", "--version"], "/var/run/crio/crio.sock"),
)
_SEMVER = re.compile(r"\bv?(\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.+-]+)?)\b")
_CRIO = re.compile(r"(?im)^\s*(?:crio\s+)?version[:\s]+v?(\d+\.\d+\.\d+\S*)")
_KUBELET = re.compile(r"Kubernetes\s+(v\d+\.\d+\.\d+\S*)")


def parse_runtime_version(name: str, output: str) -> str | None:
    """``containerd github.com/containerd/containerd v1.7.24 88bf19b`` -> ``1.7.24``; also CRI-O's output."""
    if name == "cri-o":
        match = _CRIO.search(output)
        if match:
            return match.group(1)
    match = _SEMVER.search(output)
    return match.group(1) if match else None


def parse_kubelet_version(output: str) -> str | None:
    """``Kubernetes v1.31.2`` -> ``v1.31.2``."""
    match = _KUBELET.search(output)
    return match.group(1) if match else None


def _socket_present(host: Host, path: str) -> bool:
    try:
        return stat.S_ISSOCK(host.path(path).stat().st_mode)
    except OSError:
        return False


def container_runtime(host: Host) -> Obs:
    runtimes: list[JsonValue] = []
    for name, argv, socket_path in RUNTIMES:
        entry: dict[str, JsonValue] = {"name": name, "socket": socket_path}
        try:
            result = run(argv, timeout=15)
        except CommandError as exc:
            entry.update(version=None, error=exc.message, socket_present=_socket_present(host, socket_path))
            runtimes.append(entry)
            continue
        version = parse_runtime_version(name, result.stdout + result.stderr)
        entry.update(
            version=version,
            error=None if version else f"unrecognised `{' '.join(argv)}` output",
            socket_present=_socket_present(host, socket_path),
        )
        runtimes.append(entry)
    return {"runtimes": runtimes}


def kubelet(*, will_run: str | None = None, carried: list[str] | None = None) -> Obs:
    """The installed kubelet's version, and the version that will run at the join (agent.kubeversion.predict)
    with the versions the image carries: the skew check judges ``will_run`` when it is set."""
    extra: Obs = {}
    if will_run is not None:
        extra = {"will_run": will_run, "carried": list(carried or [])}
    try:
        result = run(["kubelet", "--version"], timeout=15)
    except CommandError as exc:
        return {"version": None, "raw": None, "error": exc.message, **extra}
    raw = (result.stdout + result.stderr).strip()
    version = parse_kubelet_version(raw)
    return {
        "version": version,
        "raw": raw[:200],
        "error": None if version else "unrecognised output",
        **extra,
    }
