"""The ``ek_trust`` configuration: :class:`EkTrustConfig` and its validation (fail closed)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from server.ek.store import ChainPolicy
from server.errors import ConfigError

MODES = ("hash", "ca", "ca_or_hash", "ca_and_hash")
TCG_PROFILES = ("ignore", "warn", "enforce")
_OID = re.compile(r"[0-2](\.[0-9]+)+")


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
    def from_mapping(cls, doc: Mapping[str, object], base_dir: Path | None = None) -> EkTrustConfig:
        """Build from the parsed YAML mapping; relative paths are taken from ``base_dir``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(
                f"ek_trust: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values: dict[str, object] = {}
        for key, value in doc.items():
            if value is None:
                continue
            if key in ("ca_dir", "hash_dir"):
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"ek_trust.{key} must be a path string")
                path = Path(value)
                values[key] = (base_dir / path) if base_dir is not None and not path.is_absolute() else path
            elif key == "ignore_critical_extensions":
                if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                    raise ConfigError("ek_trust.ignore_critical_extensions must be a list of OID strings")
                values[key] = tuple(value)
            else:
                values[key] = value
        for key, kind in (
            ("intermediates_as_anchors", bool),
            ("allow_sha1", bool),
            ("lenient_parsing", bool),
        ):
            if key in values and not isinstance(values[key], kind):
                raise ConfigError(f"ek_trust.{key} must be true or false")
        for key in ("max_chain_depth", "cache_size"):
            if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
                raise ConfigError(f"ek_trust.{key} must be an integer")
        if "recheck_interval_s" in values and not isinstance(values["recheck_interval_s"], int | float):
            raise ConfigError("ek_trust.recheck_interval_s must be a number")
        for key in ("mode", "tcg_profile"):
            if key in values and not isinstance(values[key], str):
                raise ConfigError(f"ek_trust.{key} must be a string")
        return cls(**values)  # type: ignore[arg-type]  # each value checked above

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
