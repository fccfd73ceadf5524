"""A network namespace of the suite's own, for peers that will not run on loopback.

Public API::

    ADDRESS = "10.255.255.1"
    class NetNamespace:                      # a context manager too
        name: str                            # /run/netns/<name>
        path: Path
        @classmethod
        def create(cls, prefix: str = "ntk8s") -> NetNamespace
        def delete(self) -> None
        def socket(family=AF_INET, kind=SOCK_STREAM) -> socket.socket   # a socket of the namespace

kubeadm refuses to advertise a loopback address (``unable to select an IP from lo network interface``)
and kube-apiserver refuses one for its own Endpoints, so the control plane runs in a namespace whose
``lo`` also carries ``ADDRESS``/32, with a default route on ``lo`` (the kubelet picks it as its node
IP) and IPv4 forwarding on inside the namespace only (kubeadm's preflight asks for it). The host's
interfaces, routes and sysctls are never touched; nothing in the namespace has a route out.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket as socketlib
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from tests.support.peers import run

ADDRESS = "10.255.255.1"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def inside(path: Path, call: Callable[[], T]) -> T:
    """``call()`` on a thread of its own that has entered the network namespace at ``path`` (setns(2)).

    A socket made there belongs to that namespace for good, whichever thread uses it afterwards: this is
    how a test serves inside the namespace without a process of its own. The thread ends with the call,
    so nothing else of this process ever runs inside."""
    result: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
            finally:
                os.close(fd)
            result.append(call())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=body, name=f"netns {path.name}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


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

    def socket(
        self,
        family: socketlib.AddressFamily = socketlib.AF_INET,
        kind: socketlib.SocketKind = socketlib.SOCK_STREAM,
    ) -> socketlib.socket:
        """A new socket of this namespace: bind, listen on or connect it from any thread."""
        return inside(self.path, lambda: socketlib.socket(family, kind))

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"NetNamespace({self.name!r})"
