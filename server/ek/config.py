"""The ``ek_trust`` configuration: :class:`EkTrustConfig` and its validation (fail closed)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from protocol.settings import Ctx, Problem, Setting, SettingError, Table
from protocol.settings import boolean as _boolean
from protocol.settings import choice as _choice
from protocol.settings import duration as _duration
from protocol.settings import integer as _integer
from protocol.settings import list_of as _list_of
from protocol.settings import optional as _optional
from protocol.settings import path as _path
from protocol.settings import text as _text
from server.ek.store import ChainPolicy
from server.errors import ConfigError

MODES = ("hash", "ca", "ca_or_hash", "ca_and_hash")
TCG_PROFILES = ("ignore", "warn", "enforce")
_OID_BODY = r"[0-2](\.[0-9]+)+"
_OID = re.compile(_OID_BODY)
SECTION = "ek_trust"


@dataclass(frozen=True)
class EkTrustConfig:
    """The ``ek_trust`` section of the server configuration (YAML keys = field names)."""

    ca_dir: Path | None = None
    hash_dir: Path | None = None
    mode: str | None = None  # None or "": "ca_or_hash" with both directories, else the one configured
    intermediates_as_anchors: bool = True  # upstream: every certificate in ca_dir is a trust anchor
    max_chain_depth: int = 5  # CA certificates above the EK certificate
    allow_sha1: bool = False
    tcg_profile: str = "warn"  # "ignore" | "warn" | "enforce"
    lenient_parsing: bool = True
    ignore_critical_extensions: tuple[str, ...] = ()
    cache_size: int = 4096
    recheck_interval_s: float = 1.0  # how often to look for directory changes; 0: at every verify

    @classmethod
    def from_mapping(
        cls, doc: Mapping[str, object], base_dir: Path | None = None, *, path: tuple[str, ...] = (SECTION,)
    ) -> EkTrustConfig:
        """Build from the parsed YAML mapping (validated by :data:`TABLE`); relative paths are taken
        from ``base_dir``; a key set to null keeps its default."""
        try:
            values = TABLE.parse(doc, Ctx(path, base_dir=base_dir), partial=True)
        except SettingError as exc:
            raise ConfigError(_message(exc)) from None
        return cls(**{k: v for k, v in values.items() if v is not None})

    def resolved_mode(self) -> str:
        if self.mode:
            return self.mode
        if self.ca_dir is not None and self.hash_dir is not None:
            return "ca_or_hash"
        return "ca" if self.ca_dir is not None else "hash"

    def chain_policy(self) -> ChainPolicy:
        return ChainPolicy(
            intermediates_as_anchors=self.intermediates_as_anchors,
            max_chain_depth=self.max_chain_depth,
            allow_sha1=self.allow_sha1,
            ignore_critical_extensions=frozenset(self.ignore_critical_extensions),
        )


def validate(config: EkTrustConfig) -> str:
    """The effective mode; raises ConfigError for any configuration that cannot work as written."""
    if config.ca_dir is None and config.hash_dir is None:
        raise ConfigError("ek_trust: set ca_dir, hash_dir or both (no EK could ever be trusted)")
    mode = config.resolved_mode()
    if mode not in MODES:
        raise ConfigError(f"ek_trust.mode {mode!r} is not one of {', '.join(MODES)}")
    if mode != "hash" and config.ca_dir is None:
        raise ConfigError(f"ek_trust.mode {mode} needs ca_dir")
    if mode not in ("ca",) and config.hash_dir is None:
        raise ConfigError(f"ek_trust.mode {mode} needs hash_dir")
    if mode == "ca" and config.hash_dir is not None:
        raise ConfigError(
            "ek_trust: hash_dir is set but mode ca ignores it; use mode ca_or_hash or ca_and_hash"
        )
    if mode == "hash" and config.ca_dir is not None:
        raise ConfigError(
            "ek_trust: ca_dir is set but mode hash ignores it; use mode ca_or_hash or ca_and_hash"
        )
    for key, directory in (("ca_dir", config.ca_dir), ("hash_dir", config.hash_dir)):
        if directory is None:
            continue
        if not directory.exists():
            raise ConfigError(f"ek_trust.{key} {directory} does not exist")
        if not directory.is_dir():
            raise ConfigError(
                f"ek_trust.{key} {directory} is not a directory"
                + (": it must hold one file per trusted EK hash" if key == "hash_dir" else "")
            )
    if config.tcg_profile not in TCG_PROFILES:
        raise ConfigError(
            f"ek_trust.tcg_profile {config.tcg_profile!r} is not one of {', '.join(TCG_PROFILES)}"
        )
    if not 1 <= config.max_chain_depth <= 16:
        raise ConfigError("ek_trust.max_chain_depth must be between 1 and 16")
    if config.cache_size < 0:
        raise ConfigError("ek_trust.cache_size must not be negative (0 disables the cache)")
    if config.recheck_interval_s < 0:
        raise ConfigError("ek_trust.recheck_interval_s must not be negative")
    bad = [oid for oid in config.ignore_critical_extensions if not _OID.fullmatch(oid)]
    if bad:
        raise ConfigError(f"ek_trust.ignore_critical_extensions: not OIDs: {', '.join(bad)}")
    return mode


def _message(exc: SettingError) -> str:
    """This section's wording: ``ek_trust: unknown keys ...``, ``ek_trust.KEY must be ...``."""
    if exc.problem is Problem.UNKNOWN_KEY:
        return (
            f"{SECTION}: unknown keys {exc.path[-1]} (known: {', '.join(sorted(exc.allowed))}); "
            "see docs/ek-trust.md"
        )
    if exc.problem is Problem.TYPE:
        return f"{exc.where} must be {exc.expected}, got {exc.got_text}"
    return str(exc)


_DEFAULT: dict[str, Any] = {f.name: f.default for f in fields(EkTrustConfig)}


def _row(name: str, kind: Any, help_text: str, **extra: Any) -> Setting:
    # Every key may be null ("keep the default"), as before the table.
    return Setting(name, _optional(kind), help_text, _DEFAULT[name], flag=None, **extra)


TABLE = Table(
    SECTION,
    (
        _row("ca_dir", _path(), "manufacturer CA certificates (PEM or DER files), one or more per file"),
        _row("hash_dir", _path(), "files named by the allowed EK hashes (sha256 hex of the EK public key)"),
        _row(
            "mode",
            _optional(_choice(*MODES), off=("",)),
            "which trust method decides",
            default_text="ca_or_hash with both directories, else the one set",
        ),
        _row(
            "intermediates_as_anchors",
            _boolean(),
            "every certificate in ca_dir is a trust anchor (upstream behaviour)",
        ),
        _row("max_chain_depth", _integer(1, 16), "CA certificates above the EK certificate, at most"),
        _row("allow_sha1", _boolean(), "accept SHA-1 signatures in the chain"),
        _row(
            "tcg_profile", _choice(*TCG_PROFILES), "the TCG EK certificate profile: ignore, warn or enforce"
        ),
        _row("lenient_parsing", _boolean(), "accept the real-world encoding quirks of vendor certificates"),
        _row(
            "ignore_critical_extensions",
            _list_of(_text("an OID like 2.5.29.17", pattern=_OID_BODY), "a list of OIDs"),
            "extension OIDs to accept although not understood",
        ),
        _row("cache_size", _integer(0), "verification results kept (0: no cache)"),
        _row(
            "recheck_interval_s",
            _duration(seconds=True),
            "how often to look for directory changes (0: at every attestation)",
        ),
    ),
    flags=False,
)
