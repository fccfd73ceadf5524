"""Worker processes for the store tests: ``python -m tests.store.workers MODE DSN ...``.

A worker prints one line per acknowledged write on stdout, flushed, only after
the store call returned, so whatever the parent read is a write the "server"
would have reported done. Modes that take part in a race print READY and wait
for a line on stdin before they start, so processes start together.

  storm DSN PREFIX THREADS       record_attestation + replace_token until killed
  hammer DSN AGENT COUNT THREADS LOCK   replace_token for one agent (LOCK: lock|nolock)
  migrate DSN                    open the store and migrate
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable

from server.errors import StoreError
from server.store.sql import SqlStore
from tests.store.helpers import agent, open_backend, token

_out = threading.Lock()


def ack(line: str) -> None:
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def wait_for_go() -> None:
    ack("READY")
    sys.stdin.readline()


def run_threads(count: int, body: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=body, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def storm(store: SqlStore, prefix: str, threads: int) -> None:
    def body(n: int) -> None:
        serial = 0
        try:
            while True:
                serial += 1
                agent_id = f"spiffe://example.org/spire/agent/tpm/{prefix}-{n}-{serial % 8}"
                store.record_attestation(agent(agent_id, svid_serial=str(serial), at=1_700_000_000 + serial))
                ack(f"A {agent_id} {serial}")
                new = token(agent_id)
                with store.node_lock(agent_id):
                    store.replace_token(new)
                ack(f"T {agent_id} {new.token_id}")
        except StoreError as exc:
            ack(f"E {exc}")

    ack("READY")
    run_threads(threads, body)


def hammer(store: SqlStore, agent_id: str, count: int, threads: int, use_lock: bool) -> None:
    def body(_: int) -> None:
        for _ in range(count):
            new = token(agent_id)
            if use_lock:
                with store.node_lock(agent_id):
                    seen = store.live_token(agent_id, int(time.time()))
                    previous = store.replace_token(new)
                    saw, replaced = seen and seen.token_id, previous and previous.token_id
                    if saw != replaced:
                        ack(f"V saw {saw} under the lock, replaced {replaced}")
            else:
                previous = store.replace_token(new)
            ack(f"R {previous.token_id if previous else '-'} {new.token_id}")

    wait_for_go()
    run_threads(threads, body)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests.store.workers")
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("storm")
    s.add_argument("dsn")
    s.add_argument("prefix")
    s.add_argument("threads", type=int)
    h = sub.add_parser("hammer")
    h.add_argument("dsn")
    h.add_argument("agent")
    h.add_argument("count", type=int)
    h.add_argument("threads", type=int)
    h.add_argument("lock", choices=["lock", "nolock"])
    m = sub.add_parser("migrate")
    m.add_argument("dsn")
    args = parser.parse_args(argv)

    if args.mode == "migrate":
        wait_for_go()
        store = open_backend(args.dsn)
        try:
            ack(f"M {store.migrate()}")
        finally:
            store.close()
        return 0
    store = open_backend(args.dsn)
    try:
        if args.mode == "storm":
            storm(store, args.prefix, args.threads)
        else:
            hammer(store, args.agent, args.count, args.threads, args.lock == "lock")
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
