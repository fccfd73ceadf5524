"""The server's configuration: one YAML file, validated at start with clear errors.

Every top-level key is a row of :data:`TABLE` (type, default, help, flag of ``nodeserver run``);
the sections have their own tables: ``ek_trust`` (server.ek.config), ``cluster``, ``join`` and
``pools`` (server.pools), pool profiles (protocol.policy). Unknown keys, wrong types and bad values
are refused with the key's dotted path and what is expected. Durations are Go syntax (``30s``,
``15m``, ``1h30m``; a whole number is seconds, and ``7d`` is accepted as an extension); sizes are
bytes or ``64KiB``, ``256MiB``. The reference is docs/settings.md, generated from the tables.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from protocol.errors import SpiffeIdError
from protocol.settings import (
    Ctx,
    Kind,
    Setting,
    SettingError,
    Table,
    address,
    choice,
    duration,
    integer,
    list_of,
    number,
    optional,
    path,
    size,
    text,
)
from protocol.spiffe import validate_trust_domain
from server.devid.settings import KIND as DEVID_KIND
from server.ek.config import TABLE as EK_TABLE
from server.ek.config import EkTrustConfig
from server.errors import ConfigError
from server.pools import SECTION_KINDS

MAX_CONFIG_BYTES = 4 * 1024 * 1024  # larger configuration files are refused before parsing
DOCS = "docs/settings.md"
_DURATION = duration()


def parse_duration(value: Any, key: str) -> dt.timedelta:
    """A positive Go-syntax duration (``30s``, ``1h30m``, whole seconds, ``7d``) at ``key``."""
    try:
        result: dt.timedelta = _DURATION.parse(value, Ctx(tuple(key.split("."))))
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    if result <= dt.timedelta(0):
        raise ConfigError(f"{key}: must be positive")
    return result


_ADDRESS = address()


def parse_address(value: Any, key: str) -> tuple[str, int]:
    try:
        result: tuple[str, int] = _ADDRESS.parse(value, Ctx((key,)))
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    return result


@dataclass(frozen=True)
class ServerConfig:
    trust_domain: str
    data_dir: Path
    listen: tuple[str, int] = ("0.0.0.0", 8081)  # noqa: S104
    join_listen: tuple[str, int] | None = None
    metrics_listen: tuple[str, int] | None = ("127.0.0.1", 9988)
    store: str = ""
    audit_log: Path | None = None
    agent_svid_ttl: dt.timedelta = dt.timedelta(hours=1)
    server_svid_ttl: dt.timedelta = dt.timedelta(hours=24)
    ca_ttl: dt.timedelta = dt.timedelta(days=5 * 365)
    challenge_timeout: dt.timedelta = dt.timedelta(seconds=30)
    max_payload_bytes: int = 64 * 1024
    # What one stranger can hold (docs/attestation.md, "Limits"): see server/limits.py.
    first_message_timeout: dt.timedelta = dt.timedelta(seconds=10)
    handshake_timeout: dt.timedelta = dt.timedelta(seconds=10)
    max_connections: int = 0  # 0: derived from the open-file limit at start
    max_streams_per_connection: int = 16
    transport: str = "wire"  # the attestation port's gRPC transport (server/wire) or "grpc" (grpc.aio)
    peer_max_inflight: int = 64
    attest_rate_per_ip: float = 20.0  # attestations per second per client address; 0: no limit
    attest_burst_per_ip: int = 100
    audit_max_bytes: int = 256 * 1024 * 1024  # the audit log rotates at this size
    audit_backups: int = 4  # rotated audit files kept
    min_free_bytes: int = 256 * 1024 * 1024  # refuse new work when data_dir has less free space
    server_dns_names: tuple[str, ...] = ()
    ek_trust: EkTrustConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # sections owned by other modules (join, pools)
    base_dir: Path | None = None  # the configuration file's folder: relative paths start there

    @property
    def store_dsn(self) -> str:
        return self.store or f"sqlite:///{self.data_dir / 'store.db'}"

    @property
    def audit_path(self) -> Path:
        return self.audit_log or self.data_dir / "audit.jsonl"


def _trust_domain_problem(value: str) -> str | None:
    try:
        validate_trust_domain(value)
    except SpiffeIdError as exc:
        return str(exc)
    return None


def _ek_trust(value: Any, ctx: Ctx) -> EkTrustConfig:
    if not isinstance(value, Mapping):
        raise ctx.type_error("a mapping (ca_dir, hash_dir, mode, ...); see docs/ek-trust.md", value)
    return EkTrustConfig.from_mapping(value, base_dir=ctx.base_dir, path=tuple(str(p) for p in ctx.path))


_EK_KIND = Kind("section", EK_TABLE.expected, "MAPPING", EK_TABLE.json_schema(), _ek_trust)
_D: dict[str, Any] = {f.name: f.default for f in fields(ServerConfig)}
_DNS_NAME = r"(?=.{1,253}$)[A-Za-z0-9*]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*"


def _row(name: str, kind: Kind, help_text: str, **extra: Any) -> Setting:
    """A setting whose default is ServerConfig's (one source for both)."""
    return Setting(name, kind, help_text, _D[name], **extra)


def _build_table() -> Table:
    return Table(
        "nodeserver",
        (
            Setting(
                "trust_domain",
                text("a trust domain like example.org", pattern=r"[a-z0-9._-]{1,255}", metavar="NAME"),
                "the trust domain (lowercase letters, digits, '.', '-', '_'), e.g. example.org",
                required=True,
                check=_trust_domain_problem,
            ),
            Setting(
                "data_dir",
                path(),
                "where the CA keys, the server SVID and the default store live (0700, keys 0600)",
                required=True,
            ),
            _row("listen", address(), "AttestAgent, Bundle.GetBundle and gRPC health, over TLS"),
            _row(
                "join_listen",
                optional(address()),
                "the Join API (mutual TLS with agent SVIDs only)",
                default_text="none: no join broker",
            ),
            _row(
                "metrics_listen",
                optional(address(), off=("", "off")),
                "Prometheus /metrics over plain HTTP; off to disable",
            ),
            _row(
                "store",
                text("a DSN: sqlite:///PATH or postgresql://...", metavar="DSN"),
                "the store (docs/store.md); a PostgreSQL DSN may hold a password",
                secret=True,
                default_text="sqlite:///<data_dir>/store.db",
            ),
            _row(
                "audit_log",
                optional(path()),
                "the audit log, one JSON line per attempt (0600)",
                default_text="<data_dir>/audit.jsonl",
            ),
            _row(
                "agent_svid_ttl",
                duration("1m"),
                "the agent SVID's lifetime; agents re-attest before it ends",
            ),
            _row(
                "server_svid_ttl",
                duration(positive=True),
                "the server's TLS SVID lifetime; renewed at half-life without a restart",
            ),
            _row("ca_ttl", duration(positive=True), "lifetime of the CA created at first start (5 years)"),
            _row(
                "challenge_timeout",
                duration(positive=True),
                "an agent that does not answer the challenge in time gets DEADLINE_EXCEEDED",
            ),
            _row(
                "max_payload_bytes",
                size(1024, 4 * 1024 * 1024),
                "larger attestation payloads get RESOURCE_EXHAUSTED",
            ),
            _row(
                "first_message_timeout",
                duration(positive=True),
                "a stream whose first message does not arrive within this is closed (DEADLINE_EXCEEDED)",
            ),
            _row(
                "handshake_timeout",
                duration(positive=True),
                "a connection's TLS handshake must finish within this",
            ),
            _row(
                "max_connections",
                integer(0, 1_000_000),
                "connections held at once (0: derived from the open-file limit at start)",
            ),
            _row(
                "max_streams_per_connection", integer(1, 1000), "concurrent streams one connection may open"
            ),
            _row(
                "transport",
                choice("wire", "grpc"),
                "the attestation port's gRPC transport: wire (nodeserver's own HTTP/2 on the event loop) "
                "or grpc (gRPC's C core through grpc.aio)",
            ),
            _row("peer_max_inflight", integer(1, 100_000), "requests one client address may have in flight"),
            _row(
                "attest_rate_per_ip",
                number(0, 100_000),
                "attestations per second per client address (0: no limit)",
            ),
            _row("attest_burst_per_ip", integer(1, 100_000), "attestations a client address may burst"),
            _row("audit_max_bytes", size(1024 * 1024, 1 << 40), "the audit log rotates at this size"),
            _row("audit_backups", integer(0, 1000), "rotated audit files kept"),
            _row(
                "min_free_bytes",
                size(0, 1 << 40),
                "refuse new work when data_dir has less free space than this",
            ),
            _row(
                "server_dns_names",
                list_of(text("a DNS name", pattern=_DNS_NAME), "a list of DNS names"),
                "DNS SANs for the server SVID (for stock gRPC clients)",
                flag=None,
            ),
            _row("ek_trust", _EK_KIND, "which TPMs to trust: docs/ek-trust.md", flag=None),
            Setting(
                "devid",
                DEVID_KIND,
                "the DevID CA, LDevID enrolment and tpm_devid trust: docs/attestation.md",
                flag=None,
                default_text="a DevID CA in data_dir; enrolment on",
            ),
            *(
                Setting(name, kind, about, flag=None, default_text="none")
                for name, kind, about in (
                    ("cluster", SECTION_KINDS["cluster"], "the workload cluster joins go to: docs/join.md"),
                    (
                        "join",
                        SECTION_KINDS["join"],
                        "bootstrap-token policy and per-agent limits: docs/join.md",
                    ),
                    (
                        "token_backend",
                        SECTION_KINDS["token_backend"],
                        "where bootstrap tokens go: docs/join-backends.md",
                    ),
                    ("pools", SECTION_KINDS["pools"], "node pools and their profiles: docs/join.md"),
                )
            ),
        ),
    )


TABLE = _build_table()
# Sections validated by the modules that own them (join broker, pools, token backend).
EXTRA_SECTIONS = frozenset({"join", "pools", "token_backend", "cluster", "devid"})
_FIELDS_NOT_SETTINGS = frozenset({"extra", "base_dir"})


def table_matches_config() -> list[str]:
    """ServerConfig fields that have no row in :data:`TABLE` (or rows with no field); [] when none."""
    names = {f.name for f in fields(ServerConfig)} - _FIELDS_NOT_SETTINGS
    rows = {s.name for s in TABLE.settings} - EXTRA_SECTIONS
    return sorted(f"{n}: a ServerConfig field without a settings row" for n in names - rows) + sorted(
        f"{n}: a settings row without a ServerConfig field" for n in rows - names
    )


def config_from_mapping(
    doc: Any, *, base_dir: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> ServerConfig:
    """Validate a parsed YAML mapping into a :class:`ServerConfig`.

    ``overrides`` are flags of ``nodeserver run`` (``{name: text}``): they replace the file's
    values, and relative paths in them start at the current folder.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"the configuration must be a YAML mapping of settings, got {type(doc).__name__}")
    try:
        values = TABLE.parse(doc, Ctx(base_dir=base_dir), partial=True)
        for name, value in (overrides or {}).items():
            if value is not None:
                flag = TABLE.by_name[name].flag or name
                values[name] = TABLE.parse_text(name, str(value), flag)
        for s in TABLE.settings:
            if s.name not in values:
                if s.required:
                    raise ConfigError(f"{s.key} is required: {s.help}")
                values[s.name] = s.default
    except SettingError as exc:
        raise ConfigError(f"{exc}; see {DOCS}") from None
    extra = {k: values.pop(k) for k in EXTRA_SECTIONS}
    values["extra"] = {k: v for k, v in extra.items() if v is not None}
    values["base_dir"] = base_dir
    return ServerConfig(**values)


def load_config(path: Path, *, overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; this is not a configuration file")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # an integer of too many digits, nesting too deep
        raise ConfigError(f"{path} cannot be read as YAML: {exc}") from exc
    return config_from_mapping(doc, base_dir=path.parent.resolve(), overrides=overrides)


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the whole configuration file, for editors."""
    return TABLE.json_schema(title="nodeserver configuration (/etc/nodeserver/config.yaml)")
