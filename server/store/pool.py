"""A tiny thread-safe connection pool, and the locks both stores use for ``node_lock``.

The pool hands out at most ``size`` connections, opens them lazily, reuses the
most recently returned one first (it is the one most likely to still be alive),
checks each one with ``healthy`` before handing it out and drops any that the
caller reports broken. It is deliberately small: no background threads, no
resizing, no statistics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from server.errors import StoreError

log = logging.getLogger(__name__)

C = TypeVar("C")


class Pool(Generic[C]):
    def __init__(
        self,
        *,
        connect: Callable[[], C],
        close: Callable[[C], None],
        healthy: Callable[[C], bool],
        size: int,
        timeout: float,
        what: str,
    ) -> None:
        if size < 1:
            raise ValueError("pool size must be at least 1")
        self._connect = connect
        self._close = close
        self._healthy = healthy
        self._size = size
        self._timeout = timeout
        self._what = what
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[C] = []
        self._open = 0  # idle + handed out + being opened
        self._closed = False

    def get(self) -> C:
        deadline = time.monotonic() + self._timeout
        while True:
            with self._cond:
                while not self._idle and self._open >= self._size and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StoreError(
                            f"all {self._size} {self._what} connections stayed busy for {self._timeout:g}s"
                        )
                    self._cond.wait(left)
                if self._closed:
                    raise StoreError(f"the {self._what} store is closed")
                conn = self._idle.pop() if self._idle else None
                if conn is None:
                    self._open += 1
            if conn is None:
                try:
                    return self._connect()
                except BaseException:
                    self._forget()
                    raise
            if self._healthy(conn):
                return conn
            log.info("dropping a stale %s connection from the pool", self._what)
            self._discard(conn)

    def put(self, conn: C, *, broken: bool = False) -> None:
        with self._cond:
            keep = not broken and not self._closed
            if keep:
                self._idle.append(conn)
                self._cond.notify()
                return
        self._discard(conn)

    def close(self) -> None:
        """Close the idle connections; connections still handed out are closed when they come back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for conn in idle:
            self._discard(conn)

    def _discard(self, conn: C) -> None:
        try:
            self._close(conn)
        except Exception:  # a connection that is already gone may fail to close; nothing to do
            log.debug("closing a %s connection failed", self._what, exc_info=True)
        self._forget()

    def _forget(self) -> None:
        with self._cond:
            self._open -= 1
            self._cond.notify()


@dataclass
class _Entry:
    lock: threading.RLock
    users: int = 0


class KeyedLock:
    """One re-entrant lock per key, created on demand and dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    @contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[None]:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(threading.RLock())
            entry.users += 1
        try:
            if not entry.lock.acquire(timeout=timeout):
                raise StoreError(f"timed out after {timeout:g}s waiting for the lock on node {key}")
            try:
                yield
            finally:
                entry.lock.release()
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]
