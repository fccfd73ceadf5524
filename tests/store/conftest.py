"""Store tier: every test that takes ``dsn`` (or ``store``) runs against SQLite and a real PostgreSQL.

PostgreSQL is started once per session from the Debian packages in a temporary
directory (see ``pgcluster``) and stopped at the end; each test gets a database
of its own. A missing PostgreSQL fails the PostgreSQL half of the tests with the
package to install; nothing is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.store.sql import SqlStore
from tests.store.helpers import make_cluster, open_backend
from tests.store.pgcluster import PostgresCluster

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]

OpenStore = Callable[..., SqlStore]


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    cluster = make_cluster("nodetrust-store-pg")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dsn(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: an SQLite file in the test's directory, or a new PostgreSQL database."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path}/store/nodeserver.db"
        return
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    name = cluster.create_database()
    try:
        yield cluster.dsn(name)
    finally:
        cluster.drop_database(name)


@pytest.fixture
def pg_dsn(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """A fresh database on the session's PostgreSQL, for the tests that are about PostgreSQL only."""
    name = postgres_cluster.create_database()
    try:
        yield postgres_cluster.dsn(name)
    finally:
        postgres_cluster.drop_database(name)


@pytest.fixture
def open_store(dsn: str) -> Iterator[OpenStore]:
    """Open more stores on the test's database (as separate server replicas would); all closed at the end."""
    opened: list[SqlStore] = []

    def factory(**options: Any) -> SqlStore:
        store = open_backend(dsn, **options)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store: OpenStore) -> SqlStore:
    opened = open_store()
    opened.migrate()
    return opened
