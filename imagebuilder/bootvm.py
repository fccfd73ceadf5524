"""Boot a built image in a throw-away VM: the boot test's machine, and ``make demo``'s node.

* the image is never written: QEMU boots a QCOW2 overlay in the work directory whose backing
  file is the image (hard-linked or copied next to it, and declared with ``relabel='no'`` so
  libvirt never changes its owner);
* UEFI (OVMF, AAVMF on arm64) with a fresh NVRAM copy, through the image's own boot loader;
* a TPM 2.0: an ``swtpm`` process of ours on a UNIX socket that only QEMU's user may open
  (libvirt's ``external`` TPM backend), on a fresh state folder or on one the caller made
  (the demo manufactures one with an EK certificate its server trusts);
* a NoCloud seed (label ``CIDATA``) as a read-only virtio disk;
* user-mode networking with ``restrict=on`` (DHCP, no route anywhere), never a bridge; with
  ``listener_port`` the guest's ``10.0.2.100:8080`` is one byte stream to that loopback port of
  the host (a QEMU character device, as for the installer's event listener). QEMU's per-connection
  ``guestfwd=...-cmd:`` relays are not offered: libvirt's seccomp sandbox kills QEMU when it spawns one;
* the serial console and a second serial port (the data port) in files, followed by
  :meth:`BootVm.follow` until the guest powers itself off.

Everything (domain, NVRAM, swtpm, overlay) is removed on the way out, on success, failure,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.base import link_into
from imagebuilder.domain import DomainSpec, domain_xml, find_firmware
from imagebuilder.errors import VmError
from imagebuilder.run import run, spawn, stop, which
from imagebuilder.vm import DOMAIN_PREFIX, Connection, Domain, DomainState, owner_metadata, remove_orphans
from imagebuilder.watch import LineTail

log = logging.getLogger(__name__)

SOCKET_WAIT_S = 10.0
SOCKET_PATH_MAX = 100  # sun_path is 108 bytes


@dataclass(frozen=True)
class BootSpec:
    image: Path  # the QCOW2 to boot; never written
    seed: Path | None  # a NoCloud seed (label CIDATA)
    accel: str  # kvm | tcg
    arch: str = "amd64"
    firmware: str = "uefi"
    memory_mib: int = 2048
    cpus: int = 2
    tpm_state: Path | None = None  # an swtpm state folder; None: a fresh TPM
    network: bool = True
    # A loopback port of the host: the guest's 10.0.2.100:8080 (domain.GUEST_FORWARD) is one byte stream
    # to it, through a QEMU character device (works under libvirt's seccomp sandbox).
    listener_port: int | None = None


def qemu_owner(conn: Connection) -> tuple[int, int]:
    """The uid and gid libvirt runs QEMU as (its DAC base label, e.g. ``+64055:+64055``)."""
    caps = ET.fromstring(conn.conn.getCapabilities())  # noqa: S314 - the local daemon's own XML
    for model in caps.iter("secmodel"):
        if model.findtext("model") != "dac":
            continue
        for label in model.iter("baselabel"):
            user, _, group = (label.text or "").partition(":")
            if user.lstrip("+").isdigit() and group.lstrip("+").isdigit():
                return int(user.lstrip("+")), int(group.lstrip("+"))
    return 0, 0  # no DAC driver: QEMU runs as root


class Swtpm:
    """``swtpm socket`` for one VM: the control channel on a UNIX socket owned by QEMU's user."""

    def __init__(self, state: Path, socket_path: Path, log_file: Path, owner: tuple[int, int]) -> None:
        which("swtpm")
        state.mkdir(parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)
        uid, gid = owner
        self.socket = socket_path
        self.proc: subprocess.Popen[bytes] | None = spawn(
            [
                "swtpm",
                "socket",
                "--tpm2",
                "--tpmstate",
                f"dir={state}",
                "--ctrl",
                f"type=unixio,path={socket_path},mode=0600,uid={uid},gid={gid}",
                "--log",
                f"file={log_file},level=1",
            ],
            stdout=log_file,
        )
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                self.close()
                raise VmError(
                    f"swtpm did not open {socket_path}\n{tail}",
                    hint="see swtpm's log above; is swtpm installed (apt-get install swtpm)?",
                )
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


class BootVm:
    """A booted image; use as a context manager, then :meth:`follow` it until it powers off."""

    def __init__(
        self, spec: BootSpec, work: Path, *, label: str, libvirt_uri: str = "qemu:///system"
    ) -> None:
        self.spec = spec
        self.work = work
        self.label = label
        self.libvirt_uri = libvirt_uri
        self.console = work / "console.log"
        self.data = work / "data.log"
        self.domain: Domain | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> BootVm:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        spec, work = self.spec, self.work
        work.mkdir(parents=True, exist_ok=True)
        work.chmod(0o755)  # QEMU (another user) reads the overlay, seed and firmware copy here
        backing = link_into(spec.image, work / "image.qcow2")
        overlay = work / "overlay.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(overlay)])
        seed: tuple[Path, ...] = ()
        if spec.seed is not None:
            seed = (link_into(spec.seed, work / "seed.iso"),)
        loader = nvram_template = nvram = None
        if spec.firmware == "uefi":
            loader, nvram_template = find_firmware(spec.arch)
            nvram = work / "nvram.fd"
        conn = Connection(self.libvirt_uri)
        self._stack.callback(conn.close)
        remove_orphans(conn)
        tpm = Swtpm(
            spec.tpm_state or work / "tpm", self._socket_path(work), work / "swtpm.log", qemu_owner(conn)
        )
        self._stack.callback(tpm.close)
        build_id = f"{self.label}-{secrets.token_hex(3)}"
        domain_spec = DomainSpec(
            name=DOMAIN_PREFIX + build_id,
            build_id=build_id,
            arch=spec.arch,
            accel=spec.accel,
            memory_mib=spec.memory_mib,
            cpus=spec.cpus,
            kernel=None,
            initrd=None,
            cmdline="",
            disk=overlay,
            cdrom=None,
            readonly_disks=seed,
            console_log=self.console,
            data_log=self.data,
            firmware=spec.firmware,
            loader=loader,
            nvram_template=nvram_template,
            nvram=nvram,
            extra=owner_metadata(),
            backing=backing,
            tpm_socket=tpm.socket,
            network=spec.network,
            listener_port=spec.listener_port,
        )
        self.domain = self._stack.enter_context(conn.domain(domain_xml(domain_spec)))

    def _socket_path(self, work: Path) -> Path:
        """``work/swtpm.sock``, or one in a private folder under /tmp when that path is too long for a UNIX
        socket (108 bytes with its terminating NUL; deep CI work directories exceed it)."""
        path = work / "swtpm.sock"
        if len(str(path).encode()) <= SOCKET_PATH_MAX:
            return path
        folder = Path(tempfile.mkdtemp(prefix="imagebuilder-swtpm-", dir="/tmp"))  # a private mkdtemp
        folder.chmod(0o711)  # QEMU (another user) opens the socket by its path; nobody may list the folder
        self._stack.callback(shutil.rmtree, folder, True)
        return folder / "swtpm.sock"

    def follow(
        self,
        *,
        on_console: Callable[[str], None] | None = None,
        on_data: Callable[[str], bool] | None = None,
        idle_s: float,
        total_s: float,
        what: str,
        poll_s: float = 0.5,
    ) -> DomainState:
        """Read the console and the data port until the guest stops; ``on_data`` returning True stops
        following early (the caller has what it wanted). Raises :class:`VmError` after ``idle_s``
        without any output or ``total_s`` in all, with the last console lines."""
        if self.domain is None:
            raise VmError("the VM is not running")
        console, data = LineTail(self.console), LineTail(self.data)
        started = last = time.monotonic()
        while True:
            active = False
            for line in console.read():
                active = True
                if on_console is not None:
                    on_console(line)
            for line in data.read():
                active = True
                if on_data is not None and on_data(line):
                    return self.domain.state()
            now = time.monotonic()
            if active:
                last = now
            state = self.domain.state()
            if not state.running:
                for line in data.read():
                    if on_data is not None:
                        on_data(line)
                return state
            if now - started > total_s or now - last > idle_s:
                why = (
                    f"ran longer than {total_s:.0f} s"
                    if now - started > total_s
                    else f"showed no progress for {now - last:.0f} s"
                )
                raise VmError(
                    f"{what}: the VM {why}\n--- last console lines ---\n{console.tail()}",
                    hint=f"the whole console is in {self.console}",
                )
            time.sleep(poll_s)

    def wait_stopped(self, timeout_s: float) -> DomainState:
        """Give the guest ``timeout_s`` to power itself off, then pull the plug."""
        if self.domain is None:
            raise VmError("the VM is not running")
        deadline = time.monotonic() + timeout_s
        state = self.domain.state()
        while state.running and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.domain.state()
        if state.running:
            log.warning("%s did not power off within %.0f s; stopping it", self.domain.name, timeout_s)
            self.domain.destroy()
            state = self.domain.state()
        return state


@contextlib.contextmanager
def boot(spec: BootSpec, work: Path, *, label: str, libvirt_uri: str = "qemu:///system") -> Iterator[BootVm]:
    with BootVm(spec, work, label=label, libvirt_uri=libvirt_uri) as vm:
        yield vm
