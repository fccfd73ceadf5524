"""The server configuration refuses bad input with the key and the fix."""

from __future__ import annotations

import datetime as dt
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from server.config import (
    MAX_CONFIG_BYTES,
    TABLE,
    ServerConfig,
    config_from_mapping,
    load_config,
    parse_duration,
    table_matches_config,
)
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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1h30m", dt.timedelta(minutes=90)),
        ("2h45m10s", dt.timedelta(hours=2, minutes=45, seconds=10)),
        ("1.5h", dt.timedelta(minutes=90)),
        ("300ms", dt.timedelta(milliseconds=300)),
        ("30s", dt.timedelta(seconds=30)),
        (90, dt.timedelta(seconds=90)),
        ("90", dt.timedelta(seconds=90)),
        ("7d", dt.timedelta(days=7)),
    ],
)
def test_go_durations(value: object, expected: dt.timedelta) -> None:
    assert config_from_mapping({**BASE, "challenge_timeout": value}).challenge_timeout == expected


@pytest.mark.parametrize("value", ["-30s", "1.5", "30 s", "", "0", "30s\n", 1.5, -1])
def test_bad_durations_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="challenge_timeout: "):
        config_from_mapping({**BASE, "challenge_timeout": value})


def test_sizes_and_the_settings_of_the_limits() -> None:
    cfg = config_from_mapping(
        {
            **BASE,
            "audit_max_bytes": "64MiB",
            "min_free_bytes": "1GiB",
            "max_payload_bytes": "128KiB",
            "first_message_timeout": "5s",
            "handshake_timeout": "2500ms",
            "max_connections": 2048,
            "max_streams_per_connection": 8,
            "peer_max_inflight": 32,
            "attest_rate_per_ip": 5,
            "attest_burst_per_ip": 10,
            "audit_backups": 0,
        }
    )
    assert (cfg.audit_max_bytes, cfg.min_free_bytes, cfg.max_payload_bytes) == (64 << 20, 1 << 30, 128 << 10)
    assert cfg.first_message_timeout == dt.timedelta(seconds=5)
    assert cfg.handshake_timeout == dt.timedelta(milliseconds=2500)
    assert (cfg.max_connections, cfg.max_streams_per_connection, cfg.peer_max_inflight) == (2048, 8, 32)
    assert cfg.attest_rate_per_ip == 5.0 and isinstance(cfg.attest_rate_per_ip, float)
    assert (cfg.attest_burst_per_ip, cfg.audit_backups) == (10, 0)
    for key, bad in (
        ("audit_max_bytes", "1KiB"),
        ("max_streams_per_connection", 0),
        ("attest_rate_per_ip", -1),
    ):
        with pytest.raises(ConfigError, match=f"{key}: must be"):
            config_from_mapping({**BASE, key: bad})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"trust_domain": "example.org\n"}, "trust_domain: expected a trust domain"),
        ({"listen": "0.0.0.0:8081\n"}, "listen: port must be"),
        ({"agent_svid_ttl": "1h\n"}, "agent_svid_ttl: expected a duration"),
        ({"server_dns_names": ["server.example.org\n"]}, r"server_dns_names\[0\]: expected a DNS name"),
        ({"max_payload_bytes": "64KiB\n"}, "max_payload_bytes: expected an integer number of bytes"),
    ],
)
def test_a_trailing_newline_is_refused(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_mapping({**BASE, **override})


def test_every_serverconfig_field_has_a_settings_row_with_its_default() -> None:
    """The lead engineer's new settings appear as ServerConfig fields: each needs a row in the table."""
    assert table_matches_config() == []
    rows = {s.name: s for s in TABLE.settings}
    for f in fields(ServerConfig):
        if f.name in rows and f.default is not MISSING:
            assert rows[f.name].default == f.default, f.name


def test_run_flags_override_the_file(tmp_path: Path) -> None:
    from server.cli import build_parser

    path = tmp_path / "config.yaml"
    path.write_text("trust_domain: example.org\ndata_dir: data\nlisten: 0.0.0.0:8081\n")
    args = build_parser().parse_args(
        [
            "run",
            "-c",
            str(path),
            "--listen",
            "127.0.0.1:0",
            "--challenge-timeout",
            "1m30s",
            "--metrics-listen",
            "off",
        ]
    )
    cfg = load_config(path, overrides=TABLE.given(args))
    assert cfg.listen == ("127.0.0.1", 0) and cfg.challenge_timeout == dt.timedelta(seconds=90)
    assert cfg.metrics_listen is None and cfg.data_dir == tmp_path.resolve() / "data"
    secret = TABLE.by_name["store"]
    assert secret.secret and secret.flag is None  # a DSN with a password never goes on a command line
    args = build_parser().parse_args(["run", "-c", str(path), "--max-payload-bytes", "1"])
    with pytest.raises(ConfigError, match="--max-payload-bytes: must be between 1KiB and 4MiB"):
        load_config(path, overrides=TABLE.given(args))


def test_files_are_bounded_and_odd_yaml_is_a_config_error(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("trust_domain: example.org\n" + "#" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError, match="larger than"):
        load_config(big)
    digits = tmp_path / "digits.yaml"
    digits.write_text("trust_domain: example.org\ndata_dir: /x\nmax_connections: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="cannot be read as YAML"):
        load_config(digits)
    listed = tmp_path / "list.yaml"
    listed.write_text("- trust_domain\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(listed)
