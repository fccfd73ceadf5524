"""The build VM's lifecycle through libvirt: define, start, observe, destroy, undefine.

The domain is defined persistently for the length of the build so that, once it stops,
libvirt still says *why* (guest power-off, crash, destroyed, QEMU failed); it is
undefined (with its NVRAM) as soon as the build no longer needs it, whatever happened.
Every domain carries its build id and the builder's pid in its metadata, so
:func:`remove_orphans` can clean up after a builder that was killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from imagebuilder import interrupt
from imagebuilder.domain import NT_NS
from imagebuilder.errors import VmError

log = logging.getLogger(__name__)

DOMAIN_PREFIX = "imagebuilder-"


def _libvirt() -> Any:
    try:
        import libvirt
    except ImportError as exc:
        raise VmError(
            "the libvirt Python binding is not installed",
            hint="pip install 'nodetrust[builder]' (libvirt-python) and apt-get install libvirt-dev",
        ) from exc
    return libvirt


@dataclass(frozen=True)
class DomainState:
    running: bool
    state: str  # running, paused, shutoff, crashed, pmsuspended, ...
    reason: str  # for shutoff: shutdown, destroyed, crashed, failed, ...


_STATE_NAMES = {
    0: "nostate",
    1: "running",
    2: "blocked",
    3: "paused",
    4: "shutdown",
    5: "shutoff",
    6: "crashed",
    7: "pmsuspended",
}
_SHUTOFF_REASONS = {
    0: "unknown",
    1: "shutdown",
    2: "destroyed",
    3: "crashed",
    4: "migrated",
    5: "saved",
    6: "failed",
    7: "from-snapshot",
    8: "daemon",
}
_CRASHED_REASONS = {0: "unknown", 1: "panicked"}


def _ignore_error(_ctx: object, _err: object) -> None:
    return None


class Connection:
    """A libvirt connection (``qemu:///system`` by default)."""

    def __init__(self, uri: str) -> None:
        libvirt = _libvirt()
        self.uri = uri
        # libvirt prints every error to stderr by default; the builder reports them itself
        libvirt.registerErrorHandler(_ignore_error, None)
        try:
            self.conn = libvirt.open(uri)
        except libvirt.libvirtError as exc:
            raise VmError(
                f"cannot connect to libvirt at {uri}: {exc.get_error_message()}",
                hint="start libvirtd and virtlogd (scripts/services.sh start, or systemctl start libvirtd) "
                "or pass --libvirt-uri",
            ) from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    def versions(self) -> dict[str, str]:
        def fmt(v: int) -> str:
            return f"{v // 1000000}.{(v // 1000) % 1000}.{v % 1000}"

        out = {"libvirt": fmt(self.conn.getLibVersion())}
        with contextlib.suppress(Exception):
            out["hypervisor"] = f"{self.conn.getType()} {fmt(self.conn.getVersion())}"
        return out

    def domain_names(self) -> list[str]:
        return sorted(d.name() for d in self.conn.listAllDomains(0))

    @contextlib.contextmanager
    def domain(self, xml: str) -> Iterator[Domain]:
        """Define and start ``xml``; destroy and undefine it on the way out, whatever happened."""
        libvirt = _libvirt()
        try:
            dom = self.conn.defineXML(xml)
        except libvirt.libvirtError as exc:
            raise VmError(f"libvirt refused the build VM: {exc.get_error_message()}") from exc
        domain = Domain(dom)
        try:
            try:
                dom.create()
            except libvirt.libvirtError as exc:
                raise VmError(
                    f"the build VM did not start: {exc.get_error_message()}",
                    hint="see the libvirt log (/var/log/libvirt/qemu/<domain>.log); is another VM using the memory?",
                ) from exc
            log.info("build VM %s started", domain.name)
            yield domain
        finally:
            domain.remove()


class Domain:
    def __init__(self, dom: Any) -> None:
        self.dom = dom
        self.name: str = dom.name()
        self._last = DomainState(False, "unknown", "unknown")

    def state(self) -> DomainState:
        libvirt = _libvirt()
        try:
            state, reason = self.dom.state()
        except libvirt.libvirtError:
            return DomainState(False, "gone", "unknown")
        name = _STATE_NAMES.get(state, str(state))
        if name == "shutoff":
            why = _SHUTOFF_REASONS.get(reason, str(reason))
        elif name == "crashed":
            why = _CRASHED_REASONS.get(reason, str(reason))
        else:
            why = str(reason)
        # "shutdown" is the moment between the guest's power-off request and the domain stopping
        self._last = DomainState(
            name in ("running", "blocked", "paused", "shutdown", "pmsuspended"), name, why
        )
        return self._last

    def destroy(self) -> None:
        libvirt = _libvirt()
        with contextlib.suppress(libvirt.libvirtError):
            if self.dom.isActive():
                self.dom.destroy()

    def remove(self) -> None:
        """Destroy (if running) and undefine, NVRAM included; a signal meanwhile waits until it is done."""
        libvirt = _libvirt()
        with interrupt.deferred():
            self.destroy()
            flags = getattr(libvirt, "VIR_DOMAIN_UNDEFINE_NVRAM", 0)
            try:
                self.dom.undefineFlags(flags)
            except libvirt.libvirtError:
                with contextlib.suppress(libvirt.libvirtError):
                    self.dom.undefine()
        log.debug("build VM %s removed", self.name)


def owner_metadata() -> dict[str, str]:
    return {"host": socket.gethostname(), "pid": str(os.getpid())}


def remove_orphans(conn: Connection) -> list[str]:
    """Remove ``imagebuilder-*`` domains of this host whose builder process is gone."""
    libvirt = _libvirt()
    removed = []
    for dom in conn.conn.listAllDomains(0):
        name = dom.name()
        if not name.startswith(DOMAIN_PREFIX):
            continue
        try:
            root = ET.fromstring(dom.XMLDesc(0))  # noqa: S314 - libvirt's own XML, from the local daemon
        except (libvirt.libvirtError, ET.ParseError):
            continue
        build = root.find(f"metadata/{{{NT_NS}}}build")
        if build is None:
            continue
        host = build.findtext(f"{{{NT_NS}}}host", "")
        pid = build.findtext(f"{{{NT_NS}}}pid", "")
        if host != socket.gethostname() or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        log.warning("removing the build VM %s left behind by a builder that is gone (pid %s)", name, pid)
        Domain(dom).remove()
        removed.append(name)
    return removed
