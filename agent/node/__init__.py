"""Node preflight: what kubelet and kubeadm need from the host before the node may join."""

from __future__ import annotations

from agent.host import Host
from agent.node import system, tools
from protocol.report import Observation


def collect(
    host: Host, *, will_run: str | None = None, carried: list[str] | None = None
) -> list[Observation]:
    """Every node observation; ``will_run``/``carried``: the Kubernetes version the join will run and the
    versions the image carries (agent.kubeversion), for ``node.kubelet``."""
    return [
        Observation("node.time_sync", "adjtimex(2) (modes 0: read only)", system.time_sync()),
        Observation("node.swap", "/proc/swaps", system.swap(host)),
        Observation(
            "node.kernel_modules",
            "/proc/modules, /sys/module/<name>, /proc/filesystems, /proc/sys/net/bridge",
            system.kernel_modules(host),
        ),
        Observation("node.sysctl", "/proc/sys/net/...", system.sysctls(host)),
        Observation(
            "node.cgroup", "/proc/1/mountinfo, /sys/fs/cgroup/cgroup.controllers", system.cgroup(host)
        ),
        Observation(
            "node.container_runtime",
            "`containerd --version`, `crio --version`; their sockets",
            tools.container_runtime(host),
        ),
        Observation("node.network", "/proc/net/fib_trie, /proc/net/route", system.network(host)),
        Observation("node.disk", "statvfs(2)", system.disk(host)),
        Observation("node.hostname", "/proc/sys/kernel/hostname", system.hostname(host)),
        Observation(
            "node.kubelet",
            "`kubelet --version`",
            tools.kubelet(will_run=will_run, carried=carried),
        ),
    ]
