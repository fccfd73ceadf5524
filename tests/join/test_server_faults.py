"""Faults: the server killed -9 during a storm of attestations and joins; two replicas on one PostgreSQL."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from server.store import open_store
from tests.store.helpers import make_cluster
from tests.support.joinenv import SimAgent, attest_sim_at, cpu_report, join_at, join_config
from tests.support.serverproc import ServerProcess
from tests.support.simtpm import SimCa, SimulatedTpm

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _storm(
    server: ServerProcess, ca: SimCa, base: Path, count: int, acks: dict[str, Any], stop: threading.Event
) -> None:
    lock = threading.Lock()

    def one(i: int) -> None:
        if stop.is_set():
            return
        try:
            agent: SimAgent = attest_sim_at(
                server.attest, server.bundle, SimulatedTpm.create(ca), base / f"a{i}"
            )
            with lock:
                acks["attested"][agent.spiffe_id] = True
            grant = join_at(server.join, server.bundle, agent, node_name=f"node-{i}", report=cpu_report())
            with lock:
                acks["tokens"].setdefault(agent.spiffe_id, []).append(grant.token.split(".")[0])
        except Exception:
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def test_kill_9_during_a_storm_loses_nothing_acknowledged(tmp_path: Path) -> None:
    ca = SimCa.create()
    config, _ = join_config(tmp_path, ca, store=f"sqlite:///{tmp_path / 'data' / 'store.db'}")
    server = ServerProcess(config, tmp_path / "config.yaml")
    acks: dict[str, Any] = {"attested": {}, "tokens": {}}
    stop = threading.Event()
    storm = threading.Thread(target=_storm, args=(server, ca, tmp_path, 40, acks, stop))
    cpu_report()  # compute the report before the storm
    storm.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(acks["tokens"]) < 5:
        time.sleep(0.05)
    server.kill9()
    stop.set()
    storm.join(180)
    assert acks["attested"], "the storm never got going"
    # Restart on the same data: it must come up cleanly.
    restarted = ServerProcess(config, tmp_path / "config.yaml")
    restarted.stop()
    store = open_store(config["store"])
    try:
        for spiffe_id in acks["attested"]:
            assert store.get_agent(spiffe_id) is not None, f"acknowledged attestation of {spiffe_id} lost"
        now = int(time.time())
        for spiffe_id, token_ids in acks["tokens"].items():
            live = store.live_token(spiffe_id, now)
            assert live is not None and live.token_id == token_ids[-1], (
                f"acknowledged token of {spiffe_id} lost"
            )
        for agent in store.list_agents():
            assert agent.spiffe_id and agent.ek_hash and agent.svid_serial
    finally:
        store.close()
    import sqlite3

    db = sqlite3.connect(str(tmp_path / "data" / "store.db"))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        db.close()


def test_two_replicas_on_one_postgres_never_mint_two_live_tokens(tmp_path: Path) -> None:
    cluster = make_cluster("nodetrust-join-pg")
    cluster.start()
    try:
        dsn = cluster.dsn(cluster.create_database())
        ca = SimCa.create()
        # Far more joins than the per-agent limit allows in production: this test is about the lock.
        config, _ = join_config(tmp_path, ca, store=dsn, join={"token_ttl": "15m", "joins_per_agent": 1000})
        a = ServerProcess({**config, "audit_log": str(tmp_path / "audit-a.jsonl")}, tmp_path / "a.yaml")
        b = ServerProcess({**config, "audit_log": str(tmp_path / "audit-b.jsonl")}, tmp_path / "b.yaml")
        try:
            assert a.bundle == b.bundle, "replicas must share the CA (same data_dir)"
            agent = attest_sim_at(a.attest, a.bundle, SimulatedTpm.create(ca), tmp_path / "agent")
            report = cpu_report()
            issued: list[str] = []
            lock = threading.Lock()

            def hammer(server: ServerProcess) -> None:
                for _ in range(6):
                    grant = join_at(server.join, server.bundle, agent, report=report)
                    with lock:
                        issued.append(grant.token.split(".")[0])

            threads = [threading.Thread(target=hammer, args=(s,)) for s in (a, b, a, b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert len(issued) == 24
            files = sorted((tmp_path / "tokens").glob("bootstrap-token-*.yaml"))
            assert len(files) == 1, f"{len(files)} live token files for one node"
            store = open_store(dsn)
            try:
                live = store.live_token(agent.spiffe_id, int(time.time()))
                assert live is not None and files[0].name == f"bootstrap-token-{live.token_id}.yaml"
            finally:
                store.close()
        finally:
            a.stop()
            b.stop()
    finally:
        cluster.destroy()
    assert os.environ.get("NODESERVER_CONFIG") is None
