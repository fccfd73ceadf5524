"""KVM when it works, TCG otherwise.

``/dev/kvm`` can exist and still hang a guest kernel (nested KVM). So ``auto`` does not
trust the device node: it boots the installer's own kernel under ``-accel kvm`` with no
root file system, and KVM counts as working only if the kernel prints its banner and
reaches its (expected) panic on the serial port within a few seconds. The verdict is
cached per host boot (``/proc/sys/kernel/random/boot_id``) in the cache directory, so
the probe runs once per boot, not once per build.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from imagebuilder.errors import CommandError, ToolMissingError, VmError
from imagebuilder.run import run

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0
QEMU_BINARY = {"amd64": "qemu-system-x86_64", "arm64": "qemu-system-aarch64"}
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def host_arch() -> str:
    return HOST_ARCH.get(os.uname().machine, os.uname().machine)


def kvm_usable_device() -> str:
    """Empty when /dev/kvm can be opened read-write, else why not."""
    if not Path("/dev/kvm").exists():
        return "/dev/kvm does not exist"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is not readable and writable for this user"
    return ""


def probe_kvm(kernel: Path, arch: str, *, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot ``kernel`` under KVM without a root file system; works if it reaches its panic in time."""
    reason = kvm_usable_device()
    if reason:
        return False, reason
    if arch != host_arch():
        return False, f"the host is {host_arch()}, the target {arch}: KVM cannot run it"
    with tempfile.TemporaryDirectory(prefix="imagebuilder-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [
            QEMU_BINARY[arch],
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "256",
            "-smp",
            "1",
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-vga",
            "none",
            "-monitor",
            "none",
            "-serial",
            f"file:{console}",
            "-kernel",
            str(kernel),
            "-append",
            "console=ttyS0 panic=-1 loglevel=7",
        ]
        try:
            result = run(argv, check=False, timeout=timeout)
        except ToolMissingError:
            raise
        except CommandError as exc:
            text = console.read_text(errors="replace") if console.exists() else ""
            where = "printed nothing" if not text.strip() else "stopped printing"
            return False, f"a KVM guest {where} within {timeout:.0f} s ({exc.message.splitlines()[0]})"
        text = console.read_text(errors="replace") if console.exists() else ""
        if "Linux version" in text and ("Kernel panic" in text or "VFS:" in text):
            return True, "a KVM guest booted its kernel to the expected panic"
        tail = (result.stdout + result.stderr).decode(errors="replace").strip().splitlines()[-1:]
        return False, f"the KVM probe exited {result.returncode} without a kernel banner {tail}"


def choose_accel(requested: str, kernel: Path, arch: str, cache_dir: Path) -> tuple[str, str]:
    """``(kvm|tcg, why)`` for ``--accel auto|kvm|tcg``."""
    if requested == "tcg":
        return "tcg", "--accel tcg"
    if requested == "kvm":
        reason = kvm_usable_device()
        if reason:
            raise VmError(f"--accel kvm, but {reason}", hint="use --accel auto or --accel tcg")
        return "kvm", "--accel kvm"
    verdict_file = cache_dir / f"accel-{arch}-{boot_id()}.json"
    try:
        cached = json.loads(verdict_file.read_text())
        log.info("accelerator (cached for this host boot): %s (%s)", cached["accel"], cached["why"])
        return str(cached["accel"]), str(cached["why"])
    except (OSError, ValueError, KeyError):
        pass
    ok, why = probe_kvm(kernel, arch)
    accel = "kvm" if ok else "tcg"
    if not ok:
        log.warning("KVM is not usable (%s): falling back to TCG, which is several times slower", why)
    verdict_file.parent.mkdir(parents=True, exist_ok=True)
    for stale in verdict_file.parent.glob(f"accel-{arch}-*.json"):
        stale.unlink(missing_ok=True)
    verdict_file.write_text(json.dumps({"accel": accel, "why": why}) + "\n")
    return accel, why
