"""Store micro-benchmark: record_attestation and replace_token rates, SQLite and PostgreSQL, one run.

    .venv/bin/python -m bench.store [--seconds 1] [--threads 1,16,64]

SQLite runs in a temporary directory; PostgreSQL is a throwaway PostgreSQL 15
started from the Debian packages (as the tests do), with fsync and
synchronous_commit on. Each figure is the median of three runs, each the number
of calls that returned in a fixed time divided by that time. For SQLite it also
measures the connection strategies the store chose between: a reader pool plus
one locked writer (the default), one locked connection for everything
(``readers=0``), and raw connection-per-thread writers that rely on SQLite's
busy handler.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from server.store import AgentRecord, TokenRecord
from server.store import schema as store_schema
from server.store import sql as store_sql
from server.store.postgres import PostgresStore
from server.store.sql import SqlStore
from server.store.sqlite import SqliteStore
from tests.store.pgcluster import PostgresCluster, PostgresMissingError

log = logging.getLogger(__name__)

Op = Callable[[int, int], None]


@dataclass(frozen=True)
class Figure:
    backend: str
    operation: str
    threads: int
    rate: float


def agent_record(n: str, i: int) -> AgentRecord:
    spiffe_id = f"spiffe://bench.example/spire/agent/tpm/{n}"
    return AgentRecord(
        spiffe_id=spiffe_id,
        attestation_type="tpm",
        ek_hash=hashlib.sha256(spiffe_id.encode()).hexdigest(),
        first_attested_at=1_700_000_000 + i,
        last_attested_at=1_700_000_000 + i,
        svid_serial=str(i),
        svid_expires_at=1_700_003_600 + i,
        selectors=("tpm:pub_hash:" + n,),
    )


def token_record(agent_id: str) -> TokenRecord:
    token_id = uuid.uuid4().hex[:12]
    return TokenRecord(
        agent_id=agent_id,
        token_id=token_id,
        secret_sha256=hashlib.sha256(token_id.encode()).hexdigest(),
        pool="bench",
        node_name="node-" + token_id,
        issued_at=1_700_000_000,
        expires_at=4_000_000_000,
    )


REPEATS = 3


def rate(threads: int, seconds: float, op: Op) -> float:
    """Median over REPEATS runs of calls per second of ``op(thread, i)`` from ``threads`` threads."""
    return statistics.median(one_rate(threads, seconds, op) for _ in range(REPEATS))


def one_rate(threads: int, seconds: float, op: Op) -> float:
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    failures: list[BaseException] = []

    def body(t: int) -> None:
        start.wait()
        i = 0
        try:
            while not stop.is_set():
                op(t, i)
                i += 1
        except BaseException as exc:
            failures.append(exc)
            stop.set()
        counts[t] = i

    workers = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.monotonic()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    elapsed = time.monotonic() - began
    if failures:
        raise RuntimeError(f"a benchmark call failed: {failures[0]!r}") from failures[0]
    return sum(counts) / elapsed


def run_store(backend: str, store: SqlStore, thread_counts: list[int], seconds: float) -> list[Figure]:
    store.migrate()
    figures = []
    for threads in thread_counts:
        prefix = uuid.uuid4().hex[:6]

        def attest(t: int, i: int, prefix: str = prefix) -> None:
            store.record_attestation(agent_record(f"{prefix}-{t}-{i % 500}", i))

        figures.append(Figure(backend, "record_attestation", threads, rate(threads, seconds, attest)))

        agents = [
            [store.record_attestation(agent_record(f"{prefix}-r-{t}-{k}", 0)).spiffe_id for k in range(50)]
            for t in range(threads)
        ]

        def replace(t: int, i: int, agents: list[list[str]] = agents) -> None:
            agent_id = agents[t][i % 50]
            with store.node_lock(agent_id):
                store.replace_token(token_record(agent_id))

        figures.append(Figure(backend, "replace_token+node_lock", threads, rate(threads, seconds, replace)))

        def attestation_path(t: int, i: int, prefix: str = prefix) -> None:
            record = agent_record(f"{prefix}-{t}-{i % 500}", i)
            if not store.is_banned(record.spiffe_id):
                store.record_attestation(record)
            store.live_token(record.spiffe_id, 0)

        figures.append(
            Figure(backend, "is_banned+attest+live_token", threads, rate(threads, seconds, attestation_path))
        )
    return figures


def run_sqlite_per_thread(path: str, thread_counts: list[int], seconds: float) -> list[Figure]:
    """The rejected alternative: a connection per thread, each write contending on SQLite's own lock."""
    local = threading.local()
    opened: list[sqlite3.Connection] = []
    guard = threading.Lock()

    def connection() -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            local.conn = conn
            with guard:
                opened.append(conn)
        return conn

    upsert = store_sql._UPSERT_AGENT.replace("%s", "?")  # the store's own statement
    figures = []
    for threads in thread_counts:
        prefix = uuid.uuid4().hex[:6]

        def attest(t: int, i: int, prefix: str = prefix) -> None:
            conn = connection()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                upsert, store_schema.agent_params(agent_record(f"{prefix}-{t}-{i % 500}", i))
            ).fetchall()
            conn.execute("COMMIT")

        figures.append(
            Figure(
                "sqlite, connection per thread",
                "record_attestation",
                threads,
                rate(threads, seconds, attest),
            )
        )
    for conn in opened:
        conn.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.store", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per run (median of 3)")
    parser.add_argument("--threads", default="1,16,64", help="comma-separated thread counts")
    args = parser.parse_args(argv)
    thread_counts = [int(n) for n in args.threads.split(",")]
    logging.basicConfig(level=logging.WARNING)

    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="nodetrust-bench-") as tmp:
        for label, readers in (("sqlite", 8), ("sqlite, one connection", 0)):
            path = os.path.join(tmp, label.replace(", ", "-").replace(" ", "-"), "store.db")
            lite = SqliteStore(path, readers=readers)
            try:
                figures += run_store(label, lite, thread_counts, args.seconds)
            finally:
                lite.close()
        raw_path = os.path.join(tmp, "raw", "store.db")
        SqliteStore(raw_path).migrate()
        figures += run_sqlite_per_thread(raw_path, thread_counts, args.seconds)

    try:
        cluster = PostgresCluster(name="nodetrust-bench-pg")
    except PostgresMissingError as exc:
        print(f"PostgreSQL figures left out: {exc}", file=sys.stderr)
        cluster = None
    if cluster is not None:
        try:
            cluster.start()
            pg = PostgresStore(cluster.dsn(cluster.create_database()), pool_size=16)
            try:
                figures += run_store("postgresql", pg, thread_counts, args.seconds)
            finally:
                pg.close()
        finally:
            cluster.destroy()

    report(figures, os.cpu_count() or 0, args.seconds)
    return 0


def report(figures: list[Figure], cpus: int, seconds: float) -> None:
    print(
        f"store benchmark: {cpus} CPUs, median of {REPEATS} runs of {seconds:g} s per figure,"
        " calls per second (higher is better)"
    )
    print(f"{'backend':<32} {'operation':<30} {'threads':>7} {'calls/s':>10}")
    for f in figures:
        print(f"{f.backend:<32} {f.operation:<30} {f.threads:>7} {f.rate:>10.0f}")
    by_key = {(f.backend, f.operation, f.threads): f.rate for f in figures}
    print("ratios (same run):")
    for f in figures:
        if f.backend != "postgresql":
            continue
        base = by_key.get(("sqlite", f.operation, f.threads))
        if base:
            print(f"  postgresql / sqlite  {f.operation:<30} {f.threads:>3} threads: {f.rate / base:5.2f}")
    for (backend, operation, threads), value in by_key.items():
        base = by_key.get(("sqlite", operation, threads))
        if backend.startswith("sqlite,") and base:
            print(
                f"  {backend} / sqlite (default) {operation:<30} {threads:>3} threads: {value / base:5.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())
