"""A rack on one machine: racked servers as plain QEMU VMs whose network is a namespace of the suite's own.

Public API::

    GATEWAY = "10.0.2.2"                     # where a server reaches the rack's services
    PORTS: dict[str, int]                    # the services' ports (release HTTP 80, NTP 123/udp, ...)
    class Server:                            # one racked server: UEFI with its own NVRAM, a TPM, disks
        def __init__(self, work, *, tpm_state, disks, memory_mib=3072, cpus=2, accel="tcg")
        def power_on(self, ns, *, netboot=None, name="boot") -> Boot   # a Boot is a context manager too
    class Boot:
        console: Path; proc
        def lines() -> list[str]             # the console so far, without carriage returns and escapes
        def wait_for(pattern, *, timeout, fail_on=BOOT_FAILURE) -> re.Match[str]
        def wait_exit(timeout) -> int        # the server powered itself off (or rebooted: -no-reboot)
        def power_off(timeout=120) -> None   # ACPI power button (QMP), then kill if it does not stop

The servers' NICs use QEMU's user-mode networking **inside the namespace** (``nsenter --net``): the
guest's DHCP answer makes ``10.0.2.2`` its gateway, and everything it sends to ``10.0.2.2`` (TCP and UDP)
reaches the namespace's loopback, where the management side's services listen: the control plane (it
owns the namespace, tests/support/control_plane.py), nodeserver, the site NTP server, the release
server, spire-server. There is nothing else in the namespace (``lo`` only), so a server has no route
out of it; no bridge, no tap, no address of the host's networks is ever a target. Nothing is
configured inside the guest for this: a server is configured only by its release, as in a rack.

The TPM is swtpm on a state the caller manufactured (tests/support/swtpm.py), one process per boot, as a
power cycle resets a TPM; the firmware is Debian's OVMF with the server's own NVRAM file (boot entries
survive reboots, as on a real machine), and the NIC's option ROM is Debian's iPXE (ipxe-qemu).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from imagebuilder.domain import TCG_CPU_MODEL
from tests.support.netns import NetNamespace
from tests.support.peers import PeerError, log_tail, spawn, stop

GATEWAY = "10.0.2.2"
PORTS = {"http": 80, "ntp": 123, "api": 6443, "attest": 8081, "join": 8082, "spire": 8090}
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
IPXE_ROM = Path("/usr/lib/ipxe/qemu/efi-virtio.rom")
# The boot loader or the kernel gave up: no point waiting for a timeout.
BOOT_FAILURE = re.compile(
    r"grub rescue>|Kernel panic - not syncing|^error: invalid arch-independent ELF magic", re.M
)
_ESC = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-B]|\r")


def require() -> None:
    """What a server needs on this host, or a failure that names the packages."""
    missing = [pkg for tool, pkg in (("qemu-system-x86_64", "qemu-system-x86"), ("swtpm", "swtpm"),
                                     ("nsenter", "util-linux")) if shutil.which(tool) is None]  # fmt: skip
    missing += [pkg for path, pkg in ((OVMF_CODE, "ovmf"), (IPXE_ROM, "ipxe-qemu")) if not path.is_file()]
    if missing:
        raise PeerError(f"a racked server needs: apt-get install {' '.join(sorted(set(missing)))}")
    if os.geteuid() != 0:
        raise PeerError("a racked server runs in a network namespace: run as root")


@dataclass(frozen=True)
class Disk:
    path: Path
    serial: str
    format: str = "raw"  # raw | qcow2


@dataclass
class Server:
    """One racked server. ``disks``: in slot order; ``tpm_state``: an swtpm state (tests/support/swtpm.py)."""

    work: Path
    tpm_state: Path
    disks: list[Disk]
    memory_mib: int = 3072
    cpus: int = 2
    accel: str = "tcg"  # kvm where usable (what the image's build found: its manifest's accelerator)
    nvram: Path = field(init=False)

    def __post_init__(self) -> None:
        require()
        self.work.mkdir(parents=True, exist_ok=True)
        self.nvram = self.work / "OVMF_VARS.fd"
        if not self.nvram.exists():
            shutil.copyfile(OVMF_VARS, self.nvram)  # the server's own NVRAM: its boot entries persist

    def power_on(self, ns: NetNamespace, *, netboot: str | None = None, name: str = "boot") -> Boot:
        """Start the server (in ``ns``); ``netboot``: a URL iPXE boots from (the NIC first, as a rack's
        provisioning network does), else the firmware follows its NVRAM's BootOrder (or finds the disk)."""
        return Boot(self, ns, netboot, name).start()


class Boot:
    """One power-on of a :class:`Server`, until it powers off (or reboots: QEMU runs with -no-reboot)."""

    def __init__(self, server: Server, ns: NetNamespace, netboot: str | None, name: str) -> None:
        self.server, self.ns, self.netboot, self.name = server, ns, netboot, name
        self.console = server.work / f"{name}.console.log"
        self.log = server.work / f"{name}.qemu.log"
        self._private = Path(tempfile.mkdtemp(prefix="nt-rack-"))  # short socket paths (sun_path: 108 bytes)
        self.proc: subprocess.Popen[bytes] | None = None
        self._swtpm: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    @property
    def _tpm_sock(self) -> Path:
        return self._private / "tpm.sock"

    @property
    def _qmp(self) -> Path:
        return self._private / "qmp.sock"

    def argv(self) -> list[str]:
        s = self.server
        cpu = TCG_CPU_MODEL["amd64"] if s.accel == "tcg" else "host"
        argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", s.accel, "-cpu", cpu,
                "-smp", str(s.cpus), "-m", str(s.memory_mib), "-display", "none", "-no-reboot",
                "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
                "-drive", f"if=pflash,format=raw,file={s.nvram}",
                "-chardev", f"socket,id=chrtpm,path={self._tpm_sock}",
                "-tpmdev", "emulator,id=tpm0,chardev=chrtpm", "-device", "tpm-crb,tpmdev=tpm0",
                "-object", "rng-random,id=rng0,filename=/dev/urandom", "-device", "virtio-rng-pci,rng=rng0",
                "-serial", f"file:{self.console}", "-qmp", f"unix:{self._qmp},server=on,wait=off"]  # fmt: skip
        for i, disk in enumerate(s.disks):
            argv += ["-drive", f"if=none,id=d{i},format={disk.format},file={disk.path},cache=unsafe,discard=unmap",
                     "-device", f"virtio-blk-pci,drive=d{i},serial={disk.serial}"]  # fmt: skip
        netdev = "user,id=n0"
        nic = f"virtio-net-pci,netdev=n0,romfile={IPXE_ROM}"
        if self.netboot is not None:
            netdev += f",bootfile={self.netboot}"
            nic += ",bootindex=1"  # the provisioning network first; the firmware falls back to its entries
        return [*argv, "-netdev", netdev, "-device", nic]

    def start(self) -> Boot:
        s = self.server
        self._swtpm = spawn(["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={s.tpm_state}",
                             "--ctrl", f"type=unixio,path={self._tpm_sock}",
                             "--log", f"file={s.work / f'{self.name}.swtpm.log'},level=1"],
                            log_path=s.work / f"{self.name}.swtpm.out")  # fmt: skip
        deadline = time.monotonic() + 10
        while not self._tpm_sock.exists():
            if self._swtpm.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise PeerError(f"swtpm did not start: {log_tail(s.work / f'{self.name}.swtpm.log')}")
            time.sleep(0.05)
        self.console.write_bytes(b"")
        self.proc = spawn(self.argv(), log_path=self.log, netns=self.ns.name)
        self.started = time.monotonic()
        return self

    # -- watching ----------------------------------------------------------------------------------
    def text(self) -> str:
        try:
            return _ESC.sub("", self.console.read_bytes().decode("utf-8", "replace"))
        except OSError:
            return ""

    def lines(self) -> list[str]:
        return self.text().splitlines()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_for(
        self,
        pattern: str | re.Pattern[str],
        *,
        timeout: float,
        fail_on: re.Pattern[str] | None = BOOT_FAILURE,
    ) -> re.Match[str]:
        """Until the console shows ``pattern``; a failure names what the console shows instead."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            found = regex.search(text)
            if found:
                return found
            bad = fail_on.search(text) if fail_on is not None else None
            if bad is not None:
                raise PeerError(f"{self.name}: the console shows {bad.group(0)!r}:\n{text[-3000:]}")
            if not self.running():
                raise PeerError(
                    f"{self.name}: QEMU stopped ({self._exit()}) before {regex.pattern!r}:\n{text[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name}: no {regex.pattern!r} within {timeout:.0f} s:\n{text[-3000:]}")
            time.sleep(1)

    def wait_exit(self, timeout: float) -> int:
        """Until the server powers off or reboots (-no-reboot ends QEMU either way)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(
                f"{self.name}: still running after {timeout:.0f} s:\n{self.text()[-3000:]}"
            ) from None
        self.close()
        return rc

    def _exit(self) -> str:
        rc = self.proc.poll() if self.proc is not None else None
        return f"exit status {rc}; {log_tail(self.log, 600)}"

    def power_off(self, timeout: float = 120) -> None:
        """Press the power button (ACPI, through QMP); kill QEMU if the guest does not power off in time."""
        if self.running():
            try:
                self._qmp_command("system_powerdown")
                assert self.proc is not None
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.close()

    def _qmp_command(self, command: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(self._qmp))
            reader = sock.makefile("rb")
            reader.readline()  # the greeting
            for message in ({"execute": "qmp_capabilities"}, {"execute": command}):
                sock.sendall(json.dumps(message).encode() + b"\n")
                while True:
                    reply = json.loads(reader.readline() or b"{}")
                    if "return" in reply or "error" in reply or not reply:
                        break

    def close(self) -> None:
        """Stop QEMU (if it still runs) and the TPM; remove the private sockets."""
        if self.proc is not None:
            stop(self.proc, grace=10)
        if self._swtpm is not None:
            stop(self._swtpm, grace=10)
        shutil.rmtree(self._private, ignore_errors=True)

    def __enter__(self) -> Boot:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
