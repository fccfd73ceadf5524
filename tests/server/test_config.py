"""The server configuration refuses bad input with the key and the fix."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from server.config import config_from_mapping, load_config, parse_duration
from server.errors import ConfigError

BASE: dict[str, Any] = {"trust_domain": "example.org", "data_dir": "/var/lib/nodeserver"}


def test_defaults() -> None:
    cfg = config_from_mapping(BASE)
    assert cfg.listen == ("0.0.0.0", 8081)
    assert cfg.agent_svid_ttl == dt.timedelta(hours=1)
    assert cfg.challenge_timeout == dt.timedelta(seconds=30)
    assert cfg.max_payload_bytes == 64 * 1024
    assert cfg.store_dsn == "sqlite:////var/lib/nodeserver/store.db"
    assert cfg.audit_path == Path("/var/lib/nodeserver/audit.jsonl")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"trust_domain": "Example.ORG"}, "trust_domain"),
        ({"trust_domain": None}, "trust_domain"),
        ({"listen": "8081"}, "listen: expected HOST:PORT"),
        ({"listen": "0.0.0.0:99999"}, "port must be"),
        ({"agent_svid_ttl": "soon"}, "agent_svid_ttl: expected a duration"),
        ({"agent_svid_ttl": "10s"}, "at least 1m"),
        ({"challenge_timeout": True}, "challenge_timeout"),
        ({"max_payload_bytes": 10}, "max_payload_bytes"),
        ({"max_payload_bytes": "64k"}, "max_payload_bytes: expected an integer"),
        ({"server_dns_names": "localhost"}, "server_dns_names"),
        ({"ek_trust": {"ca_dirr": "/x"}}, "unknown keys ca_dirr"),
        ({"ek_trust": "yes"}, "ek_trust"),
        ({"colour": "blue"}, "unknown key .colour.; allowed: trust_domain, data_dir"),
    ],
)
def test_bad_values(override: dict[str, Any], message: str) -> None:
    doc = {**BASE, **override}
    if override.get("trust_domain", 0) is None:
        del doc["trust_domain"]
    with pytest.raises(ConfigError, match=message):
        config_from_mapping(doc)


def test_data_dir_required() -> None:
    with pytest.raises(ConfigError, match="data_dir is required"):
        config_from_mapping({"trust_domain": "example.org"})


def test_durations() -> None:
    assert parse_duration("15m", "k") == dt.timedelta(minutes=15)
    assert parse_duration(90, "k") == dt.timedelta(seconds=90)
    assert parse_duration("7d", "k") == dt.timedelta(days=7)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trust_domain: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    rel = tmp_path / "rel.yaml"
    rel.write_text("trust_domain: example.org\ndata_dir: data\nek_trust: {hash_dir: hashes}\n")
    cfg = load_config(rel)
    assert cfg.data_dir == tmp_path.resolve() / "data"
    assert cfg.ek_trust is not None and cfg.ek_trust.hash_dir == tmp_path.resolve() / "hashes"
