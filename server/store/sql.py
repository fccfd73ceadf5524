"""The Store methods, written once in the SQL both databases understand.

A backend supplies transactions (``_read``/``_write``), the placeholder style,
row locking and ``node_lock``; everything that decides what is stored lives
here so the two backends cannot drift apart. Queries are written with ``%s``
placeholders and always take their values as parameters.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from server.errors import NotFoundError, StoreError
from server.store import schema
from server.store.base import AgentRecord, Enrolment, JoinRecord, NameBinding, TokenRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

Row = tuple[Any, ...]


class Tx(ABC):
    """One open transaction (or one autocommitted statement) of a backend."""

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> None: ...

    @abstractmethod
    def fetchone(self) -> Row | None: ...

    @abstractmethod
    def fetchall(self) -> list[Row]: ...

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        self.execute(sql, params)
        return self.fetchone()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        self.execute(sql, params)
        return self.fetchall()


# Every statement is a literal with %s placeholders; values always travel as parameters.
# Column order of the agent, token and join SELECTs matches schema.*_from_row.

_AGENT_SELECT = (
    "SELECT spiffe_id, attestation_type, ek_hash, first_attested_at, last_attested_at,"
    " svid_serial, svid_expires_at, selectors, can_reattest, banned, ak_public, ak_qualified_name"
    " FROM agents"
)
_BOOTSTRAP_SELECT = (
    "SELECT agent_id, token_id, secret_sha256, pool, node_name, issued_at, expires_at, backend_ref"
    " FROM tokens"
)
_JOIN_SELECT = "SELECT agent_id, node_name, pool, token_id, verdict, at, details FROM joins"

_UPSERT_AGENT = """
INSERT INTO agents (spiffe_id, attestation_type, ek_hash, first_attested_at, last_attested_at,
                    svid_serial, svid_expires_at, selectors, can_reattest, banned, ak_public,
                    ak_qualified_name, placeholder)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, FALSE)
ON CONFLICT (spiffe_id) DO UPDATE SET
    attestation_type = excluded.attestation_type,
    ek_hash = excluded.ek_hash,
    first_attested_at = CASE WHEN agents.placeholder
                             THEN excluded.first_attested_at ELSE agents.first_attested_at END,
    last_attested_at = excluded.last_attested_at,
    svid_serial = excluded.svid_serial,
    svid_expires_at = excluded.svid_expires_at,
    selectors = excluded.selectors,
    can_reattest = excluded.can_reattest,
    banned = (agents.banned OR excluded.banned),
    ak_public = excluded.ak_public,
    ak_qualified_name = excluded.ak_qualified_name,
    placeholder = FALSE
RETURNING spiffe_id, attestation_type, ek_hash, first_attested_at, last_attested_at,
          svid_serial, svid_expires_at, selectors, can_reattest, banned, ak_public, ak_qualified_name
"""

# A banned agent that never attested: every required field set, marked as a placeholder.
_BAN_AGENT = """
INSERT INTO agents (spiffe_id, attestation_type, ek_hash, first_attested_at, last_attested_at,
                    svid_serial, svid_expires_at, selectors, can_reattest, banned, placeholder)
VALUES (%s, '', '', 0, 0, '', 0, '[]', FALSE, TRUE, TRUE)
ON CONFLICT (spiffe_id) DO UPDATE SET banned = TRUE WHERE NOT agents.banned
RETURNING spiffe_id
"""
_UNBAN_PLACEHOLDER = "DELETE FROM agents WHERE spiffe_id = %s AND placeholder RETURNING spiffe_id"
_UNBAN_AGENT = "UPDATE agents SET banned = FALSE WHERE spiffe_id = %s AND banned RETURNING spiffe_id"
_DELETE_AGENT = "DELETE FROM agents WHERE spiffe_id = %s RETURNING spiffe_id"

_LIVE_BOOTSTRAP = _BOOTSTRAP_SELECT + " WHERE agent_id = %s AND NOT revoked AND expires_at > %s"
_ID_TAKEN = "SELECT agent_id FROM tokens WHERE token_id = %s"
_REVOKE_LIVE = """
UPDATE tokens SET revoked = TRUE WHERE agent_id = %s AND NOT revoked
RETURNING agent_id, token_id, secret_sha256, pool, node_name, issued_at, expires_at, backend_ref
"""
_INSERT_BOOTSTRAP = """
INSERT INTO tokens (agent_id, token_id, secret_sha256, pool, node_name, issued_at, expires_at,
                    backend_ref, revoked)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, FALSE)
"""
_REVOKE_ALL = "UPDATE tokens SET revoked = TRUE WHERE agent_id = %s AND NOT revoked"
_REVOKE_ONE = (
    "UPDATE tokens SET revoked = TRUE"
    " WHERE agent_id = %s AND token_id = %s AND NOT revoked RETURNING token_id"
)
_EXPIRED_BOOTSTRAP = _BOOTSTRAP_SELECT + " WHERE expires_at <= %s ORDER BY expires_at, token_id"
_STALE_BOOTSTRAP = (
    _BOOTSTRAP_SELECT + " WHERE revoked OR expires_at <= %s ORDER BY expires_at, token_id LIMIT 1000"
)
_FORGET_ONE = "DELETE FROM tokens WHERE agent_id = %s AND token_id = %s"

_CONSUME_REQUEST = """
INSERT INTO join_requests (agent_id, request_id, expires_at) VALUES (%s, %s, %s)
ON CONFLICT (agent_id, request_id) DO NOTHING RETURNING request_id
"""
_PRUNE_REQUESTS = """
DELETE FROM join_requests WHERE expires_at < %s AND NOT (agent_id = %s AND request_id = %s)
"""
_INSERT_JOIN = """
INSERT INTO joins (agent_id, node_name, pool, token_id, verdict, at, details)
VALUES (%s, %s, %s, %s, %s, %s, %s)
"""
_JOINS_FOR = _JOIN_SELECT + " WHERE agent_id = %s ORDER BY at, id"
_COUNT_JOINS_SINCE = "SELECT COUNT(*) FROM joins WHERE agent_id = %s AND at >= %s"
_PRUNE_JOINS = "DELETE FROM joins WHERE at < %s"

_ISSUE_NONCE = "INSERT INTO join_nonces (agent_id, nonce_sha256, pool, expires_at) VALUES (%s, %s, %s, %s)"
_PRUNE_NONCES = "DELETE FROM join_nonces WHERE expires_at < %s"
_CONSUME_NONCE = (
    "DELETE FROM join_nonces WHERE agent_id = %s AND nonce_sha256 = %s AND expires_at >= %s RETURNING pool"
)
_BIND_NAME = """
INSERT INTO node_names (node_name, agent_id, ek_hash, bound_at) VALUES (%s, %s, %s, %s)
ON CONFLICT (node_name) DO NOTHING
"""
_NAME_SELECT = "SELECT node_name, agent_id, ek_hash, bound_at FROM node_names"
_RELEASE_NAME = "DELETE FROM node_names WHERE node_name = %s RETURNING node_name"
_ENROL = """
INSERT INTO enrolments (ek_hash, node_name, pool, serial, disk_hints, enrolled_at) VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (ek_hash) DO UPDATE SET node_name = excluded.node_name, pool = excluded.pool,
    serial = excluded.serial, disk_hints = excluded.disk_hints, enrolled_at = excluded.enrolled_at
"""
_ENROLMENT_SELECT = "SELECT ek_hash, node_name, pool, serial, disk_hints, enrolled_at FROM enrolments"
_UNENROL = "DELETE FROM enrolments WHERE ek_hash = %s RETURNING ek_hash"

_MIGRATION_SELECT = "SELECT COALESCE(MAX(version), 0) FROM schema_version"
_MIGRATION_RECORD = "INSERT INTO schema_version (version, name, applied_at) VALUES (%s, %s, %s)"


class SqlStore(ABC):
    """Everything but the connection handling; see SqliteStore and PostgresStore."""

    dialect: schema.Dialect
    # Select the agent row and lock it for the rest of the transaction, where the database can.
    lock_agent_sql = "SELECT spiffe_id FROM agents WHERE spiffe_id = %s"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._migrations = schema.load_migrations(self.dialect)

    # -- what a backend provides ---------------------------------------------
    @abstractmethod
    def _read(self, work: Callable[[Tx], T]) -> T:
        """Run ``work`` as one read-only statement or transaction."""

    @abstractmethod
    def _write(self, work: Callable[[Tx], T], *, single: bool = False) -> T:
        """Run ``work`` in one write transaction; it may be run again after a serialization failure.

        ``single``: ``work`` runs exactly one statement, which the backend may autocommit.
        """

    @abstractmethod
    def migrate(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def node_lock(self, agent_id: str) -> AbstractContextManager[None]:
        """Exclusive per node; enter, use and leave it on one thread (it is re-entrant there)."""

    # -- migrations ----------------------------------------------------------
    def _apply_migrations(self, tx: Tx) -> int:
        """Bring the schema up to date inside the caller's exclusive transaction."""
        tx.execute(schema.SCHEMA_VERSION_TABLE)
        row = tx.one(_MIGRATION_SELECT)
        current = int(row[0]) if row else 0
        latest = self._migrations[-1].version if self._migrations else 0
        if current > latest:
            raise StoreError(
                f"the database schema is at version {current} but this nodeserver knows only "
                f"up to {latest}; upgrade nodeserver before pointing it at this database"
            )
        for migration in self._migrations[current:]:
            log.info("applying store migration %04d_%s", migration.version, migration.name)
            for statement in migration.statements:
                tx.execute(statement)
            tx.execute(_MIGRATION_RECORD, (migration.version, migration.name, int(self._clock())))
        return max(current, latest)

    def schema_version(self) -> int:
        """The version recorded in the database (0 before the first migration)."""

        def work(tx: Tx) -> int:
            row = tx.one(_MIGRATION_SELECT)
            return int(row[0]) if row else 0

        return self._read(work)

    # -- agents --------------------------------------------------------------
    def record_attestation(self, record: AgentRecord) -> AgentRecord:
        if not record.spiffe_id:
            raise ValueError("AgentRecord needs a spiffe_id")

        def work(tx: Tx) -> AgentRecord:
            row = tx.one(_UPSERT_AGENT, schema.agent_params(record))
            if row is None:
                raise StoreError(f"recording the attestation of {record.spiffe_id} returned no row")
            return schema.agent_from_row(row)

        return self._write(work, single=True)

    def record_attestations(
        self, batch: Sequence[tuple[AgentRecord, Sequence[str]]]
    ) -> list[AgentRecord | None]:
        for record, _ in batch:
            if not record.spiffe_id:
                raise ValueError("AgentRecord needs a spiffe_id")

        def work(tx: Tx) -> list[AgentRecord | None]:
            out: list[AgentRecord | None] = []
            for record, others in batch:
                ids = (record.spiffe_id, *others)
                marks = ", ".join(["%s"] * len(ids))
                if tx.one(f"SELECT 1 FROM agents WHERE banned AND spiffe_id IN ({marks})", ids) is not None:  # noqa: S608 - placeholders only
                    out.append(None)
                    continue
                row = tx.one(_UPSERT_AGENT, schema.agent_params(record))
                if row is None:
                    raise StoreError(f"recording the attestation of {record.spiffe_id} returned no row")
                out.append(schema.agent_from_row(row))
            return out

        return self._write(work)

    def get_agent(self, spiffe_id: str) -> AgentRecord | None:
        row = self._read(lambda tx: tx.one(_AGENT_SELECT + " WHERE spiffe_id = %s", (spiffe_id,)))
        return schema.agent_from_row(row) if row else None

    def list_agents(self) -> list[AgentRecord]:
        rows = self._read(lambda tx: tx.all(_AGENT_SELECT + " ORDER BY spiffe_id"))
        return [schema.agent_from_row(row) for row in rows]

    def count_agents(self) -> int:
        row = self._read(lambda tx: tx.one("SELECT COUNT(*) FROM agents"))
        return int(row[0]) if row else 0

    def ban_agent(self, spiffe_id: str) -> bool:
        """Ban, and revoke the agent's live token in the same step (the sweeper deletes it from the backend)."""
        if not spiffe_id:
            raise ValueError("ban_agent needs a spiffe_id")

        def work(tx: Tx) -> bool:
            changed = tx.one(_BAN_AGENT, (spiffe_id,)) is not None
            tx.execute(_REVOKE_ALL, (spiffe_id,))
            return changed

        return self._write(work)

    def unban_agent(self, spiffe_id: str) -> bool:
        def work(tx: Tx) -> bool:
            # A placeholder exists only to carry the ban: lifting the ban removes it.
            if tx.one(_UNBAN_PLACEHOLDER, (spiffe_id,)) is not None:
                return True
            return tx.one(_UNBAN_AGENT, (spiffe_id,)) is not None

        return self._write(work)

    def delete_agent(self, spiffe_id: str) -> bool:
        return self._write(lambda tx: tx.one(_DELETE_AGENT, (spiffe_id,)) is not None, single=True)

    def is_banned(self, spiffe_id: str) -> bool:
        row = self._read(lambda tx: tx.one("SELECT banned FROM agents WHERE spiffe_id = %s", (spiffe_id,)))
        return bool(row[0]) if row else False

    # -- tokens --------------------------------------------------------------
    def live_token(self, agent_id: str, now: int) -> TokenRecord | None:
        row = self._read(lambda tx: tx.one(_LIVE_BOOTSTRAP, (agent_id, now)))
        return schema.token_from_row(row) if row else None

    def replace_token(self, new: TokenRecord) -> TokenRecord | None:
        schema.check_token(new)

        def work(tx: Tx) -> TokenRecord | None:
            # Lock the agent row: replace_token calls for one agent queue here, even without node_lock.
            if tx.one(self.lock_agent_sql, (new.agent_id,)) is None:
                raise NotFoundError(f"no agent {new.agent_id} in the store; it must attest first")
            if tx.one(_ID_TAKEN, (new.token_id,)) is not None:
                message = f"bootstrap token id {new.token_id} is already recorded"
                raise StoreError(message, reason="token_id_taken")
            previous = tx.one(_REVOKE_LIVE, (new.agent_id,))
            tx.execute(_INSERT_BOOTSTRAP, schema.token_params(new))
            return schema.token_from_row(previous) if previous else None

        return self._write(work)

    def revoke_token(self, agent_id: str, token_id: str) -> bool:
        return self._write(lambda tx: tx.one(_REVOKE_ONE, (agent_id, token_id)) is not None, single=True)

    def expired_tokens(self, now: int) -> Iterator[TokenRecord]:
        rows = self._read(lambda tx: tx.all(_EXPIRED_BOOTSTRAP, (now,)))
        return iter([schema.token_from_row(row) for row in rows])

    def stale_tokens(self, now: int) -> Iterator[TokenRecord]:
        rows = self._read(lambda tx: tx.all(_STALE_BOOTSTRAP, (now,)))
        return iter([schema.token_from_row(row) for row in rows])

    def forget_token(self, agent_id: str, token_id: str) -> None:
        self._write(lambda tx: tx.execute(_FORGET_ONE, (agent_id, token_id)), single=True)

    # -- join requests and history --------------------------------------------
    def consume_request_id(self, agent_id: str, request_id: str, expires_at: int) -> bool:
        """Remember a join request id; False if it is still remembered (a replay).

        Ids past their ``expires_at`` (by this store's clock) are pruned on the way;
        the id being checked is never pruned by its own call, so a replay is
        refused for as long as its row exists.
        """
        now = int(self._clock())

        def work(tx: Tx) -> bool:
            fresh = tx.one(_CONSUME_REQUEST, (agent_id, request_id, expires_at))
            tx.execute(_PRUNE_REQUESTS, (now, agent_id, request_id))
            return fresh is not None

        return self._write(work)

    def record_join(self, record: JoinRecord) -> None:
        self._write(lambda tx: tx.execute(_INSERT_JOIN, schema.join_params(record)), single=True)

    def joins_for(self, agent_id: str) -> list[JoinRecord]:
        return [schema.join_from_row(row) for row in self._read(lambda tx: tx.all(_JOINS_FOR, (agent_id,)))]

    def count_joins_since(self, agent_id: str, since: int) -> int:
        row = self._read(lambda tx: tx.one(_COUNT_JOINS_SINCE, (agent_id, since)))
        return int(row[0]) if row else 0

    def prune_joins(self, before: int) -> int:
        def work(tx: Tx) -> int:
            row = tx.one("SELECT COUNT(*) FROM joins WHERE at < %s", (before,))
            tx.execute(_PRUNE_JOINS, (before,))
            return int(row[0]) if row else 0

        return self._write(work)

    # -- measured boot and identity -------------------------------------------------
    def issue_nonce(self, agent_id: str, nonce_sha256: str, pool: str, expires_at: int) -> None:
        now = int(self._clock())

        def work(tx: Tx) -> None:
            tx.execute(_PRUNE_NONCES, (now,))
            tx.execute(_ISSUE_NONCE, (agent_id, nonce_sha256, pool, expires_at))

        self._write(work)

    def consume_nonce(self, agent_id: str, nonce_sha256: str, now: int) -> str | None:
        row = self._write(lambda tx: tx.one(_CONSUME_NONCE, (agent_id, nonce_sha256, now)), single=True)
        return str(row[0]) if row else None

    def bind_node_name(self, node_name: str, agent_id: str, ek_hash: str, now: int) -> NameBinding:
        def work(tx: Tx) -> NameBinding:
            tx.execute(_BIND_NAME, (node_name, agent_id, ek_hash, now))
            row = tx.one(_NAME_SELECT + " WHERE node_name = %s", (node_name,))
            if row is None:  # pragma: no cover - the insert or an existing row is there
                raise StoreError(f"binding node name {node_name} returned no row")
            return NameBinding(row[0], row[1], row[2], int(row[3]))

        return self._write(work)

    def node_name_binding(self, node_name: str) -> NameBinding | None:
        row = self._read(lambda tx: tx.one(_NAME_SELECT + " WHERE node_name = %s", (node_name,)))
        return NameBinding(row[0], row[1], row[2], int(row[3])) if row else None

    def release_node_name(self, node_name: str) -> bool:
        return self._write(lambda tx: tx.one(_RELEASE_NAME, (node_name,)) is not None, single=True)

    def node_names(self) -> list[NameBinding]:
        rows = self._read(lambda tx: tx.all(_NAME_SELECT + " ORDER BY node_name"))
        return [NameBinding(r[0], r[1], r[2], int(r[3])) for r in rows]

    def enrol(self, enrolment: Enrolment) -> None:
        self.enrol_all([enrolment])

    def enrol_all(self, enrolments: list[Enrolment]) -> None:
        """Enrol every machine in one transaction: all of them, or none."""

        def work(tx: Tx) -> None:
            for e in enrolments:
                params = (e.ek_hash, e.node_name, e.pool, e.serial, json.dumps(dict(e.disk_hints), sort_keys=True),
                          e.enrolled_at)  # fmt: skip
                tx.execute(_ENROL, params)

        self._write(work)

    def unenrol(self, ek_hash: str) -> bool:
        return self._write(lambda tx: tx.one(_UNENROL, (ek_hash,)) is not None, single=True)

    def enrolment(self, ek_hash: str) -> Enrolment | None:
        row = self._read(lambda tx: tx.one(_ENROLMENT_SELECT + " WHERE ek_hash = %s", (ek_hash,)))
        return _enrolment(row) if row else None

    def enrolments(self) -> list[Enrolment]:
        return [
            _enrolment(r) for r in self._read(lambda tx: tx.all(_ENROLMENT_SELECT + " ORDER BY node_name"))
        ]


def _enrolment(row: Row) -> Enrolment:
    hints = json.loads(row[4])
    if not isinstance(hints, dict):
        raise StoreError(f"enrolment {row[0]!r} has malformed disk hints in the store")
    return Enrolment(row[0], row[1], row[2], row[3], {str(k): str(v) for k, v in hints.items()}, int(row[5]))
