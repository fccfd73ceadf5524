"""server/commit.py: the attestations' store steps batched in one writer thread, on both backends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from server.boundary import Call, CallCancelled
from server.commit import GroupCommit
from server.errors import BannedError, StoreError
from server.store import AgentRecord
from server.store.sql import SqlStore
from tests.store.helpers import agent

TD = "spiffe://example.org/spire/agent/tpm/"


class _Boundary:
    """What Call needs of the boundary here: the line of a call cancelled mid-commit."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancelled_line(self, call: Call) -> None:
        self.cancelled.append(call.method)


class _Counting:
    """The store, counting its batch writes; the first one waits until ``release`` is set."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.batches: list[int] = []
        self.release = threading.Event()
        self.fail: Exception | None = None

    def record_attestations(
        self, batch: Sequence[tuple[AgentRecord, Sequence[str]]]
    ) -> list[AgentRecord | None]:
        self.batches.append(len(batch))
        self.release.wait(10)
        if self.fail is not None:
            raise self.fail
        return self.store.record_attestations(batch)


def _call(name: str) -> Call:
    return Call(method=name, event="attest", peer="ipv4:127.0.0.1:1", boundary=_Boundary())  # type: ignore[arg-type]


async def _storm(commit: GroupCommit, ids: list[str], stored: list[str]) -> list[BaseException | None]:
    async def one(spiffe_id: str) -> BaseException | None:
        try:
            await commit.record(_call(spiffe_id), agent(spiffe_id), (), lambda: stored.append(spiffe_id))
        except (BannedError, StoreError, CallCancelled) as exc:
            return exc
        return None

    return await asyncio.gather(*(one(i) for i in ids))


def test_a_storm_is_written_in_few_transactions_and_each_call_gets_its_outcome(store: SqlStore) -> None:
    counting = _Counting(store)
    commit = GroupCommit(counting)  # type: ignore[arg-type]
    ids = [f"{TD}{n:04x}" for n in range(40)]
    store.ban_agent(ids[7])
    stored: list[str] = []

    async def main() -> list[BaseException | None]:
        task = asyncio.ensure_future(_storm(commit, ids, stored))
        while not counting.batches:  # the first write holds the writer while the rest queue up
            await asyncio.sleep(0.01)
        counting.release.set()
        return await task

    try:
        outcomes = asyncio.run(main())
    finally:
        commit.close()
    assert sum(counting.batches) == 40
    assert len(counting.batches) < 40, counting.batches  # batched: fewer transactions than calls
    assert isinstance(outcomes[7], BannedError)
    assert [o for i, o in enumerate(outcomes) if i != 7] == [None] * 39
    assert sorted(stored) == sorted(i for i in ids if i != ids[7])  # the audit step ran for each stored one
    assert store.count_agents() == 40  # 39 written and the banned placeholder
    banned = store.get_agent(ids[7])
    assert banned is not None and banned.last_attested_at == 0


def test_a_store_error_fails_every_call_of_its_batch_and_grants_nothing(store: SqlStore) -> None:
    counting = _Counting(store)
    counting.release.set()
    counting.fail = RuntimeError("disk I/O error")
    commit = GroupCommit(counting)  # type: ignore[arg-type]
    stored: list[str] = []
    try:
        outcomes = asyncio.run(_storm(commit, [f"{TD}{n:04x}" for n in range(5)], stored))
    finally:
        commit.close()
    assert all(isinstance(o, StoreError) for o in outcomes), outcomes
    assert all(o is not None and o.reason == "store" for o in outcomes)  # type: ignore[attr-defined]
    assert stored == [] and store.count_agents() == 0


def test_a_call_cancelled_before_its_batch_is_dropped_unwritten(store: SqlStore) -> None:
    commit = GroupCommit(store)
    call = _call("gone")
    call.client_cancelled()
    stored: list[str] = []

    async def main() -> None:
        await commit.record(call, agent(f"{TD}dead"), (), lambda: stored.append("x"))

    try:
        with pytest.raises(CallCancelled):
            asyncio.run(main())
    finally:
        commit.close()
    assert stored == [] and store.get_agent(f"{TD}dead") is None


def test_after_close_nothing_is_queued(store: SqlStore) -> None:
    commit = GroupCommit(store)
    commit.close()

    async def main() -> Any:
        return await commit.record(_call("late"), agent(f"{TD}late"), (), lambda: None)

    with pytest.raises(StoreError):
        asyncio.run(main())
    assert store.get_agent(f"{TD}late") is None
