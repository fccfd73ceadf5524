"""What the VM tests drive: QEMU (TCG, OVMF) and a loopback HTTP listener.

:class:`Vm` runs ``qemu-system-x86_64`` directly (no libvirt) with UEFI firmware, its
serial console in a file, ``-no-reboot`` and user-mode networking restricted to one
forwarded service: the guest's ``10.0.2.100:8080`` reaches the test's
:class:`Listener` on the host's loopback and nothing else.

:class:`Listener` records every POSTed JSON body (the installer's webhook events) and
every request path, and serves files put in :attr:`Listener.files` (NoCloud seeds,
apt repositories).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from imagebuilder.domain import TCG_CPU_MODEL

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
GUEST_SERVICE = "10.0.2.100:8080"
RELAY = Path(__file__).resolve().parent / "guestfwd_relay.py"
NIC_PCI_ADDR = "0x5"  # the same slot in every VM, so the NIC keeps its name (enp0s5)


class Listener:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.requests: list[str] = []
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with listener._lock:
                    listener.requests.append(f"POST {self.path}")
                    with contextlib.suppress(ValueError):
                        listener.events.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                path = posixpath.normpath(self.path)  # apt asks for flat repos as .../repo/./Release
                with listener._lock:
                    listener.requests.append(f"GET {path}")
                    data = listener.files.get(path)
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Vm:
    """One QEMU process. Drives: ``(path, kind)`` with kind disk, cdrom or seed."""

    name: str
    workdir: Path
    drives: list[tuple[Path, str]]
    kernel: Path | None = None
    initrd: Path | None = None
    append: str = ""
    listener_port: int | None = None
    memory_mib: int = 2048
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ended: float | None = None
    log: list[str] = field(default_factory=list)

    @property
    def console_path(self) -> Path:
        return self.workdir / f"{self.name}.console.log"

    def argv(self) -> list[str]:
        vars_copy = self.workdir / f"{self.name}.OVMF_VARS.fd"
        shutil.copyfile(OVMF_VARS, vars_copy)
        accel = os.environ.get("NODETRUST_VM_ACCEL", "tcg")
        netdev = "user,id=n0,restrict=on"
        if self.listener_port is not None:
            host, port = GUEST_SERVICE.split(":")
            relay = f"{sys.executable} {RELAY} 127.0.0.1 {self.listener_port}"
            netdev += f",guestfwd=tcp:{host}:{port}-cmd:{relay}"
        argv = [
            "qemu-system-x86_64",
            "-name", self.name,
            "-machine", "q35",
            "-accel", accel,
            "-cpu", TCG_CPU_MODEL["amd64"] if accel == "tcg" else "host",
            "-m", str(self.memory_mib),
            "-smp", os.environ.get("NODETRUST_VM_SMP", "2"),
            "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,file={vars_copy}",
            "-netdev", netdev,
            "-device", f"virtio-net-pci,netdev=n0,addr={NIC_PCI_ADDR}",
            "-serial", f"file:{self.console_path}",
            "-display", "none",
            "-vga", "none",
            "-monitor", "none",
            "-no-reboot",
        ]  # fmt: skip
        if self.kernel is not None and self.initrd is not None:
            argv += ["-kernel", str(self.kernel), "-initrd", str(self.initrd), "-append", self.append]
        cdroms = 0  # one per AHCI port of the q35 chipset (ide.0 ... ide.5)
        for index, (path, kind) in enumerate(self.drives):
            if kind == "disk":
                argv += ["-drive", f"file={path},if=virtio,format=qcow2,cache=unsafe"]
            elif kind == "seed":
                argv += ["-drive", f"file={path},if=virtio,format=raw,readonly=on"]
            elif kind == "cdrom":
                argv += [
                    "-drive", f"file={path},if=none,id=cd{index},media=cdrom,readonly=on",
                    "-device", f"ide-cd,drive=cd{index},bus=ide.{cdroms}",
                ]  # fmt: skip
                cdroms += 1
            else:
                raise ValueError(f"unknown drive kind {kind}")
        return argv

    def start(self) -> Vm:
        self.console_path.unlink(missing_ok=True)
        argv = self.argv()
        (self.workdir / f"{self.name}.argv").write_text(" ".join(argv) + "\n")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=(self.workdir / f"{self.name}.qemu.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started = time.monotonic()
        return self

    def console(self) -> str:
        try:
            return self.console_path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def wait_exit(self, timeout: float) -> int:
        """Wait for QEMU to exit by itself; on timeout fail with the console's tail."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name}: the VM did not power off within {timeout:.0f} s; console tail:\n"
                + tail(self.console())
            ) from None
        self.ended = time.monotonic()
        return code

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if not self.running():
                raise AssertionError(
                    f"{self.name}: the VM exited while waiting for {what}:\n" + tail(self.console())
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: no {what} within {timeout:.0f} s; console tail:\n" + tail(self.console())
                )
            time.sleep(1.0)

    def wait_console(self, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []

        def check() -> bool:
            match = regex.search(self.console())
            if match:
                found.append(match)
            return match is not None

        self.wait_for(f"console match for {pattern!r}", check, timeout)
        return found[0]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self.ended is None:
            self.ended = time.monotonic()


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def one_vm(vm: Vm) -> Iterator[Vm]:
    """Start ``vm`` and make sure it is gone afterwards, whatever happens."""
    vm.start()
    try:
        yield vm
    finally:
        vm.kill()
