"""Builders and raw-database checks shared by the store tests and their worker processes.

The raw helpers bypass the store on purpose: they look at what is really in the
database (SQLite file or PostgreSQL) with a connection of their own.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from server.store import AgentRecord, TokenRecord, sqlite_path
from server.store.postgres import PostgresStore
from server.store.sql import SqlStore
from server.store.sqlite import SqliteStore
from tests.store.pgcluster import PostgresCluster, PostgresMissingError

FAR_FUTURE = 4_000_000_000
REPO = Path(__file__).resolve().parents[2]


def spawn_worker(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    """Start ``python -m tests.store.workers ARGS`` in the repository root; stdout is a pipe of acks."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.store.workers", *args],
        cwd=REPO,
        env=env,
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def make_cluster(name: str) -> PostgresCluster:
    """A new PostgreSQL cluster (not started); fails the test, naming the package, if it is missing."""
    try:
        return PostgresCluster(name=name)
    except PostgresMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


def open_backend(dsn: str, **options: Any) -> SqlStore:
    """The store class for ``dsn``, with constructor options (clock, timeouts, pool size) the tests tune."""
    path = sqlite_path(dsn)
    if path is not None:
        return SqliteStore(path, **options)
    return PostgresStore(dsn, **options)


def agent(
    spiffe_id: str = "spiffe://example.org/spire/agent/tpm/aa", *, at: int = 1_700_000_000, **kw: Any
) -> AgentRecord:
    fields: dict[str, Any] = {
        "spiffe_id": spiffe_id,
        "attestation_type": "tpm",
        "ek_hash": hashlib.sha256(spiffe_id.encode()).hexdigest(),
        "first_attested_at": at,
        "last_attested_at": at,
        "svid_serial": "1",
        "svid_expires_at": at + 3600,
        "selectors": ("tpm:pub_hash:aa",),
    }
    fields.update(kw)
    return AgentRecord(**fields)


def new_token_id() -> str:
    return uuid.uuid4().hex[:12]


def token(
    agent_id: str, token_id: str | None = None, *, expires_at: int = FAR_FUTURE, **kw: Any
) -> TokenRecord:
    token_id = token_id or new_token_id()
    fields: dict[str, Any] = {
        "agent_id": agent_id,
        "token_id": token_id,
        "secret_sha256": hashlib.sha256(f"secret-of-{token_id}".encode()).hexdigest(),
        "pool": "gpu-a100",
        "node_name": "node-" + token_id,
        "issued_at": 1_700_000_000,
        "expires_at": expires_at,
        "backend_ref": f"kube-system/bootstrap-token-{token_id}",
    }
    fields.update(kw)
    return TokenRecord(**fields)


# -- raw access ----------------------------------------------------------------


def raw_rows(dsn: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    path = sqlite_path(dsn)
    if path is not None:
        conn = sqlite3.connect(path, timeout=30)
        try:
            return [tuple(row) for row in conn.execute(sql.replace("%s", "?"), tuple(params)).fetchall()]
        finally:
            conn.close()
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as pg:
        cursor = pg.execute(sql, tuple(params))
        return list(cursor.fetchall()) if cursor.description else []


def raw_execute(dsn: str, sql: str, params: Sequence[Any] = ()) -> None:
    """One statement in its own transaction; the driver's own error propagates."""
    path = sqlite_path(dsn)
    if path is not None:
        conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(sql.replace("%s", "?"), tuple(params))
        finally:
            conn.close()
        return
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as pg:
        pg.execute(sql, tuple(params))


def integrity_problems(dsn: str) -> list[str]:
    """Everything a crash or a race could have left half-done; empty when the database is sound."""
    problems = []
    orphans = raw_rows(
        dsn,
        "SELECT t.token_id FROM tokens t LEFT JOIN agents a ON a.spiffe_id = t.agent_id"
        " WHERE a.spiffe_id IS NULL",
    )
    if orphans:
        problems.append(f"tokens without their agent: {orphans[:5]}")
    incomplete = raw_rows(
        dsn,
        "SELECT spiffe_id FROM agents WHERE attestation_type IS NULL OR ek_hash IS NULL"
        " OR first_attested_at IS NULL OR last_attested_at IS NULL OR svid_serial IS NULL"
        " OR svid_expires_at IS NULL OR selectors IS NULL OR can_reattest IS NULL OR banned IS NULL"
        " OR (NOT placeholder AND (attestation_type = '' OR ek_hash = '' OR svid_serial = ''))",
    )
    if incomplete:
        problems.append(f"agents with missing fields: {incomplete[:5]}")
    partial_tokens = raw_rows(
        dsn,
        "SELECT token_id FROM tokens WHERE secret_sha256 IS NULL OR pool IS NULL OR node_name IS NULL"
        " OR issued_at IS NULL OR expires_at IS NULL OR revoked IS NULL",
    )
    if partial_tokens:
        problems.append(f"tokens with missing fields: {partial_tokens[:5]}")
    doubles = live_token_doubles(dsn)
    if doubles:
        problems.append(f"agents with more than one live token: {doubles[:5]}")
    path = sqlite_path(dsn)
    if path is not None:
        check = raw_rows(dsn, "PRAGMA integrity_check")
        if check != [("ok",)]:
            problems.append(f"SQLite integrity_check: {check[:5]}")
        foreign = raw_rows(dsn, "PRAGMA foreign_key_check")
        if foreign:
            problems.append(f"SQLite foreign_key_check: {foreign[:5]}")
    return problems


def live_token_doubles(dsn: str) -> list[tuple[Any, ...]]:
    return raw_rows(
        dsn, "SELECT agent_id, COUNT(*) FROM tokens WHERE NOT revoked GROUP BY agent_id HAVING COUNT(*) > 1"
    )
