"""Inputs the agent reads are bounded before parsing, and addresses are parsed strictly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.attest_client import ServerTarget, host_port
from agent.errors import ConfigError, PoolProfileError
from agent.host import MAX_HOST_FILE_BYTES, Host
from agent.pool import MAX_PROFILE_BYTES, load_pool


def test_a_huge_pool_profile_is_refused_before_yaml(tmp_path: Path) -> None:
    profile = tmp_path / "pool.yaml"
    profile.write_bytes(b"name: cpu\n" + b"# padding\n" * (MAX_PROFILE_BYTES // 10 + 1))
    with pytest.raises(PoolProfileError, match="larger than"):
        load_pool(str(profile))


def test_a_pool_profile_that_is_not_utf8(tmp_path: Path) -> None:
    profile = tmp_path / "pool.yaml"
    profile.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(PoolProfileError):
        load_pool(str(profile))


def test_host_files_are_bounded_and_regular(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (tmp_path / "proc").mkdir()
    big = tmp_path / "proc" / "swaps"
    with big.open("wb") as fh:
        fh.truncate(MAX_HOST_FILE_BYTES + 1)
    with pytest.raises(OSError, match="larger than"):
        host.read_text("/proc/swaps")
    os.mkfifo(tmp_path / "proc" / "modules")
    with pytest.raises(OSError, match="not a regular file"):
        host.read_text("/proc/modules")  # a FIFO must not block the checks
    (tmp_path / "proc" / "filesystems").write_text("nodev\tproc\n")
    assert host.read_text("/proc/filesystems") == "nodev\tproc\n"


def test_the_node_checks_survive_an_oversized_host_file(tmp_path: Path) -> None:
    """A collector that reads a too-large file reports an error for that check instead of crashing."""
    from agent.node import system

    (tmp_path / "proc").mkdir()
    with (tmp_path / "proc" / "swaps").open("wb") as fh:
        fh.truncate(MAX_HOST_FILE_BYTES + 1)
    observed = system.swap(Host(tmp_path))
    assert observed.get("error")


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("attest.example.org:8081", ("attest.example.org", 8081)),
        ("10.0.0.5:8081", ("10.0.0.5", 8081)),
        ("[fd00::5]:8081", ("fd00::5", 8081)),
    ],
)
def test_addresses(address: str, expected: tuple[str, int]) -> None:
    assert host_port(address) == expected


@pytest.mark.parametrize(
    "address",
    ["host", "host:", ":8081", "host:99999", "host:0", "host:8081\n", "host:1²", "a b:80", "host:-1"],
)
def test_bad_addresses(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        host_port(address)
    with pytest.raises(ValueError):
        ServerTarget.parse(address, "example.org", b"")


def test_a_bad_join_server_is_a_config_error_not_a_crash(tmp_path: Path) -> None:
    import asyncio

    from agent.join_client import request_join_async
    from tests.agent.conftest import TinyServer

    srv = TinyServer(tmp_path)  # only its certificates: nothing listens
    try:
        with pytest.raises(ConfigError, match="HOST:PORT"):
            asyncio.run(
                request_join_async(
                    "broker:1²", trust_domain="example.org", bundle_pem=srv.bundle, svid_cert=srv.svid_cert,
                    svid_key=srv.svid_key, pool="cpu", node_name="n", report=b"{}",
                )
            )  # fmt: skip
    finally:
        srv.stop()


def test_malformed_proc_files_do_not_crash_the_checks(tmp_path: Path) -> None:
    """Under --host-root the files can hold anything; a line that is not the kernel's is skipped."""
    from agent.node import system

    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "swaps").write_text(
        "Filename Type Size Used Priority\n/swap file ²³ 0 -2\n/dev/sda2 partition 1024 0 -1\n"
    )
    (proc / "net" / "fib_trie").write_text("")
    (proc / "net" / "route").write_text(
        "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t00000000\tnot-hex\t0003\t0\t0\t0\t00000000\n"
        "eth1\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\n"
    )
    host = Host(tmp_path)
    assert system.swap(host)["devices"] == [{"name": "/dev/sda2", "type": "partition", "size_kib": 1024}]
    assert system.network(host)["default_route"] == {"interface": "eth1", "gateway": "10.0.0.1"}


def test_a_proc_entry_with_non_ascii_digits_is_not_a_pid(tmp_path: Path) -> None:
    from agent.gpu import driver

    for name in ("²", "42"):
        (tmp_path / "proc" / name).mkdir(parents=True)
        (tmp_path / "proc" / name / "comm").write_text("nvidia-persiste\n")  # the kernel keeps 15
    assert driver.processes(Host(tmp_path), ("nvidia-persistenced",)) == {"nvidia-persistenced": [42]}
