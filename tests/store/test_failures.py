"""Bad DSNs, bad SQLite paths and files, and a PostgreSQL that goes away: clear errors, never a hang."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from server.errors import ConfigError, StoreError
from server.store import open_store, sqlite_path
from server.store.postgres import PostgresStore
from server.store.sqlite import SqliteStore
from tests.store.helpers import REPO, agent, make_cluster, token
from tests.store.pgcluster import PostgresCluster

T = TypeVar("T")

# Far above the 2-second connect timeouts below: this only tells "an error" from "a hang".
HANG = 60


def within_bound(call: Callable[[], T]) -> T:
    """Run ``call`` in a thread and fail the test (rather than hang it) if it has not returned in HANG s."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result(timeout=HANG)


# -- DSNs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("", "empty store DSN"),
        ("mysql://root:hunter2@db/nodes", "unsupported store DSN scheme 'mysql'"),
        ("sqlite://relative.db", "names a host"),
        ("sqlite:///var/lib/x.db?mode=ro", "no query parameters"),
        ("sqlite:///var/lib/", "absolute file path"),
        (":memory:", "in-memory"),
        ("host=db user=nodeserver password=hunter2", "key=value"),
        ("postgresql://nodeserver:hunter2@db:notaport/nodes", "invalid PostgreSQL DSN"),
    ],
)
def test_a_bad_dsn_is_a_config_error_that_keeps_the_password(dsn: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        open_store(dsn)
    assert "hunter2" not in str(refused.value)


def test_sqlite_dsn_forms() -> None:
    assert sqlite_path("sqlite:///var/lib/nodeserver/store.db") == "/var/lib/nodeserver/store.db"
    assert sqlite_path("sqlite:////var/lib/nodeserver/store.db") == "/var/lib/nodeserver/store.db"
    assert sqlite_path("sqlite:///var/lib/node%20server/store.db") == "/var/lib/node server/store.db"
    assert sqlite_path("/var/lib/nodeserver/store.db") == "/var/lib/nodeserver/store.db"
    assert sqlite_path("store.db") == os.path.abspath("store.db")
    assert sqlite_path("postgresql://db/nodes") is None


def test_open_store_picks_the_backend(tmp_path: Path, pg_dsn: str) -> None:
    lite = open_store(f"sqlite:///{tmp_path}/a/store.db")
    try:
        assert isinstance(lite, SqliteStore)
        version = lite.migrate()
    finally:
        lite.close()
    pg = open_store(pg_dsn)
    try:
        assert isinstance(pg, PostgresStore)
        assert pg.migrate() == version
    finally:
        pg.close()


# -- SQLite files --------------------------------------------------------------


def test_sqlite_file_and_directory_are_private(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "store.db"
    store = SqliteStore(str(path))
    try:
        store.migrate()
        store.record_attestation(agent())
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        for name in ("store.db", "store.db-wal", "store.db-shm", "store.db.locks"):
            assert stat.S_IMODE((path.parent / name).stat().st_mode) == 0o600, name
    finally:
        store.close()


def test_sqlite_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    with pytest.raises(ConfigError, match="not a directory"):
        SqliteStore(str(tmp_path / "plain" / "store.db"))


def test_sqlite_path_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "store.db").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        SqliteStore(str(tmp_path / "store.db"))


def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    path.write_bytes(b"this is a text file, long enough to have a header " * 40)
    with pytest.raises(StoreError, match="not an SQLite database"):
        SqliteStore(str(path))


def test_sqlite_database_corrupted_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = SqliteStore(str(path))
    store.migrate()
    for n in range(200):
        store.record_attestation(agent(f"spiffe://example.org/spire/agent/tpm/{n:04x}"))
    store.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[page : len(data)] = b"\xa5" * (len(data) - page)  # every page after the first
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupt"):
        broken = SqliteStore(str(path))
        try:
            broken.list_agents()
        finally:
            broken.close()


@pytest.mark.subprocess
def test_sqlite_directory_not_writable(tmp_path: Path) -> None:
    """As an unprivileged user (root writes anywhere): a ConfigError that names the directory."""
    locked = Path(tempfile.mkdtemp(prefix="nodetrust-ro-"))
    try:
        locked.chmod(0o755 if os.geteuid() == 0 else 0o555)
        code = (
            "from server.store import open_store\n"
            "from server.errors import ServerError\n"
            f"try:\n    open_store({str(locked / 'sub' / 'store.db')!r})\n"
            "except ServerError as exc:\n    print(type(exc).__name__, exc)\n"
        )
        user = "nobody" if os.geteuid() == 0 else None
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd="/",
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            user=user,
            capture_output=True,
            text=True,
            timeout=HANG,
            check=False,
        )
        assert result.stdout.startswith("ConfigError cannot create the SQLite store directory"), result
        assert "Permission denied" in result.stdout
    finally:
        locked.chmod(0o700)
        os.rmdir(locked)


# -- PostgreSQL going away -------------------------------------------------------


@pytest.fixture
def private_postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL of this test's own, to stop and start at will."""
    cluster = make_cluster("nodetrust-store-pgdown")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.mark.postgres
@pytest.mark.subprocess
def test_postgres_that_goes_away_is_a_store_error_then_recovers(private_postgres: PostgresCluster) -> None:
    cluster = private_postgres
    dsn = cluster.dsn(cluster.create_database())
    store = PostgresStore(dsn, pool_size=3, connect_timeout=2, pool_timeout=5)
    try:
        store.migrate()
        store.record_attestation(agent())
        port = cluster.port

        cluster.stop("immediate")  # as if it crashed: connections cut, nothing listening
        for call in (
            lambda: store.get_agent(agent().spiffe_id),
            lambda: store.record_attestation(agent()),
            lambda: store.replace_token(token(agent().spiffe_id)),
            lambda: store.node_lock(agent().spiffe_id).__enter__(),
        ):
            with pytest.raises(StoreError, match="PostgreSQL") as failed:
                within_bound(call)
            assert "unavailable" in str(failed.value) or "cannot connect" in str(failed.value)

        cluster.start(port)  # back: the same store object works again, no restart needed
        assert within_bound(lambda: store.get_agent(agent().spiffe_id)) == agent()
        with store.node_lock(agent().spiffe_id):
            assert store.replace_token(token(agent().spiffe_id)) is None
    finally:
        store.close()


@pytest.mark.postgres
def test_postgres_that_never_answers_times_out() -> None:
    """A listener that completes TCP handshakes but never speaks: the connect timeout ends the wait."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        dsn = f"postgresql://nodeserver:hunter2@127.0.0.1:{port}/nodes"
        with pytest.raises(StoreError, match=r"cannot connect to PostgreSQL at 127\.0\.0\.1") as failed:
            within_bound(lambda: PostgresStore(dsn, connect_timeout=2))
        assert "hunter2" not in str(failed.value)


@pytest.mark.postgres
def test_postgres_nothing_listening() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(StoreError, match="cannot connect"):
        within_bound(lambda: open_store(f"postgresql://nodeserver@127.0.0.1:{port}/nodes"))
