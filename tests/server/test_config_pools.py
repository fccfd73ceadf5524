"""The join broker's sections (cluster, join, pools) validated from their tables."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from server.errors import ConfigError
from server.pools import DEFAULT_GROUP, join_settings

HASH = "sha256:" + "0" * 64
CLUSTER: dict[str, Any] = {
    "api_server_endpoint": "10.0.0.1:6443",
    "ca_cert_hashes": [HASH],
    "kubernetes_version": "v1.36.3",
}


def _extra(tmp_path: Path, **change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cluster": CLUSTER,
        "token_backend": {"type": "file", "directory": str(tmp_path)},
        "pools": {"cpu": {"profile": "cpu"}},
    }
    return {**doc, **change}


def test_defaults_and_go_durations(tmp_path: Path) -> None:
    settings = join_settings(_extra(tmp_path))
    assert settings is not None
    assert (settings.token_ttl, settings.clock_skew) == (dt.timedelta(minutes=15), dt.timedelta(minutes=5))
    assert settings.token_reuse_window == dt.timedelta(minutes=2) and settings.joins_per_agent == 10
    assert (settings.join_window, settings.joins_retention) == (dt.timedelta(hours=1), dt.timedelta(days=30))
    pool = settings.pools["cpu"]
    assert (pool.kubernetes_version, pool.api_server_endpoint) == ("v1.36.3", "10.0.0.1:6443")
    assert pool.extra_groups == (DEFAULT_GROUP,)
    join = {"token_ttl": "1h30m", "clock_skew": 90, "joins_retention": "7d", "joins_per_agent": 3}
    settings = join_settings(_extra(tmp_path, join=join))
    assert settings is not None
    assert (settings.token_ttl, settings.clock_skew) == (dt.timedelta(minutes=90), dt.timedelta(seconds=90))
    assert settings.joins_retention == dt.timedelta(days=7) and settings.joins_per_agent == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # a trailing newline is refused everywhere (the ^...$ defect: `node-b\n` got a token)
        ({"pools": {"cpu\n": {"profile": "cpu"}}}, r"pools: 'cpu\\n' is not a valid pool name"),
        (
            {"cluster": {**CLUSTER, "kubernetes_version": "v1.36.3\n"}},
            "cluster.kubernetes_version: expected",
        ),
        (
            {"cluster": {**CLUSTER, "ca_cert_hashes": [HASH + "\n"]}},
            r"cluster.ca_cert_hashes\[0\]: expected",
        ),
        ({"cluster": {**CLUSTER, "api_server_endpoint": "10.0.0.1:6443\n"}}, "cluster.api_server_endpoint"),
        (
            {"pools": {"cpu": {"profile": "cpu", "extra_groups": ["system:bootstrappers:x\n"]}}},
            r"pools.cpu.extra_groups\[0\]: expected system:bootstrappers:<name>",
        ),
        (
            {"pools": {"cpu": {"profile": "cpu", "kubernetes_version": "v1.36\n"}}},
            "pools.cpu.kubernetes_version",
        ),
        # types, ranges and keys, named by their dotted path
        ({"join": {"joins_per_agent": 0}}, "join.joins_per_agent: must be between 1 and 10000, got 0"),
        ({"join": {"token_ttl": "30s"}}, "join.token_ttl: must be between 1m and 24h, got 30s"),
        ({"join": {"clock_skew": "5 m"}}, "join.clock_skew: expected a duration"),
        ({"join": {"token_tll": "15m"}}, "unknown key join.token_tll; allowed in join: token_ttl"),
        ({"cluster": {**CLUSTER, "colour": 1}}, "unknown key cluster.colour"),
        (
            {"cluster": {"ca_cert_hashes": [HASH], "kubernetes_version": "v1.36.3"}},
            "cluster.api_server_endpoint is required",
        ),
        ({"cluster": "10.0.0.1:6443"}, "cluster: expected a mapping with keys api_server_endpoint"),
        ({"pools": {"cpu": {}}}, "give exactly one of profile"),
        ({"pools": {"cpu": {"profile": "cpu", "profile_file": "x.yaml"}}}, "give exactly one of profile"),
        ({"pools": []}, "pools: expected a mapping of a valid pool name"),
    ],
)
def test_bad_sections(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        join_settings(_extra(tmp_path, **change))


def test_missing_sections_say_what_to_add(tmp_path: Path) -> None:
    extra = _extra(tmp_path)
    del extra["cluster"]
    with pytest.raises(ConfigError, match="cluster is required with pools"):
        join_settings(extra)
    extra = _extra(tmp_path)
    del extra["token_backend"]
    with pytest.raises(ConfigError, match="token_backend is required with pools"):
        join_settings(extra)


def test_profile_files_are_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("name: big\n" + "#" * (1024 * 1024))
    with pytest.raises(ConfigError, match=r"pools\.cpu\.profile_file: .* is larger than"):
        join_settings(_extra(tmp_path, pools={"cpu": {"profile_file": "big.yaml"}}), base_dir=tmp_path)
    ok = tmp_path / "ok.yaml"
    ok.write_text("preset: cpu\n")
    settings = join_settings(_extra(tmp_path, pools={"cpu": {"profile_file": "ok.yaml"}}), base_dir=tmp_path)
    assert settings is not None and settings.pools["cpu"].policy.gpu_count == 0
