"""The image builder's one subprocess chokepoint.

Every external program the builder runs (xorriso, qemu-img, qemu-system, dpkg-deb,
gpgv, pip) goes through :func:`run` or :func:`spawn`: argv only (never a shell on the
host), a pinned C locale, stdin from /dev/null unless input is given, a debug log
line with the exact command, and a :class:`~imagebuilder.errors.CommandError` that
names the command and the tail of its output when it fails. Missing tools are
reported with the Debian package that provides them.

Children run in their own session, so an interrupt or a timeout kills the whole
process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.errors import CommandError, ToolMissingError

log = logging.getLogger(__name__)

# Which Debian/Ubuntu package provides a tool the builder needs; named in errors.
TOOL_PACKAGES: dict[str, str] = {
    "xorriso": "xorriso",
    "qemu-img": "qemu-utils",
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-system-aarch64": "qemu-system-arm",
    "dpkg-deb": "dpkg",
    "gpgv": "gpgv",
    "gpg": "gnupg",
    "virsh": "libvirt-clients",
    "tar": "tar",
    "swtpm": "swtpm",
    "git": "git",
    "mcopy": "mtools",
    "mdir": "mtools",
    "mkfs.fat": "dosfstools",
    "debugfs": "e2fsprogs",
    "mke2fs": "e2fsprogs",
    "e2fsck": "e2fsprogs",
    "dumpe2fs": "e2fsprogs",
    "mmd": "mtools",
    "sfdisk": "fdisk",
    "sgdisk": "gdisk",
    "osslsigncode": "osslsigncode",
    "cpio": "cpio",
    "zstd": "zstd",
}

BASE_ENV = {"LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
_TAIL_LINES = 30


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
    """Absolute path of ``tool`` (PATH plus the sbin directories), or :class:`ToolMissingError`."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    found = shutil.which(tool, path=search)
    if found is None:
        package = TOOL_PACKAGES.get(tool, tool)
        raise ToolMissingError(
            f"{tool} is not installed",
            hint=f"install it: apt-get install {package} (scripts/ensure-deps.sh)",
        )
    return found


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    merged = {k: v for k, v in os.environ.items() if not k.startswith("LC_")}
    merged.update(BASE_ENV)
    if env:
        merged.update(env)
    return merged


def _tail(data: bytes) -> str:
    lines = data.decode("utf-8", errors="replace").rstrip().splitlines()
    return "\n".join(lines[-_TAIL_LINES:])


def _resolve(argv: Sequence[str | os.PathLike[str]]) -> list[str]:
    args = [os.fspath(a) for a in argv]
    if not args:
        raise ValueError("empty command")
    if "/" not in args[0]:
        args[0] = which(args[0])
    return args


def _execute(
    args: list[str],
    *,
    stdin: bytes | None,
    env: dict[str, str],
    cwd: Path | None,
    timeout: float | None,
    log_file: Path | None,
) -> Completed:
    """Run one command to completion; the one place that starts a process and waits for it."""
    out_handle = log_file.open("ab") if log_file is not None else None
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=out_handle if out_handle is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT if out_handle is not None else subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        if out_handle is not None:
            out_handle.close()
        raise CommandError(f"cannot start {shlex.join(args)}: {exc}", argv=args, returncode=None) from exc
    try:
        stdout, stderr = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CommandError(
            f"{shlex.join(args)} did not finish within {timeout:.0f} s", argv=args, returncode=None
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if out_handle is not None:
            out_handle.close()
    return Completed(args, proc.returncode, stdout or b"", stderr or b"")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    input_bytes: bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    log_file: Path | None = None,
    hint: str = "",
) -> Completed:
    """Run ``argv`` and return its output; raise :class:`CommandError` on a non-zero exit if ``check``."""
    args = _resolve(argv)
    log.debug("+ %s", shlex.join(args))
    result = _execute(
        args, stdin=input_bytes, env=_environment(env), cwd=cwd, timeout=timeout, log_file=log_file
    )
    if check and result.returncode != 0:
        output = _tail(result.stdout + b"\n" + result.stderr)
        if log_file is not None:
            output = _tail(log_file.read_bytes()) if log_file.exists() else ""
        raise CommandError(
            f"{shlex.join(args)} exited with status {result.returncode}"
            + (f":\n{output}" if output else ""),
            argv=args,
            returncode=result.returncode,
            output=output,
            hint=hint or f"run `{shlex.join(args)}` by hand to see the whole output",
        )
    return result


def spawn(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    stdout: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session without waiting; stdout and stderr go to ``stdout`` (a file)."""
    args = _resolve(argv)
    log.debug("+ %s &", shlex.join(args))
    handle = stdout.open("ab") if stdout is not None else None
    try:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=handle if handle is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=_environment(env),
            start_new_session=True,
        )
    except OSError as exc:
        raise CommandError(f"cannot start {shlex.join(args)}: {exc}", argv=args, returncode=None) from exc
    finally:
        if handle is not None:
            handle.close()


def stop(proc: subprocess.Popen[bytes], *, grace: float = 5.0) -> None:
    """Terminate a spawned process group, then kill it if it does not go within ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        _kill_group(proc)


def tool_version(tool: str, *args: str) -> str:
    """The first line of ``tool --version`` (or ``args``), or ``"unknown"``."""
    try:
        result = run([tool, *(args or ("--version",))], check=False, timeout=30)
    except (ToolMissingError, CommandError):
        return "unknown"
    first = (result.stdout or result.stderr).decode("utf-8", errors="replace").strip().splitlines()
    return first[0].strip() if first else "unknown"
