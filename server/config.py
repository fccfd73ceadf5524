"""The server's configuration: one YAML file, validated at start with clear errors.

Unknown keys, wrong types and bad values are refused with the key's dotted
path and what is expected. Durations are written ``30s``, ``15m``, ``1h``,
``7d`` or as integer seconds. See docs/attestation.md for every key.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protocol.errors import SpiffeIdError
from protocol.spiffe import validate_trust_domain
from server.ek.config import EkTrustConfig
from server.errors import ConfigError

_DURATION_RE = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any, key: str) -> dt.timedelta:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration like 30s, 15m or 1h, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value.strip())):
        seconds = int(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(f"{key}: expected a duration like 30s, 15m or 1h, got {value!r}")
    if seconds <= 0:
        raise ConfigError(f"{key}: must be positive")
    return dt.timedelta(seconds=seconds)


def parse_address(value: Any, key: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key}: expected HOST:PORT (e.g. 0.0.0.0:8081), got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: port must be 0..65535, got {port!r}")
    return host or "0.0.0.0", int(port)  # noqa: S104 - documented default: listen on all addresses


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


_TOP_KEYS = {
    "trust_domain",
    "data_dir",
    "listen",
    "join_listen",
    "metrics_listen",
    "store",
    "audit_log",
    "agent_svid_ttl",
    "server_svid_ttl",
    "ca_ttl",
    "challenge_timeout",
    "max_payload_bytes",
    "first_message_timeout",
    "handshake_timeout",
    "max_connections",
    "max_streams_per_connection",
    "peer_max_inflight",
    "attest_rate_per_ip",
    "attest_burst_per_ip",
    "audit_max_bytes",
    "audit_backups",
    "min_free_bytes",
    "server_dns_names",
    "ek_trust",
}
# Sections validated by the modules that own them (join broker, pools, token backend).
EXTRA_SECTIONS = {"join", "pools", "token_backend", "cluster"}


def _expect(value: Any, typ: type | tuple[type, ...], key: str, what: str) -> Any:
    if isinstance(value, bool) and typ is not bool:
        raise ConfigError(f"{key}: expected {what}, got a boolean")
    if not isinstance(value, typ):
        raise ConfigError(f"{key}: expected {what}, got {type(value).__name__} {value!r}")
    return value


def config_from_mapping(doc: Any, *, base_dir: Path | None = None) -> ServerConfig:
    """Validate a parsed YAML mapping into a :class:`ServerConfig`."""
    if not isinstance(doc, dict):
        raise ConfigError("the configuration must be a YAML mapping")
    unknown = sorted(set(doc) - _TOP_KEYS - EXTRA_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown configuration key(s): {', '.join(unknown)}; see docs/attestation.md")
    if "trust_domain" not in doc:
        raise ConfigError("trust_domain is required (e.g. trust_domain: example.org)")
    try:
        trust_domain = validate_trust_domain(_expect(doc["trust_domain"], str, "trust_domain", "a string"))
    except SpiffeIdError as exc:
        raise ConfigError(f"trust_domain: {exc}") from exc

    def path(key: str, value: Any) -> Path:
        p = Path(_expect(value, str, key, "a path"))
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        return p

    if "data_dir" not in doc:
        raise ConfigError(
            "data_dir is required: where the CA keys, the server SVID and the default store live"
        )
    kwargs: dict[str, Any] = {"trust_domain": trust_domain, "data_dir": path("data_dir", doc["data_dir"])}
    if "listen" in doc:
        kwargs["listen"] = parse_address(doc["listen"], "listen")
    if "join_listen" in doc:
        kwargs["join_listen"] = (
            None if doc["join_listen"] is None else parse_address(doc["join_listen"], "join_listen")
        )
    if "metrics_listen" in doc:
        v = doc["metrics_listen"]
        kwargs["metrics_listen"] = None if v in (None, "", "off") else parse_address(v, "metrics_listen")
    if "store" in doc:
        kwargs["store"] = _expect(doc["store"], str, "store", "a DSN (sqlite:///path or postgresql://...)")
    if "audit_log" in doc:
        kwargs["audit_log"] = path("audit_log", doc["audit_log"])
    for key in (
        "agent_svid_ttl",
        "server_svid_ttl",
        "ca_ttl",
        "challenge_timeout",
        "first_message_timeout",
        "handshake_timeout",
    ):
        if key in doc:
            kwargs[key] = parse_duration(doc[key], key)
    if "max_payload_bytes" in doc:
        v = _expect(doc["max_payload_bytes"], int, "max_payload_bytes", "an integer")
        if not 1024 <= v <= 4 * 1024 * 1024:
            raise ConfigError("max_payload_bytes: must be between 1024 and 4194304")
        kwargs["max_payload_bytes"] = v
    for key, low, high in (
        ("max_connections", 0, 1_000_000),
        ("max_streams_per_connection", 1, 1000),
        ("peer_max_inflight", 1, 100_000),
        ("attest_burst_per_ip", 1, 100_000),
        ("audit_max_bytes", 1024 * 1024, 1 << 40),
        ("audit_backups", 0, 1000),
        ("min_free_bytes", 0, 1 << 40),
    ):
        if key in doc:
            v = _expect(doc[key], int, key, "an integer")
            if not low <= v <= high:
                raise ConfigError(f"{key}: must be between {low} and {high}")
            kwargs[key] = v
    if "attest_rate_per_ip" in doc:
        v = _expect(doc["attest_rate_per_ip"], (int, float), "attest_rate_per_ip", "a number")
        if not 0 <= v <= 100_000:
            raise ConfigError("attest_rate_per_ip: must be between 0 (no limit) and 100000")
        kwargs["attest_rate_per_ip"] = float(v)
    if "server_dns_names" in doc:
        names = _expect(doc["server_dns_names"], list, "server_dns_names", "a list of DNS names")
        for i, n in enumerate(names):
            _expect(n, str, f"server_dns_names[{i}]", "a DNS name")
        kwargs["server_dns_names"] = tuple(names)
    if "ek_trust" in doc:
        et = _expect(
            doc["ek_trust"],
            dict,
            "ek_trust",
            "a mapping (ca_dir, hash_dir, mode, ...); see docs/ek-trust.md",
        )
        kwargs["ek_trust"] = EkTrustConfig.from_mapping(et, base_dir=base_dir)
    if kwargs.get("agent_svid_ttl", dt.timedelta(hours=1)) < dt.timedelta(minutes=1):
        raise ConfigError("agent_svid_ttl: must be at least 1m")
    kwargs["extra"] = {k: doc[k] for k in EXTRA_SECTIONS if k in doc}
    kwargs["base_dir"] = base_dir
    return ServerConfig(**kwargs)


def load_config(path: Path) -> ServerConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    return config_from_mapping(doc, base_dir=path.parent.resolve())
