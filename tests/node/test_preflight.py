"""Node preflight: each collector against a node's files, then the rule that judges it."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent import node
from agent.host import Host
from agent.node import system, tools
from protocol.policy import PRESETS, PoolPolicy, assess
from protocol.report import Check, Observation, Status
from protocol.rules import CHECK_NAMES

# Collectors run programs (journalctl, containerd, kubelet) or the agent itself through agent.proc.
pytestmark = pytest.mark.subprocess

CPU = replace(PRESETS["cpu"], min_free_disk_gib=1)


def judge(name: str, data: Mapping[str, Any], policy: PoolPolicy = CPU) -> Check:
    checks, _ = assess([Observation(name, "test", data)], policy)
    return next(c for c in checks if c.name == name)


def test_collect_covers_every_node_check(host: Host) -> None:
    names = [o.name for o in node.collect(host)]
    assert names == [n for n in CHECK_NAMES if n.startswith("node.")]


def test_healthy_node_files_pass(host: Host) -> None:
    checks, _ = assess(node.collect(host), CPU)
    by = {c.name: c for c in checks}
    for name in (
        "node.swap",
        "node.kernel_modules",
        "node.sysctl",
        "node.cgroup",
        "node.network",
        "node.disk",
    ):
        assert by[name].status is Status.PASS, by[name]
    assert by["node.hostname"].observed == "cpu-node-01"
    assert by["node.network"].observed == "addresses 10.0.1.17, default via 10.0.1.1 dev bond0"
    assert by["node.cgroup"].observed == "cgroup v2, controllers cpuset cpu io memory hugetlb pids rdma misc"


def test_swap_on_fails(node_root: Path, host: Host) -> None:
    with (node_root / "proc/swaps").open("a") as f:
        f.write("/swap.img                               file\t\t8388604\t\t0\t\t-2\n")
    obs = system.swap(host)
    assert obs["devices"] == [{"name": "/swap.img", "type": "file", "size_kib": 8388604}]
    assert "swap is on (/swap.img): swapoff -a" in judge("node.swap", obs).reason


def test_modules_loaded_or_built_in(node_root: Path, host: Host) -> None:
    assert system.kernel_modules(host) == {
        "overlay": {"available": True, "evidence": "/proc/modules"},
        "br_netfilter": {"available": True, "evidence": "/proc/modules"},
    }
    (node_root / "proc/modules").write_text("")
    assert system.kernel_modules(host) == {
        "overlay": {"available": True, "evidence": "/proc/filesystems lists overlay"},
        "br_netfilter": {
            "available": True,
            "evidence": "/proc/sys/net/bridge/bridge-nf-call-iptables exists",
        },
    }
    shutil.rmtree(node_root / "proc/sys/net/bridge")
    check = judge("node.kernel_modules", system.kernel_modules(host))
    assert (
        check.status is Status.FAIL
        and check.reason == "kernel module br_netfilter not loaded: modprobe br_netfilter"
    )


def test_ip_forward_off_fails(node_root: Path, host: Host) -> None:
    (node_root / "proc/sys/net/ipv4/ip_forward").write_text("0\n")
    check = judge("node.sysctl", system.sysctls(host))
    assert check.status is Status.FAIL
    assert check.reason == "net.ipv4.ip_forward is 0 (set them in /etc/sysctl.d/)"


def test_cgroup_v1_and_missing_controller(node_root: Path, host: Host) -> None:
    mountinfo = node_root / "proc/1/mountinfo"
    mountinfo.write_text(
        mountinfo.read_text().replace("- cgroup2 cgroup2 rw", "- tmpfs tmpfs ro")
        + "28 27 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    )
    check = judge("node.cgroup", system.cgroup(host))
    assert (check.status, check.observed) == (Status.FAIL, "/sys/fs/cgroup is tmpfs")
    mountinfo.write_text(mountinfo.read_text().replace("- tmpfs tmpfs ro", "- cgroup2 cgroup2 rw"))
    (node_root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io pids\n")
    assert judge("node.cgroup", system.cgroup(host)).reason == "cgroup controller memory not available"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("gpu-node-01.dc1.example.com", None),
        ("GPU-Node-01", None),
        ("node_01", "label 'node_01' is not an RFC 1123 label"),
        ("-node", "label '-node' is not an RFC 1123 label"),
        ("a" * 64, "is not an RFC 1123 label"),
        ("", "it is empty"),
    ],
)
def test_hostname_must_be_a_node_name(node_root: Path, host: Host, name: str, problem: str | None) -> None:
    (node_root / "proc/sys/kernel/hostname").write_text(name + "\n")
    check = judge("node.hostname", system.hostname(host))
    if problem is None:
        assert check.status is Status.PASS
    else:
        assert check.status is Status.FAIL and problem in check.reason
    if name != name.lower():
        assert check.observed == f"{name} (node name {name.lower()})"


def test_network_without_route_or_address(node_root: Path, host: Host) -> None:
    route = node_root / "proc/net/route"
    route.write_text(
        "\n".join(ln for ln in route.read_text().splitlines() if "\t00000000\t0101000A" not in ln)
    )
    check = judge("node.network", system.network(host))
    assert check.reason == "no IPv4 default route"
    trie = node_root / "proc/net/fib_trie"
    trie.write_text(trie.read_text().replace("10.0.1.17", "169.254.3.4"))
    assert judge("node.network", system.network(host)).reason == (
        "no IPv4 address other than loopback or link-local; no IPv4 default route"
    )


def test_disk_threshold(host: Host) -> None:
    obs = system.disk(host)
    paths = obs["paths"]
    assert isinstance(paths, list) and [p["path"] for p in paths if isinstance(p, dict)] == [
        "/var/lib/containerd",
        "/var/log",
    ]
    assert judge("node.disk", obs).status is Status.PASS
    check = judge("node.disk", obs, replace(CPU, min_free_disk_gib=10**9))
    assert check.status is Status.FAIL and "/var/lib/containerd has" in check.reason
    assert "GiB free, the pool needs 1000000000 GiB" in check.reason


def test_time_sync_reads_the_kernel_clock() -> None:
    obs = system.time_sync()
    assert obs["error"] is None
    assert (
        isinstance(obs["state"], int)
        and isinstance(obs["status"], int)
        and isinstance(obs["max_error_us"], int)
    )
    check = judge("node.time_sync", obs)
    max_error = obs["max_error_us"]
    assert isinstance(max_error, int)
    assert (check.status is Status.PASS) is (max_error < 16_000_000)


@pytest.mark.parametrize(("max_error", "status"), [(120_000, Status.PASS), (16_000_000, Status.FAIL)])
def test_time_sync_rule(max_error: int, status: Status) -> None:
    obs = {"state": 0, "status": 0x2001, "max_error_us": max_error, "error": None}
    assert judge("node.time_sync", obs, replace(CPU, fatal=frozenset({"node.time_sync"}))).status is status
    assert judge("node.time_sync", obs).status is (Status.PASS if status is Status.PASS else Status.WARN)


@pytest.mark.parametrize(
    ("name", "output", "version"),
    [
        (
            "containerd",
            "containerd github.com/containerd/containerd v1.7.24 88bf19b2105c8b17560993bee28a01ddc2f97182",
            "1.7.24",
        ),
        ("containerd", "containerd containerd.io 1.6.33 d2d58213f83a351ca8f528a95fbd145f5654e957", "1.6.33"),
        (
            "containerd",
            "containerd github.com/containerd/containerd/v2 v2.0.2 c507a0257ea6462fbd6f5ba4f5c74facb04021f4",
            "2.0.2",
        ),
        ("cri-o", "crio version 1.31.3\nGitCommit:  a1b2c3", "1.31.3"),
        ("cri-o", "Version:        1.28.4\nGitCommit:      0bd9b7", "1.28.4"),
        ("containerd", "garbage", None),
    ],
)
def test_runtime_version_parsing(name: str, output: str, version: str | None) -> None:
    assert tools.parse_runtime_version(name, output) == version


def test_kubelet_version_parsing() -> None:
    assert tools.parse_kubelet_version("Kubernetes v1.31.2\n") == "v1.31.2"
    assert tools.parse_kubelet_version("Kubernetes v1.32.0-rc.1") == "v1.32.0-rc.1"
    assert tools.parse_kubelet_version("kubelet: not found") is None


def test_runtime_and_kubelet_on_this_machine(host: Host) -> None:
    """What the machine running the tests really has, found through PATH and agent.proc.run."""
    runtimes = tools.container_runtime(host)["runtimes"]
    assert isinstance(runtimes, list)
    by_name = {r["name"]: r for r in runtimes if isinstance(r, dict)}
    for name, binary in (("containerd", "containerd"), ("cri-o", "crio")):
        if shutil.which(binary) is None:
            assert by_name[name]["version"] is None
            assert by_name[name]["error"] == f"{binary} is not installed or not on PATH"
        else:
            assert by_name[name]["version"] is not None
    kubelet = tools.kubelet()
    if shutil.which("kubelet") is None:
        assert kubelet == {"version": None, "raw": None, "error": "kubelet is not installed or not on PATH"}
        assert (
            judge("node.kubelet", kubelet).reason
            == "kubelet unusable: kubelet is not installed or not on PATH"
        )
    else:
        assert kubelet["version"] is not None


def test_runtime_socket_must_be_a_socket(node_root: Path, host: Host) -> None:
    path = node_root / "run/containerd/containerd.sock"
    path.parent.mkdir(parents=True)
    path.write_text("not a socket")
    assert tools._socket_present(host, "/run/containerd/containerd.sock") is False
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        assert tools._socket_present(host, "/run/containerd/containerd.sock") is True
    obs = {
        "runtimes": [
            {
                "name": "containerd",
                "version": "1.7.24",
                "error": None,
                "socket": "/run/containerd/containerd.sock",
                "socket_present": False,
            }
        ]
    }
    assert (
        "1.7.24 is installed but /run/containerd/containerd.sock is absent"
        in judge("node.container_runtime", obs).reason
    )
    obs["runtimes"][0]["socket_present"] = True
    assert judge("node.container_runtime", obs).status is Status.PASS


@pytest.mark.parametrize(
    ("kubelet", "control_plane", "problem"),
    [
        ("v1.31.2", "1.31", None),
        ("v1.28.15", "1.31.4", None),
        ("v1.27.16", "1.31", "is 4 minor versions behind the control plane 1.31 (at most 3)"),
        ("v1.32.0", "1.31", "is newer than the control plane 1.31"),
        ("v2.0.0", "1.31", "is newer than the control plane"),
    ],
)
def test_kubelet_skew(kubelet: str, control_plane: str, problem: str | None) -> None:
    obs = {"version": kubelet, "raw": f"Kubernetes {kubelet}", "error": None}
    check = judge("node.kubelet", obs, replace(CPU, control_plane_version=control_plane))
    if problem is None:
        assert check.status is Status.PASS
    else:
        assert check.status is Status.FAIL and problem in check.reason


def test_skew_required_without_control_plane_version() -> None:
    obs = {"version": "v1.31.2", "raw": "Kubernetes v1.31.2", "error": None}
    check = judge("node.kubelet", obs, PRESETS["lepton-byok"])
    assert check.reason == "the pool requires the skew check but sets no control_plane_version"
