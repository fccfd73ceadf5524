"""The store's interface: what the servicers need, independent of the database.

Two implementations: SQLite (one file, WAL; the default for a single server)
and PostgreSQL (several server replicas behind one address). They share one
schema with numbered migrations and pass the same tests.

Rules every implementation keeps:

* each method is one transaction: it commits fully or not at all;
* nothing secret is stored: bootstrap tokens are kept as their id and a
  SHA-256 of the secret, never the secret;
* ``node_lock`` serialises work on one node across threads and, for
  PostgreSQL, across server processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class AgentRecord:
    spiffe_id: str
    attestation_type: str
    ek_hash: str
    first_attested_at: int  # Unix seconds
    last_attested_at: int
    svid_serial: str  # decimal string, as SPIRE's x509svid_serial_number
    svid_expires_at: int
    selectors: tuple[str, ...] = ()  # "type:value"
    can_reattest: bool = True
    banned: bool = False
    ak_public: str = ""  # hex TPMT_PUBLIC of the AK activated at the last attestation
    ak_qualified_name: str = ""  # hex; the qualifiedSigner a TPM puts in that AK's quotes


@dataclass(frozen=True)
class Enrolment:
    """A machine the operator expects: its EK hash, the name and pool it must join as."""

    ek_hash: str
    node_name: str
    pool: str
    serial: str = ""
    disk_hints: dict[str, str] = field(default_factory=dict)
    enrolled_at: int = 0


@dataclass(frozen=True)
class NameBinding:
    node_name: str
    agent_id: str
    ek_hash: str
    bound_at: int


@dataclass(frozen=True)
class TokenRecord:
    """A bootstrap token as the store knows it: never the secret itself."""

    agent_id: str
    token_id: str  # the public 6-character id
    secret_sha256: str  # hex SHA-256 of the 16-character secret
    pool: str
    node_name: str
    issued_at: int
    expires_at: int
    backend_ref: str = ""  # where the backend put it (Secret name, file path)


@dataclass(frozen=True)
class JoinRecord:
    agent_id: str
    node_name: str
    pool: str
    token_id: str
    verdict: str
    at: int
    details: dict[str, str] = field(default_factory=dict)


class Store(Protocol):
    """What the server needs from its database."""

    def migrate(self) -> int:
        """Apply pending migrations; return the schema version. Idempotent and safe to run concurrently."""
        ...

    def close(self) -> None: ...

    # -- agents ------------------------------------------------------------
    def record_attestation(self, record: AgentRecord) -> AgentRecord:
        """Insert or update the agent after a successful attestation.

        ``first_attested_at`` is kept from an existing row; ``banned`` is never
        cleared by this call. Returns the stored row.
        """
        ...

    def record_attestations(
        self, batch: Sequence[tuple[AgentRecord, Sequence[str]]]
    ) -> list[AgentRecord | None]:
        """Record many attestations in one transaction (one fsync): for each ``(record, others)``,
        None when the record's agent or any of ``others`` is banned (nothing written for it), else
        the stored row, as :meth:`record_attestation` returns it. All or nothing: an error raises."""
        ...

    def get_agent(self, spiffe_id: str) -> AgentRecord | None: ...

    def list_agents(self) -> list[AgentRecord]: ...

    def count_agents(self) -> int: ...

    def ban_agent(self, spiffe_id: str) -> bool:
        """Mark the agent banned (creating a banned placeholder row if unknown). True if it changed."""
        ...

    def unban_agent(self, spiffe_id: str) -> bool: ...

    def delete_agent(self, spiffe_id: str) -> bool: ...

    def is_banned(self, spiffe_id: str) -> bool: ...

    # -- join ----------------------------------------------------------------
    def node_lock(self, agent_id: str) -> AbstractContextManager[None]:
        """Hold an exclusive lock for ``agent_id`` (across processes for PostgreSQL)."""
        ...

    def live_token(self, agent_id: str, now: int) -> TokenRecord | None:
        """The agent's unexpired, unrevoked token, if any."""
        ...

    def replace_token(self, new: TokenRecord) -> TokenRecord | None:
        """Make ``new`` the agent's one live token, atomically; return the one it replaced (if any)."""
        ...

    def revoke_token(self, agent_id: str, token_id: str) -> bool: ...

    def expired_tokens(self, now: int) -> Iterator[TokenRecord]:
        """Tokens past their expiry that are still recorded (for the backend clean-up)."""
        ...

    def stale_tokens(self, now: int) -> Iterator[TokenRecord]:
        """Tokens revoked or past their expiry that are still recorded: the backend still may hold them."""
        ...

    def forget_token(self, agent_id: str, token_id: str) -> None: ...

    def consume_request_id(self, agent_id: str, request_id: str, expires_at: int) -> bool:
        """Remember a join request id; False if it was already seen (a replay)."""
        ...

    def record_join(self, record: JoinRecord) -> None: ...

    def joins_for(self, agent_id: str) -> list[JoinRecord]: ...

    def count_joins_since(self, agent_id: str, since: int) -> int:
        """How many joins the agent was granted at or after ``since`` (the per-agent limit)."""
        ...

    def prune_joins(self, before: int) -> int:
        """Forget join records older than ``before``; return how many."""
        ...

    # -- measured boot and identity -------------------------------------------------
    def issue_nonce(self, agent_id: str, nonce_sha256: str, pool: str, expires_at: int) -> None:
        """Remember a quote nonce the server chose for ``agent_id`` (pruning expired ones)."""
        ...

    def consume_nonce(self, agent_id: str, nonce_sha256: str, now: int) -> str | None:
        """Forget the nonce and return its pool, or None if it is unknown, another agent's or expired."""
        ...

    def bind_node_name(self, node_name: str, agent_id: str, ek_hash: str, now: int) -> NameBinding:
        """Bind ``node_name`` to the agent unless it is bound already; return the binding in force."""
        ...

    def release_node_name(self, node_name: str) -> bool: ...

    def node_name_binding(self, node_name: str) -> NameBinding | None: ...

    def node_names(self) -> list[NameBinding]: ...

    def enrol(self, enrolment: Enrolment) -> None:
        """Add or replace the enrolment of ``enrolment.ek_hash`` (a node name is enrolled once)."""
        ...

    def enrol_all(self, enrolments: list[Enrolment]) -> None:
        """Enrol every machine in one transaction: all of them, or none."""
        ...

    def unenrol(self, ek_hash: str) -> bool: ...

    def enrolment(self, ek_hash: str) -> Enrolment | None: ...

    def enrolments(self) -> list[Enrolment]: ...
