"""A real, throwaway PostgreSQL 15 for the store tests and the store benchmark.

Built from the Debian packages (``/usr/lib/postgresql/15/bin``): ``initdb`` into
a fresh temporary directory, ``pg_ctl start`` on a free loopback port with the
unix socket in that directory, ``pg_ctl stop`` (or a signal to the postmaster
pid it recorded) at the end. PostgreSQL refuses to run as root, so as root the
commands run as the ``postgres`` system user through ``runuser``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

PG_BIN = Path(os.environ.get("NODETRUST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_PACKAGE = "postgresql-15"  # Debian 12; the metapackage `postgresql` pulls it in


class PostgresMissingError(RuntimeError):
    """PostgreSQL (or what it needs to run here) is not installed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresCluster:
    """One PostgreSQL server in its own temporary directory."""

    def __init__(self, *, name: str = "nodetrust-pg") -> None:
        missing = [tool for tool in ("initdb", "pg_ctl", "postgres") if not (PG_BIN / tool).is_file()]
        if missing:
            raise PostgresMissingError(
                f"PostgreSQL 15 server binaries not found in {PG_BIN} (missing: {', '.join(missing)}); "
                f"install the Debian package {PG_PACKAGE} (apt-get install {PG_PACKAGE}), "
                "or point NODETRUST_PG_BIN at its bin directory"
            )
        self._as_user: list[str] = []
        self._owner: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                self._owner = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise PostgresMissingError(
                    f"running as root and there is no 'postgres' system user to run PostgreSQL as; "
                    f"install the Debian package {PG_PACKAGE}, which creates it"
                ) from exc
            runuser = shutil.which("runuser")
            if runuser is None:
                raise PostgresMissingError("runuser not found; install the Debian package util-linux")
            self._as_user = [runuser, "-u", "postgres", "--"]
        self.base = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.data = self.base / "data"
        self.sockets = self.base / "sock"
        self.log = self.base / "postgres.log"
        self.host = "127.0.0.1"
        self.port = 0
        self.pid = 0
        if self._owner is not None:
            os.chown(self.base, self._owner.pw_uid, self._owner.pw_gid)
        self._run("mkdir", "-p", str(self.sockets))
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        )

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        result = subprocess.run(
            [*self._as_user, *argv],
            env=env,
            cwd=self.base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    def start(self, port: int | None = None) -> None:
        """Start on ``port`` or a free one (another if it got taken meanwhile); wait until it accepts."""
        for _ in range(1 if port else 5):
            self.port = port or free_port()
            options = (
                f"-c listen_addresses={self.host} -c port={self.port}"
                f" -c unix_socket_directories={self.sockets}"
                " -c max_connections=300 -c shared_buffers=32MB -c fsync=on -c synchronous_commit=on"
            )
            started = self._run(
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                "60",
                "-o",
                options,
                "start",
                check=False,
            )
            if started.returncode == 0:
                self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
                return
            if "could not bind" not in self.log_tail():
                break
        raise RuntimeError(f"PostgreSQL did not start:\n{started.stdout}{started.stderr}\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, mode: str = "fast") -> None:
        """Stop the server this object started; ``immediate`` is a crash (no shutdown checkpoint)."""
        if not self.pid:
            return
        pid, self.pid = self.pid, 0
        result = self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop", check=False
        )
        if result.returncode != 0 and _alive(pid):
            os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsn(), autocommit=True, connect_timeout=10)

    def create_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:16]}"
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        with contextlib.suppress(psycopg.OperationalError), self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours would still answer; the postmaster is pg_ctl's child, not ours.
    return True
