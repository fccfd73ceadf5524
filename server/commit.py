"""Group commit: the store steps of concurrent attestations, one transaction and one thread hop per batch.

Each attestation ends with a durable store write (a banned check and an UPSERT, fsynced) and its
audit line, and that I/O must not run on the event loop. Handing every attestation to a thread
pool cost about 0.4 ms of CPU each in thread wake-ups and GIL hand-offs, more than the write
itself (docs/performance.md). :class:`GroupCommit` keeps one writer thread: the loop appends a
step and wakes the writer only when it is idle; the writer takes everything queued (at most
:data:`MAX_BATCH`), records it in one transaction (:meth:`Store.record_attestations`), writes each
audit line, and resolves the whole batch with one wake-up of the loop. A lone attestation costs
what it did; a boot storm's cost per attestation falls with the batch.

Every step keeps its own semantics (:class:`server.boundary.Call`): a call cancelled before its
batch starts is dropped with ``CallCancelled``; one whose agent (or other identity) is banned
gets ``BannedError`` and nothing is written for it; an error of the store fails the batch's
calls with ``StoreError`` and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from server.boundary import Call
from server.errors import BannedError, ServerError, StoreError
from server.store import AgentRecord, Store

log = logging.getLogger(__name__)

MAX_BATCH = 128


@dataclass
class _Step:
    call: Call
    record: AgentRecord
    others: Sequence[str]
    on_stored: Callable[[], None]  # inside the call's commit section, after the write: its audit line
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    outcome: BaseException | None = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class GroupCommit:
    def __init__(self, store: Store, *, name: str = "nodeserver-commit") -> None:
        self.store = store
        self._queue: deque[_Step] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._idle = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def record(
        self, call: Call, record: AgentRecord, others: Sequence[str], on_stored: Callable[[], None]
    ) -> None:
        """Record ``record`` unless banned, then run ``on_stored`` in the call's commit section."""
        loop = asyncio.get_running_loop()
        step = _Step(call, record, others, on_stored, loop, loop.create_future())
        with self._cond:
            if self._closed:
                raise StoreError("the server is stopping", detail="group commit closed")
            self._queue.append(step)
            if self._idle:
                self._cond.notify()
        await step.future
        if step.outcome is not None:
            raise step.outcome

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._idle = True
                    self._cond.wait()
                self._idle = False
                if not self._queue and self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
            try:
                self._commit(batch)
            except BaseException as exc:  # pragma: no cover - _commit maps everything per step
                log.exception("group commit failed")
                for step in batch:
                    step.outcome = step.outcome or exc
            self._resolve(batch)

    def _commit(self, batch: list[_Step]) -> None:
        entered: list[_Step] = []
        for step in batch:
            try:
                step.stack.enter_context(step.call.committing())
            except BaseException as exc:  # CallCancelled: the client left before the write
                step.outcome = exc
                continue
            entered.append(step)
        if not entered:
            return
        rows: list[AgentRecord | None] | None = None
        failure: ServerError | None = None
        try:
            rows = self.store.record_attestations([(s.record, s.others) for s in entered])
        except ServerError as exc:
            failure = exc
        except Exception as exc:
            failure = StoreError("failed to create attested agent", detail=str(exc))
        for i, step in enumerate(entered):
            try:
                with step.stack:
                    if failure is not None or rows is None:
                        raise failure or StoreError("failed to create attested agent")
                    stored = rows[i]
                    if stored is None or stored.banned:  # banned before, or between the check and the write
                        raise BannedError("failed to attest: agent is banned")
                    step.on_stored()
            except BaseException as exc:
                step.outcome = exc

    def _resolve(self, batch: list[_Step]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Step]] = {}
        for step in batch:
            by_loop.setdefault(step.loop, []).append(step)
        for loop, steps in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_wake, steps)


def _wake(steps: list[_Step]) -> None:
    for step in steps:
        if not step.future.done():
            step.future.set_result(None)


__all__ = ["MAX_BATCH", "GroupCommit"]
