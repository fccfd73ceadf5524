"""The imager's one subprocess chokepoint.

Every tool the imager runs (qemu-img, sfdisk, wipefs, blkid, efibootmgr, udevadm, mkfs.vfat,
mcopy) goes through :func:`run`: argv only, never a shell; a C locale; stdin from /dev/null unless
input is given; a time limit; a debug log line with the exact command; and a
:class:`~imager.errors.CommandError` carrying the reason the caller names, the command and the
tail of its output. A tool that is not installed is reported with the Debian package that has it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from imager.errors import CommandError, Reason

log = logging.getLogger(__name__)

TOOL_PACKAGES = {
    "qemu-img": "qemu-utils",
    "sfdisk": "fdisk",
    "wipefs": "util-linux",
    "blkid": "util-linux",
    "efibootmgr": "efibootmgr",
    "udevadm": "udev",
    "mkfs.vfat": "dosfstools",
    "mcopy": "mtools",
    "mdir": "mtools",
    "reboot": "systemd-sysv or busybox",
}
BASE_ENV = {
    "LC_ALL": "C.UTF-8",
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}
_TAIL_LINES = 20
POLL_S = 1.0


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")


def which(tool: str) -> str:
    """Absolute path of ``tool`` (PATH and the sbin folders), or CommandError naming its package."""
    search = os.pathsep.join([os.environ.get("PATH", ""), BASE_ENV["PATH"]])
    found = shutil.which(tool, path=search)
    if found is None:
        raise CommandError(
            Reason.tool_missing,
            f"{tool} is not installed in this boot environment",
            argv=[tool],
            returncode=None,
            hint=f"the imager needs {tool} (Debian package {TOOL_PACKAGES.get(tool, tool)}); rebuild the boot environment",
        )
    return found


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    merged = {k: v for k, v in os.environ.items() if not k.startswith("LC_")}
    merged.update(BASE_ENV)
    merged["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), BASE_ENV["PATH"]])
    if env:
        merged.update(env)
    return merged


def _tail(data: bytes) -> str:
    return "\n".join(data.decode("utf-8", errors="replace").rstrip().splitlines()[-_TAIL_LINES:])


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    reason: Reason,
    check: bool = True,
    input_bytes: bytes | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    hint: str = "",
    poll: Callable[[int], None] | None = None,
) -> Completed:
    """Run ``argv`` to completion; CommandError with ``reason`` when it cannot start, times out or
    (with ``check``) exits non-zero. ``poll(pid)`` is called about once a second while it runs
    (progress from ``/proc/<pid>/io``)."""
    args = [os.fspath(a) for a in argv]
    if not args:
        raise ValueError("empty command")
    if "/" not in args[0]:
        args[0] = which(args[0])
    log.debug("+ %s", shlex.join(args))
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if input_bytes is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_environment(env),
            start_new_session=True,
        )
    except OSError as exc:
        raise CommandError(
            reason, f"cannot start {shlex.join(args)}: {exc.strerror}", argv=args, returncode=None
        ) from exc
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(
                    input_bytes,
                    timeout=min(POLL_S, max(0.0, deadline - time.monotonic())) if poll else timeout,
                )
                break
            except subprocess.TimeoutExpired:
                if poll is None or time.monotonic() >= deadline:
                    raise
                input_bytes = None  # communicate() sent it on the first call
                poll(proc.pid)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CommandError(
            reason,
            f"{shlex.join(args)} did not finish within {timeout:.0f} s",
            argv=args,
            returncode=None,
            hint=hint,
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    result = Completed(args, proc.returncode, stdout or b"", stderr or b"")
    if check and result.returncode != 0:
        output = _tail(result.stderr or result.stdout)
        raise CommandError(
            reason,
            f"{shlex.join(args)} exited with status {result.returncode}" + (f": {output}" if output else ""),
            argv=args,
            returncode=result.returncode,
            hint=hint,
        )
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
