"""The one-live-token invariant under threads and processes, and concurrent migrations.

``replace_token`` returns the token it replaced, so a run of replacements must
form one chain: every token but the last is replaced exactly once, and only the
last is live. Two live tokens at any moment would show as a token replaced twice
or never, as a second live row seen by the monitor, or as a worker that read one
live token under ``node_lock`` and then replaced another.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from server.store import JoinRecord
from server.store.sql import SqlStore
from tests.store.helpers import (
    FAR_FUTURE,
    agent,
    integrity_problems,
    live_token_doubles,
    raw_rows,
    spawn_worker,
    token,
)

NODE = "spiffe://example.org/spire/agent/tpm/c0ffee"


@contextmanager
def watching_for_two_live_tokens(dsn: str) -> Iterator[list[object]]:
    """Poll the database from outside the store while the block runs; collect every sighting."""
    seen: list[object] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.extend(live_token_doubles(dsn))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join(30)


def check_chain(store: SqlStore, seed: str, pairs: list[tuple[str, str]]) -> None:
    replaced = [previous for previous, _ in pairs]
    created = [new for _, new in pairs]
    assert "-" not in replaced, "a replacement found no live token although one always exists"
    assert len(set(replaced)) == len(replaced), "a token was replaced twice: two callers saw it live"
    live = store.live_token(NODE, 0)
    assert live is not None
    assert set(replaced) == ({seed, *created} - {live.token_id}), "the replacements do not form one chain"


def seed(store: SqlStore) -> str:
    store.record_attestation(agent(NODE))
    first = token(NODE)
    store.replace_token(first)
    return first.token_id


@pytest.mark.parametrize("use_lock", [True, False], ids=["node_lock", "replace_token_alone"])
def test_threads_never_make_two_live_tokens(store: SqlStore, dsn: str, use_lock: bool) -> None:
    first = seed(store)

    def one(_: int) -> tuple[str, str]:
        new = token(NODE)
        if use_lock:
            with store.node_lock(NODE):
                seen = store.live_token(NODE, 0)
                previous = store.replace_token(new)
                assert seen == previous, "someone else replaced the token while this thread held node_lock"
        else:
            previous = store.replace_token(new)
        return (previous.token_id if previous else "-", new.token_id)

    with watching_for_two_live_tokens(dsn) as sightings, ThreadPoolExecutor(max_workers=16) as pool:
        pairs = list(pool.map(one, range(320)))
    assert sightings == []
    check_chain(store, first, pairs)
    assert integrity_problems(dsn) == []


@pytest.mark.subprocess
def test_two_processes_never_make_two_live_tokens(store: SqlStore, dsn: str) -> None:
    """Two server processes (4 threads each) mint tokens for one node through node_lock."""
    first = seed(store)
    workers = [spawn_worker("hammer", dsn, NODE, "60", "4", "lock", stdin=subprocess.PIPE) for _ in range(2)]
    try:
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "READY", worker.stderr
        with watching_for_two_live_tokens(dsn) as sightings:
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
            outputs = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
    lines = [line for out, _ in outputs for line in out.splitlines()]
    assert [line for line in lines if line.startswith("V ")] == []
    pairs = [(parts[1], parts[2]) for parts in (line.split() for line in lines) if parts[0] == "R"]
    assert len(pairs) == 2 * 4 * 60
    assert sightings == []
    check_chain(store, first, pairs)
    assert integrity_problems(dsn) == []


@pytest.mark.subprocess
def test_concurrent_migrate_from_several_processes(dsn: str) -> None:
    """Three processes open a brand-new database and migrate it at the same moment."""
    workers = [spawn_worker("migrate", dsn, stdin=subprocess.PIPE) for _ in range(3)]
    try:
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "READY"
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        outputs = [worker.communicate(timeout=120) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    versions = set()
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
        versions.add(out.split()[-1])
    assert len(versions) == 1
    rows = raw_rows(dsn, "SELECT version FROM schema_version ORDER BY version")
    assert [str(r[0]) for r in rows] == [str(v) for v in range(1, int(versions.pop()) + 1)]


def test_many_threads_many_nodes(store: SqlStore, dsn: str) -> None:
    """A server-like mix from 32 threads: attest, check the ban, consume a request id, mint a token."""

    def node(n: int) -> None:
        node_id = f"spiffe://example.org/spire/agent/tpm/{n:04x}"
        for round_ in range(10):
            store.record_attestation(agent(node_id, at=1_700_000_000 + round_, svid_serial=str(round_)))
            assert store.is_banned(node_id) is False
            assert store.consume_request_id(node_id, f"req-{round_}", FAR_FUTURE) is True
            assert store.consume_request_id(node_id, f"req-{round_}", FAR_FUTURE) is False
            with store.node_lock(node_id):
                store.replace_token(token(node_id))
            store.record_join(JoinRecord(node_id, f"node-{n}", "gpu", "t", "ok", round_))

    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(node, range(64)))
    assert store.count_agents() == 64
    for n in (0, 33, 63):
        node_id = f"spiffe://example.org/spire/agent/tpm/{n:04x}"
        stored = store.get_agent(node_id)
        assert stored is not None
        assert (stored.first_attested_at, stored.svid_serial) == (1_700_000_000, "9")
        assert len(store.joins_for(node_id)) == 10
    assert len(list(store.expired_tokens(FAR_FUTURE))) == 64 * 10
    assert integrity_problems(dsn) == []
