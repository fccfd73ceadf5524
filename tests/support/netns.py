"""A network namespace of the suite's own, for peers that will not run on loopback.

Public API::

    ADDRESS = "10.255.255.1"
    class NetNamespace:                      # a context manager too
        name: str                            # /run/netns/<name>
        path: Path
        @classmethod
        def create(cls, prefix: str = "ntk8s") -> NetNamespace
        def delete(self) -> None

kubeadm refuses to advertise a loopback address (``unable to select an IP from lo network interface``)
and kube-apiserver refuses one for its own Endpoints, so the control plane runs in a namespace whose
``lo`` also carries ``ADDRESS``/32, with a default route on ``lo`` (the kubelet picks it as its node
IP) and IPv4 forwarding on inside the namespace only (kubeadm's preflight asks for it). The host's
interfaces, routes and sysctls are never touched; nothing in the namespace has a route out.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from types import TracebackType

from tests.support.peers import run

ADDRESS = "10.255.255.1"


class NetNamespace:
    def __init__(self, name: str) -> None:
        self.name = name
        self.path = Path("/run/netns") / name

    @classmethod
    def create(cls, prefix: str = "ntk8s") -> NetNamespace:
        """A new namespace ``<prefix>-<pid>-<random>``, so concurrent test runs never share one."""
        ns = cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}")
        run(["ip", "netns", "add", ns.name])
        try:
            for argv in (
                ["ip", "link", "set", "lo", "up"],
                ["ip", "addr", "add", f"{ADDRESS}/32", "dev", "lo"],
                ["ip", "route", "add", "default", "dev", "lo"],
                ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            ):
                run(argv, netns=ns.name)
        except BaseException:
            ns.delete()
            raise
        return ns

    def delete(self) -> None:
        if self.path.exists():
            run(["ip", "netns", "delete", self.name], check=False)

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"NetNamespace({self.name!r})"
