"""The PostgreSQL store, for several nodeserver replicas sharing one database.

Connections come from a small pool (``server.store.pool``): each is autocommit,
and a write runs in an explicit transaction (READ COMMITTED plus row locks where
a decision depends on a row: ``replace_token`` locks the agent row ``FOR
UPDATE``), retried with jitter on a serialization failure or a deadlock, both of
which PostgreSQL guarantees it rolled back. Any other failure is a StoreError;
nothing is retried where it could apply a write twice.

``node_lock`` takes an in-process lock per node (so threads of one replica queue
without holding connections), then a session advisory lock keyed on a hash of
the agent id, on a pool connection dedicated to the holder for as long as it
holds the lock. Store calls the holder's thread makes inside the block use that
same connection, so a full pool cannot deadlock against its own lock holders.
If that connection dies, PostgreSQL drops the lock with it; the one-live-token
unique index still refuses a second live token.

Every connection gets a connect timeout, TCP keepalives, a TCP user timeout and
server-side ``lock_timeout``/``statement_timeout``, so a database that goes away
surfaces as a StoreError instead of a hang. Each can be overridden in the DSN.
"""

from __future__ import annotations

import hashlib
import logging
import random
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow

from server.errors import ConfigError, StoreError
from server.store.pool import KeyedLock, Pool
from server.store.sql import Row, SqlStore, Tx

log = logging.getLogger(__name__)

T = TypeVar("T")
PgConnection = psycopg.Connection[TupleRow]

_ATTEMPTS = 8
# Two-key advisory locks live in a key space apart from the one-key (bigint) node locks.
_MIGRATION_LOCK = (0x6E74, 1)  # "nt", 1

_CONNECTION_DEFAULTS = {
    "application_name": "nodeserver",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "20000",  # ms of unacknowledged data before the kernel gives up
}


class _PgTx(Tx):
    def __init__(self, cursor: psycopg.Cursor[TupleRow]) -> None:
        self._cursor = cursor

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._cursor.execute(sql, tuple(params))

    def fetchone(self) -> Row | None:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Row]:
        return self._cursor.fetchall()


def advisory_key(agent_id: str) -> int:
    """The bigint advisory-lock key of a node: the first 8 bytes of a SHA-256 of its id."""
    return int.from_bytes(
        hashlib.sha256(b"nodetrust-node\0" + agent_id.encode()).digest()[:8], "big", signed=True
    )


class PostgresStore(SqlStore):
    dialect = "postgresql"
    lock_agent_sql = "SELECT spiffe_id FROM agents WHERE spiffe_id = %s FOR UPDATE"

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 10,
        pool_timeout: float = 10.0,
        connect_timeout: int = 5,
        lock_timeout: float = 30.0,
        statement_timeout: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock=clock)
        self._params = _connection_params(dsn, connect_timeout, lock_timeout, statement_timeout)
        self.where = "{}:{}/{}".format(
            self._params.get("host") or self._params.get("hostaddr") or "local socket",
            self._params.get("port") or 5432,
            self._params.get("dbname") or self._params.get("user") or "",
        )
        self._lock_timeout = lock_timeout
        self._pool: Pool[PgConnection] = Pool(
            connect=self._connect,
            close=lambda conn: conn.close(),
            healthy=_healthy,
            size=pool_size,
            timeout=pool_timeout,
            what="PostgreSQL",
        )
        self._node_locks = KeyedLock()
        self._local = threading.local()
        # Fail now, with a clear message, if the database cannot be reached.
        self._pool.put(self._pool.get())

    # -- connections -----------------------------------------------------------
    def _connect(self) -> PgConnection:
        try:
            return psycopg.connect(autocommit=True, **self._params)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {self.where}: {_first_line(exc)}") from exc

    def close(self) -> None:
        self._pool.close()

    @contextmanager
    def _connection(self) -> Iterator[PgConnection]:
        pinned: PgConnection | None = getattr(self._local, "conn", None)
        if pinned is not None:
            yield pinned
            return
        conn = self._pool.get()
        try:
            yield conn
        finally:
            self._pool.put(conn, broken=not _reusable(conn))

    def _error(self, exc: psycopg.Error) -> StoreError:
        text = _first_line(exc)
        if isinstance(exc, pg_errors.LockNotAvailable):
            return StoreError(f"timed out waiting for a lock in PostgreSQL at {self.where}: {text}")
        if isinstance(exc, pg_errors.QueryCanceled):
            return StoreError(f"a statement ran past its time limit in PostgreSQL at {self.where}: {text}")
        if isinstance(exc, pg_errors.UndefinedTable):
            return StoreError(f"PostgreSQL at {self.where} has no store schema ({text}); run migrate first")
        if isinstance(exc, psycopg.IntegrityError):
            return StoreError(f"PostgreSQL at {self.where} refused a write: {text}", reason="integrity")
        if isinstance(exc, psycopg.OperationalError):
            return StoreError(f"PostgreSQL at {self.where} is unavailable: {text}")
        return StoreError(f"PostgreSQL at {self.where} failed: {text}")

    # -- transactions ----------------------------------------------------------
    def _read(self, work: Callable[[Tx], T]) -> T:
        with self._connection() as conn:
            try:
                with conn.cursor() as cursor:
                    return work(_PgTx(cursor))
            except psycopg.Error as exc:
                raise self._error(exc) from exc

    def _write(self, work: Callable[[Tx], T], *, single: bool = False) -> T:
        for attempt in range(1, _ATTEMPTS + 1):
            with self._connection() as conn:
                try:
                    if single:  # one statement in autocommit is its own transaction: no BEGIN/COMMIT trips
                        with conn.cursor() as cursor:
                            return work(_PgTx(cursor))
                    with conn.transaction(), conn.cursor() as cursor:
                        return work(_PgTx(cursor))
                except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected) as exc:
                    if attempt == _ATTEMPTS:
                        raise self._error(exc) from exc
                    log.info("store transaction conflicted (%s); retrying", type(exc).__name__)
                except psycopg.Error as exc:
                    raise self._error(exc) from exc
            time.sleep(random.uniform(0, 0.002 * 2**attempt))  # noqa: S311 - jitter, not a secret
        raise AssertionError("unreachable")

    def migrate(self) -> int:
        def work(tx: Tx) -> int:
            # Held to the end of the transaction: a second process waits here, then finds the work done.
            tx.execute("SELECT pg_advisory_xact_lock(%s, %s)", _MIGRATION_LOCK)
            return self._apply_migrations(tx)

        return self._write(work)

    # -- node lock -------------------------------------------------------------
    @contextmanager
    def node_lock(self, agent_id: str) -> Iterator[None]:
        with self._node_locks.hold(agent_id, self._lock_timeout):
            pinned: PgConnection | None = getattr(self._local, "conn", None)
            conn = pinned if pinned is not None else self._pool.get()
            key = advisory_key(agent_id)
            try:
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            except psycopg.Error as exc:
                if pinned is None:
                    self._pool.put(conn, broken=not _reusable(conn))
                raise self._error(exc) from exc
            self._local.conn = conn
            try:
                yield
            finally:
                self._local.conn = pinned
                self._unlock(conn, key, agent_id)
                if pinned is None:
                    self._pool.put(conn, broken=not _reusable(conn))

    def _unlock(self, conn: PgConnection, key: int, agent_id: str) -> None:
        try:
            row = conn.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone()
        except psycopg.Error:
            log.warning(
                "lost the database connection holding the lock on node %s; the lock went with it", agent_id
            )
            conn.close()
            return
        if not row or not row[0]:
            log.warning("the lock on node %s was no longer held when it was released", agent_id)


def _connection_params(
    dsn: str, connect_timeout: int, lock_timeout: float, statement_timeout: float
) -> dict[str, Any]:
    try:
        params: dict[str, Any] = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        # The message names the bad part of the DSN; it does not repeat the DSN (which may hold a password).
        raise ConfigError(f"invalid PostgreSQL DSN: {_first_line(exc)}") from exc
    for port in str(params.get("port") or "5432").split(","):
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"invalid PostgreSQL DSN: port {port!r} is not a TCP port number")
    for key, value in _CONNECTION_DEFAULTS.items():
        params.setdefault(key, value)
    params.setdefault("connect_timeout", str(max(2, connect_timeout)))
    limits = (
        f"-c lock_timeout={int(lock_timeout * 1000)} -c statement_timeout={int(statement_timeout * 1000)}"
    )
    params["options"] = f"{limits} {params['options']}" if params.get("options") else limits
    return params


def _reusable(conn: PgConnection) -> bool:
    return not conn.closed and not conn.broken and conn.info.transaction_status == TransactionStatus.IDLE


def _healthy(conn: PgConnection) -> bool:
    """Reusable, and nothing waiting on the socket: an idle connection the server closed is readable."""
    if not _reusable(conn):
        return False
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return not poller.poll(0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
