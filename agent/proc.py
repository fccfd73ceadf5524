"""The agent's one subprocess chokepoint.

Every external program the agent runs (kubeadm, systemctl, journalctl) goes
through :func:`run`: argv only (never a shell), a pinned C locale, stdin from
/dev/null, a timeout, and a log line with the exact command. Secrets never
appear in argv: pass them in files.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from agent.errors import AgentError

log = logging.getLogger(__name__)


class Failure(StrEnum):
    """How a command failed: callers decide from this, never from the message."""

    MISSING = "missing"  # not installed, or not on PATH
    NOT_RUNNABLE = "not_runnable"  # not executable, a noexec mount, a bad interpreter line
    TIMEOUT = "timeout"
    EXIT = "exit"  # exited non-zero
    EMPTY = "empty"  # no command at all (a bug in the caller)


class CommandError(AgentError):
    """A command could not be started, timed out, or exited non-zero when that was not allowed."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str],
        returncode: int | None,
        output: str = "",
        failure: Failure = Failure.EXIT,
    ) -> None:
        super().__init__(message, hint=f"run `{shlex.join(argv)}` by hand to see the whole output")
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        self.failure = failure


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run(
    argv: Sequence[str],
    *,
    timeout: float = 60.0,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> Completed:
    """Run ``argv`` and capture its output. Raise :class:`CommandError` on failure when ``check``."""
    if not argv or not isinstance(argv[0], str):
        raise CommandError("empty command", argv=list(argv), returncode=None, failure=Failure.EMPTY)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LC_")}
    full_env.update({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})
    if env:
        full_env.update(env)
    log.debug("+ %s", shlex.join(argv))
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            check=False,
        )
    except FileNotFoundError as exc:
        raise CommandError(
            f"{argv[0]} is not installed or not on PATH", argv=argv, returncode=None, failure=Failure.MISSING
        ) from exc
    except OSError as exc:  # not executable, a noexec mount, a bad interpreter line
        raise CommandError(
            f"{argv[0]} cannot be run: {exc.strerror or exc}",
            argv=argv,
            returncode=None,
            failure=Failure.NOT_RUNNABLE,
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise CommandError(
            f"{argv[0]} did not finish within {timeout:.0f} s",
            argv=argv,
            returncode=None,
            failure=Failure.TIMEOUT,
        ) from exc
    result = Completed(list(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        log.error("command failed (exit %d): %s", proc.returncode, shlex.join(argv))
        raise CommandError(
            f"{argv[0]} exited with status {proc.returncode}: {' / '.join(tail) or 'no output'}",
            argv=argv,
            returncode=proc.returncode,
            output=proc.stdout + proc.stderr,
        )
    return result
