"""The server's store: SQLite (default) or PostgreSQL, one schema, one interface.

``open_store(dsn)`` picks the backend from the DSN:

* ``sqlite:///abs/path/to/store.db`` (``sqlite:////abs/...`` too) or a bare file path: SqliteStore;
* ``postgresql://...`` or ``postgres://...`` (libpq URL): PostgresStore.

It opens the database (creating an SQLite file) but does not migrate: the caller
runs ``store.migrate()`` at start. Backends are imported lazily so a server on
SQLite never loads psycopg.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import unquote, urlsplit

from server.errors import ConfigError
from server.store.base import AgentRecord, Enrolment, JoinRecord, NameBinding, Store, TokenRecord

log = logging.getLogger(__name__)

__all__ = [
    "AgentRecord",
    "Enrolment",
    "JoinRecord",
    "NameBinding",
    "Store",
    "TokenRecord",
    "open_store",
    "sqlite_path",
]

_HELP = "use sqlite:///absolute/path.db, a file path, or postgresql://user@host:port/dbname"


def sqlite_path(dsn: str) -> str | None:
    """The absolute file path an SQLite DSN names; None if ``dsn`` is not an SQLite DSN."""
    if "://" not in dsn:
        if ":" in dsn.split("/", 1)[0] or not dsn.strip():
            return None  # "scheme:..." without slashes, or empty: not a path
        if dsn == ":memory:" or ("=" in dsn and " " in dsn):
            return None  # in-memory, or a libpq "key=value ..." string
        return os.path.abspath(dsn)
    parts = urlsplit(dsn)
    if parts.scheme != "sqlite":
        return None
    if parts.netloc:
        raise ConfigError(
            f"SQLite DSN names a host ({parts.netloc!r}); write three slashes and an absolute path: "
            "sqlite:///var/lib/nodeserver/store.db"
        )
    if parts.query or parts.fragment:
        raise ConfigError("SQLite DSN takes no query parameters or fragment")
    path = unquote(parts.path)
    if not path.startswith("/") or path.endswith("/"):
        raise ConfigError(f"SQLite DSN needs an absolute file path, got {path!r}")
    # sqlite:///abs/path (URL style) and sqlite:////abs/path (SQLAlchemy style) name the same file.
    return os.path.normpath("/" + path.lstrip("/"))


def open_store(dsn: str) -> Store:
    """Open the store ``dsn`` names; ConfigError for a DSN this server cannot use."""
    if not isinstance(dsn, str) or not dsn.strip():
        raise ConfigError(f"empty store DSN; {_HELP}")
    dsn = dsn.strip()
    path = sqlite_path(dsn)
    if path is not None:
        from server.store.sqlite import SqliteStore

        log.info("opening the SQLite store %s", path)
        return SqliteStore(path)
    scheme = dsn.split("://", 1)[0] if "://" in dsn else dsn.split(":", 1)[0]
    if scheme in ("postgresql", "postgres"):
        from server.store.postgres import PostgresStore

        store = PostgresStore(dsn)
        log.info("opened the PostgreSQL store at %s", store.where)
        return store
    if dsn == ":memory:":
        raise ConfigError(f"an in-memory SQLite store would lose everything at exit; {_HELP}")
    if "=" in dsn and "://" not in dsn:
        raise ConfigError(f"store DSN looks like a libpq key=value string; {_HELP}")
    # Name only the scheme: the rest of a DSN may carry a password.
    raise ConfigError(f"unsupported store DSN scheme {scheme!r}; {_HELP}")
