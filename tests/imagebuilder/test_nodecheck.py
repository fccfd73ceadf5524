"""The boot test's node checks (imagebuilder/guest/nodecheck.py) on a made-up root and made-up commands:
each problem they exist to catch makes its check fail, and names what is wrong."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from imagebuilder.guest import nodecheck

ME = f"{pwd.getpwuid(os.getuid()).pw_name}:{grp.getgrgid(os.getgid()).gr_name}"


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, ...], tuple[int, str]]:
    """What each command answers: argv -> (exit status, output); anything else fails."""
    answers: dict[tuple[str, ...], tuple[int, str]] = {}
    monkeypatch.setattr(nodecheck, "_run", lambda *argv, timeout=120: answers.get(argv, (1, "unknown")))
    return answers


def _root(tmp_path: Path, *, modules: str = "overlay 1 0 - Live\nbr_netfilter 1 0 - Live\n", forward: str = "1\n",
          swaps: str = "Filename\tType\tSize\tUsed\tPriority\n") -> Path:  # fmt: skip
    root = tmp_path / "root"
    (root / "proc/sys/net/ipv4").mkdir(parents=True)
    (root / "proc/modules").write_text(modules)
    (root / "proc/sys/net/ipv4/ip_forward").write_text(forward)
    (root / "proc/swaps").write_text(swaps)
    (root / "proc/self").mkdir()
    (root / "proc/self/mountinfo").write_text("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return root


HOST: dict[str, Any] = {"kernel_modules": ["overlay", "br_netfilter"], "sysctls": {"net.ipv4.ip_forward": "1"},
                        "swap": False, "cgroup": "v2",
                        "time_sync": {"client": "systemd-timesyncd", "unit": "systemd-timesyncd.service",
                                      "release_file": "/etc/systemd/timesyncd.conf.d/50-nodetrust.conf"}}  # fmt: skip


def test_the_names_are_the_checks_it_makes(
    tmp_path: Path, commands: dict[tuple[str, ...], tuple[int, str]]
) -> None:
    node = {"files": [], "enabled": [], "masked": [], "host": HOST}
    names = [c["name"] for c in nodecheck.check_node(_root(tmp_path), node)]
    assert names == nodecheck.check_names(node)
    assert nodecheck.check_names({}) == [] and nodecheck.check_node(tmp_path, {}) == []


def test_a_healthy_host(tmp_path: Path, commands: dict[tuple[str, ...], tuple[int, str]]) -> None:
    commands[("systemctl", "is-enabled", "swap.target")] = (1, "masked")
    commands[("systemctl", "is-enabled", "systemd-timesyncd.service")] = (0, "enabled")
    commands[("systemctl", "is-active", "systemd-timesyncd.service")] = (0, "active")
    checks = {c["name"]: c for c in nodecheck.check_host(_root(tmp_path), HOST)}
    assert all(c["ok"] for c in checks.values()), checks
    assert checks["node/swap"]["detail"] == "no active swap; swap.target masked"


@pytest.mark.parametrize(
    ("fault", "check", "detail"),
    [
        ({"modules": "overlay 1 0 - Live\n"}, "node/kernel-modules", "not loaded: br_netfilter"),
        ({"forward": "0\n"}, "node/sysctls", "net.ipv4.ip_forward = 0, expected 1"),
        ({"swaps": "Filename\tType\n/swap.img file 1024 0 -2\n"}, "node/swap", "active swap"),
    ],
)
def test_a_host_that_is_not_configured(
    tmp_path: Path,
    commands: dict[tuple[str, ...], tuple[int, str]],
    fault: dict[str, str],
    check: str,
    detail: str,
) -> None:
    commands[("systemctl", "is-enabled", "swap.target")] = (1, "masked")
    found = {c["name"]: c for c in nodecheck.check_host(_root(tmp_path, **fault), HOST)}
    assert not found[check]["ok"] and detail in found[check]["detail"], found[check]
    assert all(c["ok"] for name, c in found.items() if name not in (check, "node/time-sync"))


def test_files_with_digest_mode_and_owner(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/x.conf").write_text("x = 1\n")
    (root / "etc/x.conf").chmod(0o640)
    entry = {"group": "host files", "path": "/etc/x.conf", "sha256": hashlib.sha256(b"x = 1\n").hexdigest(),
             "mode": "0640", "owner": ME}  # fmt: skip
    assert nodecheck.check_files(root, {"files": [entry]})["ok"]
    assert (
        "mode 0640, expected 0644"
        in nodecheck.check_files(root, {"files": [{**entry, "mode": "0644"}]})["detail"]
    )
    assert (
        "owned by"
        in nodecheck.check_files(root, {"files": [{**entry, "owner": "nobody:nogroup"}]})["detail"]
    )
    (root / "etc/x.conf").write_text("x = 2\n")
    assert "sha256 differs" in nodecheck.check_files(root, {"files": [entry]})["detail"]
    assert "is missing" in nodecheck.check_files(root, {"files": [{**entry, "path": "/etc/y"}]})["detail"]


def test_units_enabled_and_masked(commands: dict[tuple[str, ...], tuple[int, str]]) -> None:
    commands[("systemctl", "is-enabled", "containerd.service")] = (0, "enabled")
    commands[("systemctl", "is-enabled", "swap.target")] = (1, "masked")
    commands[("systemctl", "is-enabled", "nvidia-dcgm.service")] = (1, "disabled")
    ok = nodecheck.check_units({"enabled": ["containerd.service"], "masked": ["swap.target"]})
    assert ok["ok"], ok
    bad = nodecheck.check_units({"enabled": ["containerd.service", "nvidia-dcgm.service"], "masked": []})
    assert not bad["ok"] and bad["detail"] == "nvidia-dcgm.service is disabled, not enabled"


def test_gpu_modules_must_come_from_a_package_for_the_running_kernel(
    tmp_path: Path, commands: dict[tuple[str, ...], tuple[int, str]]
) -> None:
    root = tmp_path / "root"
    folder = root / "lib/modules/6.1.0-50-amd64/kernel/nvidia-570srv"
    folder.mkdir(parents=True)
    for name in ("nvidia", "nvidia-uvm", "nvidia-modeset"):
        (folder / f"{name}.ko.standin").write_text("x")
    gpu = {"packages": ["drv"], "kernel_modules_package": "mods", "modules": ["nvidia", "nvidia_uvm", "nvidia_modeset"],
           "toolkit_mode": None}  # fmt: skip
    commands[("uname", "-r")] = (0, "6.1.0-50-amd64")
    commands[("dpkg-query", "-W", "-f=${Status}", "drv")] = (0, "install ok installed")
    for name in ("nvidia", "nvidia-uvm", "nvidia-modeset"):
        path = f"/lib/modules/6.1.0-50-amd64/kernel/nvidia-570srv/{name}.ko.standin"
        commands[("dpkg-query", "-S", path)] = (0, f"mods-6.1.0-50-amd64: {path}")
    checks = {c["name"]: c for c in nodecheck.check_gpu(root, gpu)}
    assert checks["gpu/packages"]["ok"] and checks["gpu/kernel-modules"]["ok"], checks
    # a DKMS build (a module no package owns), DKMS installed, another kernel: each fails
    del commands[
        ("dpkg-query", "-S", "/lib/modules/6.1.0-50-amd64/kernel/nvidia-570srv/nvidia-uvm.ko.standin")
    ]
    commands[("dpkg-query", "-W", "-f=${Status}", "dkms")] = (0, "install ok installed")
    checks = {c["name"]: c for c in nodecheck.check_gpu(root, gpu)}
    assert "not from a package: nvidia_uvm" in checks["gpu/kernel-modules"]["detail"]
    assert "dkms is installed" in checks["gpu/packages"]["detail"]
    commands[("uname", "-r")] = (0, "6.1.0-51-amd64")
    checks = {c["name"]: c for c in nodecheck.check_gpu(root, gpu)}
    assert "missing nvidia, nvidia_uvm, nvidia_modeset" in checks["gpu/kernel-modules"]["detail"]


@pytest.mark.parametrize(
    ("client", "answers", "ok"),
    [
        (
            "systemd-timesyncd",
            {("timedatectl", "show", "-p", "NTPSynchronized", "--value"): (0, "yes")},
            True,
        ),
        (
            "systemd-timesyncd",
            {("timedatectl", "show", "-p", "NTPSynchronized", "--value"): (0, "no")},
            False,
        ),
        (
            "chrony",
            {
                ("chronyc", "-n", "tracking"): (
                    0,
                    "Reference ID    : 7F000001 (127.0.0.1)\nLeap status     : Normal",
                )
            },
            True,
        ),
        (
            "chrony",
            {
                ("chronyc", "-n", "tracking"): (
                    0,
                    "Reference ID    : 00000000 ()\nLeap status     : Not synchronised",
                )
            },
            False,
        ),
    ],
)
def test_a_served_clock_must_have_synchronised(
    tmp_path: Path, commands: dict[tuple[str, ...], tuple[int, str]], client: str,
    answers: dict[tuple[str, ...], tuple[int, str]], ok: bool,
) -> None:  # fmt: skip
    """When the boot test served the guest time, node/time-sync fails a client that did not synchronise,
    and one whose systemd-time-wait-sync never finished."""
    unit = "chrony.service" if client == "chrony" else "systemd-timesyncd.service"
    host = {
        **HOST,
        "time_sync": {"client": client, "unit": unit, "release_file": "/x", "servers": ["127.0.0.1"]},
    }
    commands[("systemctl", "is-enabled", unit)] = (0, "enabled")
    commands[("systemctl", "is-active", unit)] = (0, "active")
    commands[("systemctl", "is-enabled", "systemd-time-wait-sync.service")] = (0, "enabled")
    commands[("systemctl", "is-active", "systemd-time-wait-sync.service")] = (0, "active")
    commands.update(answers)
    check = next(c for c in nodecheck.check_host(_root(tmp_path), host) if c["name"] == "node/time-sync")
    assert check["ok"] is ok, check
    assert f"synchronised with 127.0.0.1: {'yes' if ok else 'NO'}" in check["detail"]
    if ok:  # the wait for the clock that never ended fails it too
        commands[("systemctl", "is-active", "systemd-time-wait-sync.service")] = (3, "activating")
        check = next(
            c for c in nodecheck.check_host(_root(tmp_path / "again"), host) if c["name"] == "node/time-sync"
        )
        assert not check["ok"], check
