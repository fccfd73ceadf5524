"""The SQLite store: one file in WAL mode, for a single nodeserver.

Connections:

* one writer connection behind a lock; every write is ``BEGIN IMMEDIATE`` ...
  ``COMMIT`` with ``synchronous=FULL``, so a call that returned is on disk and a
  write that did not return is absent after a crash (kill -9 or power loss);
* a small pool of reader connections, so reads never queue behind a write's
  fsync (WAL lets them see the last committed state while a write is running).

``node_lock`` takes an in-process lock per node and then an open-file-description
lock on one byte of ``<file>.locks`` (at an offset hashed from the agent id), so
two processes sharing the file also exclude each other.

The file is created 0600 and, where the store creates it, its directory 0700.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import logging
import os
import sqlite3
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from server.errors import ConfigError, ServerError, StoreError
from server.store.pool import KeyedLock, Pool
from server.store.sql import Row, SqlStore, Tx

log = logging.getLogger(__name__)

T = TypeVar("T")

_BUSY_TIMEOUT_MS = 10_000
_READERS = 8
# struct flock on Linux (x86-64, arm64): l_type, l_whence, pad, l_start, l_len, l_pid, pad.
_FLOCK = "@hhqqi4x"


@functools.lru_cache(maxsize=256)
def _placeholders(sql: str) -> str:
    return sql.replace("%s", "?")


class _SqliteTx(Tx):
    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._cursor.execute(_placeholders(sql), tuple(params))

    def fetchone(self) -> Row | None:
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def fetchall(self) -> list[Row]:
        return [tuple(row) for row in self._cursor.fetchall()]


class SqliteStore(SqlStore):
    dialect = "sqlite"

    def __init__(
        self,
        path: str,
        *,
        readers: int = _READERS,
        lock_timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock=clock)
        self.path = os.path.abspath(path)
        self._lock_timeout = lock_timeout
        _prepare_file(self.path)
        self._lock_file = f"{self.path}.locks"
        _create_private(self._lock_file)
        self._node_locks = KeyedLock()
        self._held = threading.local()  # slots of the lock file this thread holds, with their depth
        self._write_lock = threading.Lock()
        self._writer = self._connect(writer=True)
        # readers=0: every read goes through the writer connection (one connection in all).
        self._readers: Pool[sqlite3.Connection] | None = None
        if readers > 0:
            self._readers = Pool(
                connect=lambda: self._connect(writer=False),
                close=lambda conn: conn.close(),
                healthy=lambda conn: True,
                size=readers,
                timeout=lock_timeout,
                what="SQLite reader",
            )

    # -- connections -----------------------------------------------------------
    def _connect(self, *, writer: bool) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the SQLite store {self.path}: {exc}") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = FULL")
            if writer:
                conn.execute("PRAGMA journal_size_limit = 67108864")  # trim the WAL back to 64 MiB
                mode = _enable_wal(conn)
                if mode is None or str(mode[0]).lower() != "wal":
                    raise StoreError(
                        f"the SQLite store {self.path} cannot use WAL mode (got {mode and mode[0]!r});"
                        " put it on a local file system"
                    )
            else:
                conn.execute("PRAGMA query_only = ON")
        except sqlite3.Error as exc:
            conn.close()
            raise _store_error(self.path, exc) from exc
        except ServerError:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        if self._readers is not None:
            self._readers.close()
        with self._write_lock:
            self._writer.close()

    # -- transactions ----------------------------------------------------------
    def _read(self, work: Callable[[Tx], T]) -> T:
        if self._readers is None:
            with self._write_lock:
                return self._write_locked(work, "BEGIN")
        conn = self._readers.get()
        broken = False
        try:
            cursor = conn.cursor()
            try:
                return work(_SqliteTx(cursor))
            finally:
                cursor.close()
        except sqlite3.Error as exc:
            broken = True
            raise _store_error(self.path, exc) from exc
        finally:
            if conn.in_transaction:
                broken = True
            self._readers.put(conn, broken=broken)

    def _write(self, work: Callable[[Tx], T], *, single: bool = False) -> T:
        # Always BEGIN IMMEDIATE, even for one statement: it takes the write lock up front, so a
        # second process writing to the file makes this wait (busy timeout), never fail mid-way.
        with self._write_lock:
            return self._write_locked(work, "BEGIN IMMEDIATE")

    def _write_locked(self, work: Callable[[Tx], T], begin: str) -> T:
        conn = self._writer
        try:
            cursor = conn.cursor()
            cursor.execute(begin)
            try:
                result = work(_SqliteTx(cursor))
                cursor.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
            finally:
                cursor.close()
        except sqlite3.Error as exc:
            raise _store_error(self.path, exc) from exc
        return result

    def migrate(self) -> int:
        # BEGIN IMMEDIATE takes SQLite's write lock: a second process migrating waits (busy timeout),
        # then finds the work done.
        with self._write_lock:
            return self._write_locked(self._apply_migrations, "BEGIN IMMEDIATE")

    # -- node lock -------------------------------------------------------------
    @contextmanager
    def node_lock(self, agent_id: str) -> Iterator[None]:
        with self._node_locks.hold(agent_id, self._lock_timeout), self._file_lock(agent_id):
            yield

    @contextmanager
    def _file_lock(self, agent_id: str) -> Iterator[None]:
        slot = int.from_bytes(hashlib.sha256(agent_id.encode()).digest()[:4], "big")
        held: dict[int, int] = self._held.__dict__.setdefault("slots", {})
        if held.get(slot):  # this thread holds it already (node_lock is re-entrant)
            held[slot] += 1
            try:
                yield
            finally:
                held[slot] -= 1
            return
        try:
            fd = os.open(self._lock_file, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"cannot open the node lock file {self._lock_file}: {exc.strerror}") from exc
        try:
            self._wait_for_range(fd, slot, agent_id)
            held[slot] = 1
            try:
                yield
            finally:
                del held[slot]
        finally:
            os.close(fd)  # closing the open file description releases its lock

    def _wait_for_range(self, fd: int, slot: int, agent_id: str) -> None:
        request = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
        deadline = time.monotonic() + self._lock_timeout
        pause = 0.0005
        while True:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise StoreError(f"cannot lock {self._lock_file}: {exc.strerror}") from exc
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"timed out after {self._lock_timeout:g}s waiting for another process's lock"
                    f" on node {agent_id}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


def _enable_wal(conn: sqlite3.Connection) -> tuple[Any, ...] | None:
    """Switch the file to WAL (a lasting property of the file); retried while another opener holds it.

    Two processes creating the file at once can get "database is locked" here without the busy
    handler being called (SQLite refuses to wait where waiting could deadlock).
    """
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            row: tuple[Any, ...] | None = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            return row
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


def _store_error(path: str, exc: sqlite3.Error) -> StoreError:
    text = str(exc)
    if isinstance(exc, sqlite3.IntegrityError):
        return StoreError(f"the SQLite store {path} refused a write: {text}", reason="integrity")
    if "no such table" in text:
        return StoreError(f"the SQLite store {path} has no schema ({text}); run migrate first")
    if "not a database" in text or "malformed" in text:
        return StoreError(f"the SQLite store {path} is corrupt or not an SQLite database: {text}")
    return StoreError(f"the SQLite store {path} failed: {text}")


def _prepare_file(path: str) -> None:
    """Create the directory (0700) and the file (0600), or check what is there.

    Safe when several processes do it at once: whoever loses the race to create uses what the
    winner created.
    """
    directory = os.path.dirname(path)
    created = False
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        os.mkdir(directory, 0o700)
        created = True
        os.chmod(directory, 0o700)  # exactly 0700, whatever the umask
    except FileExistsError:
        pass  # there already (or a file is in the way: checked below)
    except OSError as exc:
        raise ConfigError(f"cannot create the SQLite store directory {directory}: {exc.strerror}") from exc
    if not os.path.isdir(directory):
        raise ConfigError(f"the SQLite store directory {directory} exists and is not a directory")
    if not created:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & 0o077 and not mode & stat.S_ISVTX:
            log.warning("the SQLite store directory %s is mode %o; 0700 is recommended", directory, mode)
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ConfigError(f"the SQLite store path {path} exists and is not a regular file")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"the SQLite store directory {directory} is not writable by this user")
    _create_private(path)


def _create_private(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open {path} for writing: {exc.strerror}") from exc
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
