"""``nodeserver run`` as a separate process (benchmarks, the demo, kill -9 tests), with its ports and bundle."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """Start ``nodeserver run`` on a configuration (a dict written to ``path``, or an existing file)."""

    def __init__(
        self,
        config: dict[str, Any] | None,
        path: Path,
        *,
        log: Path | None = None,
        nofile: int | None = None,
        netns: str | None = None,
    ) -> None:
        """``netns``: run inside ``/run/netns/<netns>`` (``nsenter --net``): a rack's server (tests/support/rack.py)."""
        if config is not None:
            path.write_text(json.dumps(config, indent=2))
        self.path = path
        self._log = log.open("w") if log is not None else None
        argv = [sys.executable, "-m", "server.cli", "run", "--config", str(path)]
        if netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            text=True,
            preexec_fn=(lambda: _soft_nofile(nofile)) if nofile is not None else None,  # noqa: PLW1509
        )
        if self.proc.stdout is None:
            raise RuntimeError("nodeserver has no stdout pipe")
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"nodeserver did not start (exit {self.proc.returncode}): {line!r}")
        self.line = line.strip()
        self.attest_port = int(line.split(" on port ")[1].split(",")[0])
        self.join_port = int(line.split("join on ")[1].split(",")[0]) if "join on " in line else 0
        self.bundle = subprocess.run(
            [sys.executable, "-m", "server.cli", "bundle", "--config", str(path)],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def attest(self) -> str:
        return f"127.0.0.1:{self.attest_port}"

    @property
    def join(self) -> str:
        return f"127.0.0.1:{self.join_port}"

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _soft_nofile(limit: int) -> None:
    """In the child before exec: start with a low soft open-file limit (as many distributions do)."""
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
