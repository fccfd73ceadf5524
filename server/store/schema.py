"""The schema both stores share: numbered migrations and the row <-> record mapping.

Migrations live in ``server/store/migrations`` (see its ``__init__`` for the
file naming rules). Each backend applies them inside one transaction under its
own exclusive lock and records every applied step in ``schema_version``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from server.errors import StoreError
from server.store.base import AgentRecord, JoinRecord, TokenRecord

Dialect = Literal["sqlite", "postgresql"]
DIALECTS: tuple[Dialect, ...] = ("sqlite", "postgresql")

_FILE = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)(?:\.(?P<dialect>sqlite|postgresql))?\.sql$")

SCHEMA_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    " version INTEGER NOT NULL PRIMARY KEY,"
    " name TEXT NOT NULL,"
    " applied_at BIGINT NOT NULL)"
)

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


def split_statements(sql: str) -> tuple[str, ...]:
    """Split a migration file into statements: drop ``--`` comments, split on ``;``."""
    lines = [line.split("--", 1)[0].rstrip() for line in sql.splitlines()]
    text = "\n".join(line for line in lines if line.strip())
    return tuple(part.strip() for part in text.split(";") if part.strip())


def load_migrations(dialect: Dialect) -> tuple[Migration, ...]:
    """The migrations for ``dialect``, in order; raises StoreError if the set is malformed."""
    files: dict[int, dict[str, tuple[str, str]]] = {}
    for entry in resources.files("server.store.migrations").iterdir():
        match = _FILE.fullmatch(entry.name)
        if match is None:
            continue
        version = int(match["version"])
        which = match["dialect"] or "common"
        files.setdefault(version, {})[which] = (match["name"], entry.read_text(encoding="utf-8"))
    migrations = []
    for position, version in enumerate(sorted(files), start=1):
        if version != position:
            raise StoreError(
                f"store migrations are not numbered 1..n: {version:04d} found at position {position}"
            )
        variants = files[version]
        if "common" in variants and len(variants) > 1:
            raise StoreError(f"store migration {version:04d} has both a common and a per-dialect file")
        if "common" not in variants and set(variants) != set(DIALECTS):
            raise StoreError(f"store migration {version:04d} needs one file per dialect")
        name, sql = variants.get("common") or variants[dialect]
        migrations.append(Migration(version, name, split_statements(sql)))
    return tuple(migrations)


# -- rows <-> records ----------------------------------------------------------


def agent_params(record: AgentRecord) -> tuple[Any, ...]:
    """Parameters in column order: spiffe_id ... banned (the order of the SELECTs in server.store.sql)."""
    return (
        record.spiffe_id,
        record.attestation_type,
        record.ek_hash,
        record.first_attested_at,
        record.last_attested_at,
        record.svid_serial,
        record.svid_expires_at,
        json.dumps(list(record.selectors)),
        bool(record.can_reattest),
        bool(record.banned),
        record.ak_public,
        record.ak_qualified_name,
    )


def agent_from_row(row: Sequence[Any]) -> AgentRecord:
    selectors = json.loads(row[7])
    if not isinstance(selectors, list) or not all(isinstance(s, str) for s in selectors):
        raise StoreError(f"agent {row[0]!r} has malformed selectors in the store")
    return AgentRecord(
        spiffe_id=row[0],
        attestation_type=row[1],
        ek_hash=row[2],
        first_attested_at=int(row[3]),
        last_attested_at=int(row[4]),
        svid_serial=row[5],
        svid_expires_at=int(row[6]),
        selectors=tuple(selectors),
        can_reattest=bool(row[8]),
        banned=bool(row[9]),
        ak_public=row[10],
        ak_qualified_name=row[11],
    )


def check_token(record: TokenRecord) -> None:
    """Refuse anything that does not look like a SHA-256, so a secret can never be stored by mistake."""
    if not _HEX64.fullmatch(record.secret_sha256):
        raise ValueError("TokenRecord.secret_sha256 must be the lowercase hex SHA-256 of the secret")
    if not record.agent_id or not record.token_id:
        raise ValueError("TokenRecord needs an agent_id and a token_id")


def token_params(record: TokenRecord) -> tuple[Any, ...]:
    return (
        record.agent_id,
        record.token_id,
        record.secret_sha256,
        record.pool,
        record.node_name,
        record.issued_at,
        record.expires_at,
        record.backend_ref,
    )


def token_from_row(row: Sequence[Any]) -> TokenRecord:
    return TokenRecord(
        agent_id=row[0],
        token_id=row[1],
        secret_sha256=row[2],
        pool=row[3],
        node_name=row[4],
        issued_at=int(row[5]),
        expires_at=int(row[6]),
        backend_ref=row[7],
    )


def join_params(record: JoinRecord) -> tuple[Any, ...]:
    return (
        record.agent_id,
        record.node_name,
        record.pool,
        record.token_id,
        record.verdict,
        record.at,
        json.dumps(dict(record.details), sort_keys=True),
    )


def join_from_row(row: Sequence[Any]) -> JoinRecord:
    details = json.loads(row[6])
    if not isinstance(details, dict):
        raise StoreError(f"join record for {row[0]!r} has malformed details in the store")
    return JoinRecord(
        agent_id=row[0],
        node_name=row[1],
        pool=row[2],
        token_id=row[3],
        verdict=row[4],
        at=int(row[5]),
        details={str(k): str(v) for k, v in details.items()},
    )
