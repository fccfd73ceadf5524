"""Watching the installer: its events, its console, the data port, and an idle watchdog per phase.

Sources, all optional but the console:

* :class:`EventListener`: the installer's webhook reporting (curtin-style JSON events
  POSTed to ``/nodetrust/<token>/events``) on the host's loopback. It reads requests one
  after another on each connection, so it also works behind QEMU's ``guestfwd`` character
  device, which carries every guest connection over one host connection.
* the serial console (a file written by libvirt): the ``print`` reporter's
  ``start:``/``finish:`` lines and the installer's own messages;
* the data port (a second serial port): the staging step's package list and markers.

:class:`Watcher` moves through the phases ``boot`` (until the first installer event),
``install``, ``late`` (the staging late-command) and ``shutdown`` (until the VM powers
itself off). A phase that shows no progress (no console output, event or data) for its
idle limit fails the build with a diagnosis; so do the installer's confirmation
prompt, its interactive fallback, an installer error (with the logs error-commands
dumped) and a guest kernel panic.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from imagebuilder.definition import Watchdog
from imagebuilder.errors import InstallerError, VmError
from imagebuilder.vm import DomainState

log = logging.getLogger(__name__)

PHASES = ("boot", "install", "late", "shutdown")
CONFIRMATION = "Continue with autoinstall? (yes|no)"
INTERACTIVE = re.compile(
    r"Use UP, DOWN and ENTER keys to select your language|Willkommen! Bienvenue! Welcome!"
)
PANIC = re.compile(r"Kernel panic - not syncing.*")
INSTALLER_ERROR = re.compile(r"An error occurred during installation.*")
PRINTED_EVENT = re.compile(r"(start|finish): (\S+): (?:(SUCCESS|WARN|FAIL): )?(.*)")  # fullmatch
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ERROR_DUMP_WAIT_S = 120.0
TAIL_LINES = 30


@dataclass(frozen=True)
class InstallerEvent:
    event_type: str
    name: str
    description: str
    result: str = ""
    level: str = "INFO"
    source: str = "webhook"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstallerEvent:
        return cls(
            event_type=str(data.get("event_type", "")),
            name=str(data.get("name", "")),
            description=str(data.get("description", "")),
            result=str(data.get("result", "")),
            level=str(data.get("level", "INFO")),
        )


# -- the webhook listener -------------------------------------------------------------------


class EventListener:
    """Loopback HTTP endpoint for the installer's webhook reporting."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.events: queue.Queue[InstallerEvent] = queue.Queue()
        self.received = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="event-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="event-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while not self._closed.is_set():
                try:
                    request, buffer = _read_request(conn, buffer)
                except (OSError, ValueError):
                    return
                if request is None:
                    return
                method, path, body = request
                ok = method == "POST" and path == f"/nodetrust/{self.token}/events"
                if ok:
                    with contextlib.suppress(ValueError, AttributeError):
                        self.events.put(InstallerEvent.from_json(json.loads(body)))
                        self.received += 1
                status = b"200 OK" if ok else b"404 Not Found"
                try:
                    conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[tuple[str, str, bytes] | None, bytes]:
    """One HTTP/1.x request (method, path, body) from ``buffer`` + the socket; None at end of stream."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        buffer += chunk
        if len(buffer) > 1 << 20:
            raise ValueError("request head too large")
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) < 2:
        raise ValueError(f"bad request line {lines[0]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0") or 0)
    if length > 1 << 20:
        raise ValueError("request body too large")
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        rest += chunk
    return (parts[0], parts[1], rest[:length]), rest[length:]


# -- files that grow ---------------------------------------------------------------------------


class LineTail:
    """New complete lines of a growing file (the console, the data port); keeps the last ones."""

    def __init__(self, path: Path, keep: int = 200) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.recent: collections.deque[str] = collections.deque(maxlen=keep)
        self.total_bytes = 0

    def read(self) -> list[str]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        if not data:
            return []
        self.offset += len(data)
        self.total_bytes += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        lines = [ANSI.sub("", raw.decode("utf-8", errors="replace")).replace("\r", "") for raw in complete]
        self.recent.extend(lines)
        return lines

    def tail(self, n: int = TAIL_LINES) -> str:
        lines = list(self.recent)[-n:]
        if self.partial:
            lines.append(self.partial.decode("utf-8", errors="replace"))
        return "\n".join(lines)


# -- the data port ------------------------------------------------------------------------------


@dataclass
class DataPort:
    stage_begun: bool = False
    stage_done: bool = False
    stage_failed: int | None = None
    installed_size: int | None = None
    packages: list[dict[str, str]] | None = None
    error_dump: list[str] | None = None
    boot: dict[str, str] | None = None  # export: root, vmlinuz, initrd.img ("<sha256>:<size>")
    _packages: list[str] | None = None
    _dump: list[str] | None = None

    def feed(self, line: str) -> None:
        line = line.rstrip()
        if self._packages is not None:
            if line.startswith("NODETRUST-PACKAGES-END"):
                self.packages = _check_packages(self._packages, line)
                self._packages = None
            else:
                self._packages.append(line)
            return
        if self._dump is not None:
            if line == "NODETRUST-INSTALLER-LOGS-END":
                self.error_dump, self._dump = self._dump, None
            else:
                self._dump.append(line)
            return
        if line == "NODETRUST-STAGE-BEGIN":
            self.stage_begun = True
        elif line == "NODETRUST-STAGE-DONE":
            self.stage_done = True
        elif line == "NODETRUST-PACKAGES-BEGIN":
            self._packages = []
        elif line == "NODETRUST-INSTALLER-LOGS-BEGIN":
            self._dump = []
        elif line.startswith("NODETRUST-INSTALLED-SIZE "):
            with contextlib.suppress(ValueError):
                self.installed_size = int(line.split()[1])
        elif line.startswith("NODETRUST-STAGE-FAILED"):
            parts = line.split()
            self.stage_failed = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 1
        elif line.startswith("NODETRUST-BOOT "):
            self.boot = dict(word.partition("=")[::2] for word in line.split()[1:] if "=" in word)


def _check_packages(lines: list[str], end: str) -> list[dict[str, str]]:
    parts = end.split()
    if len(parts) != 3:
        raise InstallerError(f"the package list on the data port ends badly: {end!r}")
    count, digest = int(parts[1]), parts[2]
    actual = hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()
    if len(lines) != count or actual != digest:
        raise InstallerError(
            f"the package list on the data port is damaged ({len(lines)} of {count} lines, sha256 {actual} "
            f"instead of {digest})",
            hint="the data port carries nothing else; a damaged list means a lost or garbled serial transfer",
        )
    packages = []
    for line in lines:
        fields = line.split("\t")
        if len(fields) != 3:
            raise InstallerError(f"the package list has a bad line: {line!r}")
        packages.append({"name": fields[0].split(":")[0], "version": fields[1], "architecture": fields[2]})
    return packages


# -- the watcher ----------------------------------------------------------------------------------


class DomainLike(Protocol):
    name: str

    def state(self) -> DomainState: ...


@dataclass
class PhaseTiming:
    name: str
    started_at: float  # wall clock (time.time())
    duration_s: float = 0.0


@dataclass
class WatchResult:
    packages: list[dict[str, str]]
    installed_size: int | None
    phases: list[PhaseTiming]
    events: int
    fail_events: list[str] = field(default_factory=list)
    boot: dict[str, str] | None = None


class Watcher:
    """The installer run: ``boot``, ``install``, ``late`` (the base plan of stage.sh), ``shutdown``."""

    PHASES: tuple[str, ...] = PHASES
    STAGE_PHASE = "late"  # entered at NODETRUST-STAGE-BEGIN
    WHAT = "the installer"

    def __init__(
        self,
        domain: DomainLike,
        console: Path,
        data: Path,
        listener: EventListener | None,
        watchdog: Watchdog,
        *,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.domain = domain
        self.on_phase = on_phase or (lambda _phase: None)
        self.console = LineTail(console)
        self.data_tail = LineTail(data)
        self.data = DataPort()
        self.listener = listener
        self.watchdog = watchdog
        self.poll_s = poll_s
        self.clock = clock
        self.wall = wall
        self.sleep = sleep
        self.phase = "boot"
        self.started = clock()
        self.last_activity = self.started
        self.phases = [PhaseTiming("boot", wall())]
        self.phase_started = self.started
        self.events = 0
        self.last_event = ""
        self.fail_events: list[str] = []
        self.failing_since: float | None = None
        self.error_line = ""

    # -- phases and progress ----------------------------------------------------------------

    def _limit(self, phase: str) -> int:
        return self.watchdog.limit(phase)

    def _enter(self, phase: str) -> None:
        if self.PHASES.index(phase) <= self.PHASES.index(self.phase):
            return
        now = self.clock()
        self.phases[-1].duration_s = round(now - self.phase_started, 1)
        log.info("phase %s done after %.0f s; now %s", self.phase, now - self.phase_started, phase)
        self.phase, self.phase_started = phase, now
        self.phases.append(PhaseTiming(phase, self.wall()))
        self.on_phase(phase)

    def _event(self, event: InstallerEvent) -> None:
        self.events += 1
        self.last_event = f"{event.event_type} {event.name}"
        self._enter("install")
        if event.name.startswith("subiquity/Late") and event.event_type == "start":
            self._enter("late")
        if event.event_type == "start" and event.level == "INFO":
            log.info("installer: %s (%s)", event.description, event.name)
        if event.event_type == "finish" and event.result == "FAIL":
            self.fail_events.append(f"{event.name}: {event.description}")
            if event.name.startswith("subiquity/Error"):
                return
            log.error("installer step failed: %s (%s)", event.description, event.name)
            if self.failing_since is None:
                self.failing_since = self.clock()
        elif event.event_type == "finish" and event.result == "WARN":
            log.warning("installer step warned: %s (%s)", event.description, event.name)

    def _console_line(self, line: str) -> None:
        if self.listener is None or self.listener.received == 0:
            match = PRINTED_EVENT.fullmatch(line.strip())
            if match:
                kind, name, result, description = match.groups()
                self._event(InstallerEvent(kind, name, description, result or "", "INFO", "console"))
        if line.startswith("nodetrust-stage: "):
            log.info("%s", line)
        if CONFIRMATION in line:
            self._fail(
                "the installer is waiting for a confirmation ('Continue with autoinstall? (yes|no)')",
                hint="`autoinstall` is missing from the kernel command line: check installer.kernel_args and the "
                "builder's cmdline in the domain XML",
            )
        if INTERACTIVE.search(line):
            self._fail(
                "the installer fell back to its interactive UI (the language screen)",
                hint="the installer found no autoinstall configuration: the CIDATA seed is missing, or its "
                "user-data lacks '#cloud-config' or the top-level 'autoinstall:' key",
            )
        panic = PANIC.search(line)
        if panic:
            self._fail(
                f"the guest kernel panicked: {panic.group(0)}", hint="see the console log around the panic"
            )
        error = INSTALLER_ERROR.search(line)
        if error:
            self.error_line = error.group(0)
            if self.failing_since is None:
                self.failing_since = self.clock()

    def _fail(self, message: str, *, hint: str = "") -> None:
        raise InstallerError(
            f"{message} (phase {self.phase}, {self.clock() - self.started:.0f} s into {self.WHAT})\n"
            f"--- last console lines ---\n{self.console.tail()}",
            hint=hint or f"the whole console is in {self.console.path}",
        )

    def _installer_failed(self) -> None:
        dump = self.data.error_dump or []
        logs = "\n".join(dump[-60:]) if dump else "(error-commands dumped no logs)"
        failed = "; ".join(self.fail_events[:3]) or self.error_line or "see the console"
        raise InstallerError(
            f"the installer failed: {failed}\n"
            + (f"{self.error_line}\n" if self.error_line else "")
            + f"--- installer logs (error-commands) ---\n{logs}",
            hint=f"the installer waits in its error state; the whole console is in {self.console.path}",
        )

    # -- the loop ---------------------------------------------------------------------------------

    def _drain(self) -> bool:
        active = False
        for line in self.console.read():
            active = True
            self._console_line(line)
        for line in self.data_tail.read():
            active = True
            self.data.feed(line)
            if self.data.stage_begun:
                self._enter(self.STAGE_PHASE)
            if self.data.stage_done:
                self._enter("shutdown")
        if self.listener is not None:
            while True:
                try:
                    event = self.listener.events.get_nowait()
                except queue.Empty:
                    break
                active = True
                self._event(event)
        return active

    def _idle_fail(self, what: str, limit: int, hint: str) -> None:
        """The idle watchdog's error: what stalled, the limit, and the last console line."""
        last = next((line.strip() for line in reversed(self.console.recent) if line.strip()), "")
        self._fail(f"{what} (idle limit {limit} s); last console line: {last!r}", hint=hint)

    def _idle_error(self, idle: float) -> None:
        limit = self._limit(self.phase)
        if self.phase == "boot":
            if self.console.total_bytes == 0:
                what = f"the VM printed nothing on its console for {idle:.0f} s: firmware or kernel hang"
            else:
                what = f"the installer's boot showed no progress for {idle:.0f} s"
            hint = (
                "under KVM a nested hypervisor can hang a guest: try --accel tcg; under TCG raise "
                "watchdog.boot if the host is slow"
            )
        elif self.phase == "install":
            what = f"the installer showed no progress for {idle:.0f} s (last event: {self.last_event or 'none'})"
            hint = "raise watchdog.install if the step is legitimately slow here; else the console shows where it stopped"
        elif self.phase == "late":
            what = f"the late-command (stage.sh, the base plan) showed no progress for {idle:.0f} s"
            hint = "the console shows the last nodetrust-stage line; raise watchdog.late for large packages under TCG"
        else:
            what = f"the install finished but the VM did not power off within {idle:.0f} s"
            hint = "the installer should power off (shutdown: poweroff); see the console's last lines"
        self._idle_fail(what, limit, hint)

    def run(self) -> WatchResult:
        self.on_phase(self.phase)  # the VM is running: its first phase begins
        while True:
            if self._drain():
                self.last_activity = self.clock()
            now = self.clock()
            if self.data.stage_failed is not None:
                self._drain()
                self._fail(
                    f"the staging plan failed (stage.sh exited with status {self.data.stage_failed})",
                    hint="the console shows the last nodetrust-stage line and the failing command's output",
                )
            if self.failing_since is not None and (
                self.data.error_dump is not None or now - self.failing_since > ERROR_DUMP_WAIT_S
            ):
                self._installer_failed()
            state = self.domain.state()
            if not state.running:
                self._drain()
                return self._finished(state)
            if now - self.started > self.watchdog.total:
                self._fail(f"the build VM ran longer than watchdog.total ({self.watchdog.total} s)")
            idle = now - self.last_activity
            if self.failing_since is None and idle > self._limit(self.phase):
                self._idle_error(idle)
            self.sleep(self.poll_s)

    def _finished(self, state: DomainState) -> WatchResult:
        if state.state == "crashed":
            self._fail("the guest crashed (kernel panic reported through pvpanic)")
        if state.state != "shutoff" or state.reason != "shutdown":
            raise VmError(
                f"the build VM stopped unexpectedly ({state.state}, {state.reason})\n"
                f"--- last console lines ---\n{self.console.tail()}",
                hint="QEMU died or someone destroyed the domain; see /var/log/libvirt/qemu/",
            )
        if self.failing_since is not None:
            self._installer_failed()
        if not self.data.stage_done or self.data.packages is None:
            self._fail(
                "the VM powered off before the late-command (stage.sh, the base plan) reported completion",
                hint="late-commands did not run to the end: see the console log",
            )
        now = self.clock()
        self.phases[-1].duration_s = round(now - self.phase_started, 1)
        return WatchResult(
            packages=self.data.packages or [],
            installed_size=self.data.installed_size,
            phases=self.phases,
            events=self.events,
            fail_events=self.fail_events,
            boot=self.data.boot,
        )


class ProvisionWatcher(Watcher):
    """The provisioning boot of the installed base: ``boot`` (kernel and initrd until the staging
    plan starts), ``stage`` (stage.sh; idle limit ``watchdog.late``), ``shutdown`` (the hook powers off).

    No installer runs here: only the console's progress, a kernel panic, the data port's markers
    and ``NODETRUST-STAGE-FAILED`` matter.
    """

    PHASES = ("boot", "stage", "shutdown")
    STAGE_PHASE = "stage"
    WHAT = "the provisioning boot"

    def _limit(self, phase: str) -> int:
        return self.watchdog.limit("late" if phase == "stage" else phase)

    def _console_line(self, line: str) -> None:
        if line.startswith(("nodetrust-stage: ", "nodetrust-provision: ")):
            log.info("%s", line)
        panic = PANIC.search(line)
        if panic:
            self._fail(
                f"the base's kernel panicked: {panic.group(0)}",
                hint="see the console log around the panic (a wrong root= or a missing disk driver in the "
                "base's initrd stops the boot before the staging plan)",
            )

    def _idle_error(self, idle: float) -> None:
        limit = self._limit(self.phase)
        if self.phase == "boot":
            what = f"the base's kernel showed no progress for {idle:.0f} s before the staging plan started"
            hint = "see the console: the initrd may not find the root file system (root=UUID=...)"
        elif self.phase == "stage":
            what = f"the staging plan showed no progress for {idle:.0f} s"
            hint = "the console shows the last nodetrust-stage line; raise watchdog.late for large artifacts under TCG"
        else:
            what = f"the staging plan finished but the VM did not power off within {idle:.0f} s"
            hint = "provision-init powers off through /proc/sysrq-trigger; see the console's last lines"
        self._idle_fail(what, limit, hint)

    def _finished(self, state: DomainState) -> WatchResult:
        if state.state == "crashed":
            self._fail("the guest crashed (kernel panic reported through pvpanic)")
        if state.state != "shutoff" or state.reason != "shutdown":
            raise VmError(
                f"the provisioning VM stopped unexpectedly ({state.state}, {state.reason})\n"
                f"--- last console lines ---\n{self.console.tail()}",
                hint="QEMU died or someone destroyed the domain; see /var/log/libvirt/qemu/",
            )
        if self.data.stage_failed is not None or not self.data.stage_done or self.data.packages is None:
            self._fail(
                "the provisioning VM powered off before the staging plan reported completion",
                hint="see the console log",
            )
        self.phases[-1].duration_s = round(self.clock() - self.phase_started, 1)
        return WatchResult(
            packages=self.data.packages or [],
            installed_size=self.data.installed_size,
            phases=self.phases,
            events=0,
        )
