"""The shipped systemd unit and kubelet drop-in: every directive the agent relies on, and systemd's own verdict."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import agent.errors
from agent import systemd
from tests.systemd.conftest import Unit, parse_unit

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def one(unit: Unit, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key)
    assert values, f"[{section}] {key}= is missing"
    assert len(values) == 1, f"[{section}] {key}= is set {len(values)} times"
    return values[0]


def words(unit: Unit, section: str, key: str) -> set[str]:
    return {w for v in unit.get(section, {}).get(key, []) for w in v.split()}


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("Unit", "StartLimitIntervalSec", "1h"),
        ("Unit", "StartLimitBurst", "10"),
        ("Service", "Type", "oneshot"),
        ("Service", "RemainAfterExit", "yes"),
        ("Service", "ExecStart", "/opt/nodeagent/venv/bin/nodeagent run"),
        ("Service", "TimeoutStartSec", "30min"),
        ("Service", "Restart", "on-failure"),
        ("Service", "RestartSec", "30s"),
        ("Service", "RestartSteps", "5"),
        ("Service", "RestartMaxDelaySec", "10min"),
        ("Service", "NotifyAccess", "main"),
        ("Service", "SyslogIdentifier", "nodeagent"),
        ("Service", "StateDirectory", "nodeagent"),
        ("Service", "StateDirectoryMode", "0700"),
        ("Service", "RuntimeDirectory", "nodeagent"),
        ("Service", "RuntimeDirectoryMode", "0700"),
        ("Service", "UMask", "0077"),
        ("Service", "NoNewPrivileges", "yes"),
        ("Service", "PrivateTmp", "yes"),
        ("Service", "ProtectHome", "yes"),
        ("Install", "WantedBy", "multi-user.target"),
    ],
)
def test_required_directives(unit: Unit, section: str, key: str, value: str) -> None:
    assert one(unit, section, key) == value


def test_ordering_and_wants(unit: Unit) -> None:
    assert {"network-online.target", "time-sync.target"} <= words(unit, "Unit", "After")
    assert "network-online.target" in words(unit, "Unit", "Wants")


ORDERING = ("Before", "After", "Requires", "Requisite", "BindsTo", "PartOf", "Upholds")


def test_no_ordering_edge_between_the_agent_and_kubelet(unit: Unit, dropin: Unit) -> None:
    """kubeadm join (inside our start job) runs `systemctl restart kubelet` and waits for it.

    Any Before=/After= between the two units (in either file) would make kubelet's start job wait
    for ours, which waits for kubeadm: a deadlock until TimeoutStartSec. The drop-in keeps kubelet
    off before the join with a condition instead.
    """
    for key in ORDERING:
        assert "kubelet.service" not in words(unit, "Unit", key), f"nodeagent.service {key}=kubelet.service"
        assert "nodeagent.service" not in words(dropin, "Unit", key), (
            f"kubelet drop-in {key}=nodeagent.service"
        )
    assert one(dropin, "Unit", "ConditionPathExists") == "/var/lib/kubelet/config.yaml"
    assert set(dropin) == {"Unit"}  # the drop-in changes nothing else about kubelet


def test_the_unit_agrees_with_the_agent_defaults(unit: Unit) -> None:
    """Paths and time limits in the unit are the ones the agent uses by default."""
    from agent.config import AgentConfig
    from agent.state import AFTER_JOIN_MARKER, JOINED_MARKER

    config = AgentConfig()
    assert Path(config.join_config).parent == Path("/run") / one(unit, "Service", "RuntimeDirectory")
    assert Path(config.state_dir) == Path("/var/lib") / one(unit, "Service", "StateDirectory")
    # Not joined, or joined with the stage after the join unfinished (agent.after_join): either suffices.
    assert unit["Unit"]["ConditionPathExists"] == [
        f"|!{Path(config.state_dir) / JOINED_MARKER}",
        f"|{Path(config.state_dir) / AFTER_JOIN_MARKER}",
    ]
    # The agent gives up on its own (and exits non-zero) before systemd would kill it.
    assert config.deadline_s < 30 * 60
    assert one(unit, "Service", "TimeoutStartSec") == "30min"


def test_restart_prevention_is_the_tables_permanent_exit_statuses(unit: Unit) -> None:
    """RestartPreventExitStatus= lists exactly the permanent rows of agent.errors.EXIT_STATUSES."""
    from agent.errors import EXIT_STATUSES

    permanent = {str(e.code) for e in EXIT_STATUSES if e.permanent}
    assert words(unit, "Service", "RestartPreventExitStatus") == permanent
    # Before the one table, permanent refusals (no TPM, banned, policy) exited 3, 6 or 8 and were
    # restarted for ever: each must be listed now.
    assert permanent >= {"2", "3", "5", "6", "8", "10", "11"}
    # And no transient status may be: those are the failures a restart can fix.
    transient = {str(e.code) for e in EXIT_STATUSES if not e.permanent}
    assert not words(unit, "Service", "RestartPreventExitStatus") & transient


def test_every_permanent_error_class_stops_the_restarts(unit: Unit) -> None:
    """Each permanent AgentError exits with a status the unit does not restart, each transient one with one it does."""
    prevented = {int(w) for w in words(unit, "Service", "RestartPreventExitStatus")}
    classes = [
        c
        for _, c in inspect.getmembers(agent.errors, inspect.isclass)
        if issubclass(c, agent.errors.AgentError) and c.__module__ == "agent.errors"
    ]
    for cls in classes:
        assert (cls.exit_code in prevented) == cls.permanent, cls.__name__


def test_units_are_vendor_files() -> None:
    """Packaged units go to /usr/lib/systemd/system; /etc/systemd/system is the administrator's."""
    for name, installed in systemd.FILES.items():
        assert installed.startswith("/usr/lib/systemd/system/"), installed
        assert installed.endswith(name)
        text = systemd.read(name)
        assert installed in text, f"{name}'s comment should say where it is installed"
        assert "/etc/systemd/system/" + name not in text


@pytest.mark.parametrize(
    "forbidden",
    ["User", "DynamicUser", "ProtectSystem", "PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock",
     "ProtectKernelLogs", "ProtectKernelModules", "MemoryDenyWriteExecute", "PrivateNetwork",
     "CapabilityBoundingSet", "WatchdogSec", "ProtectControlGroups"],
)  # fmt: skip
def test_no_hardening_that_breaks_tpm_gpu_or_kubeadm(unit: Unit, forbidden: str) -> None:
    assert forbidden not in unit["Service"], (
        f"{forbidden}= would break the TPM, the GPU checks or kubeadm join"
    )
    text = systemd.read("nodeagent.service")
    assert forbidden in text, f"the unit's comments should say why {forbidden}= is not used"


def test_address_families_cover_what_the_agent_uses(unit: Unit) -> None:
    # gRPC over TCP (v4/v6), sd_notify and containerd (unix), kubeadm's interface discovery (netlink).
    assert words(unit, "Service", "RestrictAddressFamilies") == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }


def test_every_shipped_file_is_readable_as_package_data() -> None:
    for name in systemd.FILES:
        assert systemd.read(name).strip()
    with pytest.raises(KeyError):
        systemd.read("../errors.py")


# -- systemd's own verdict -------------------------------------------------------------


def _systemd_version() -> int:
    assert SYSTEMD_ANALYZE is not None
    out = subprocess.run([SYSTEMD_ANALYZE, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.match(r"systemd (\d+)", out)
    assert match, out
    return int(match.group(1))


# Keys newer than the host's systemd: allowed to be reported as unknown, nothing else is.
_NEWER_KEYS = {"RestartSteps": 254, "RestartMaxDelaySec": 254}


@pytest.mark.subprocess
def test_systemd_analyze_verify(unit_root: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        # No systemd tools here: fall back to a strict syntax check of both files.
        for name in systemd.FILES:
            parsed = parse_unit(systemd.read(name))
            assert parsed and set(parsed) <= {"Unit", "Service", "Install"}
        return
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={unit_root}", "nodeagent.service", "kubelet.service"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    version = _systemd_version()
    allowed = [f"Unknown key '{k}'" for k, since in _NEWER_KEYS.items() if version < since]
    unexpected = [
        line for line in result.stderr.splitlines() if line.strip() and not any(a in line for a in allowed)
    ]
    assert unexpected == [], "\n".join(unexpected)


@pytest.mark.subprocess
def test_systemd_analyze_security_sees_the_hardening(unit_root: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        assert {"NoNewPrivileges", "PrivateTmp", "ProtectHome"} <= set(
            parse_unit(systemd.read("nodeagent.service"))["Service"]
        )
        return
    result = subprocess.run(
        [
            SYSTEMD_ANALYZE,
            "security",
            "--offline=yes",
            f"--root={unit_root}",
            "--json=short",
            "nodeagent.service",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    checks = {c["json_field"]: c["set"] for c in json.loads(result.stdout)}
    for field in (
        "NoNewPrivileges",
        "PrivateTmp",
        "ProtectHome",
        "ProtectKernelTunables",
        "RestrictSUIDSGID",
        "RestrictRealtime",
        "LockPersonality",
        "UMask",
        "NotifyAccess",
    ):
        assert checks.get(field) is True, f"systemd does not see {field} as set: {checks.get(field)!r}"
    assert checks.get("RestrictAddressFamilies_AF_PACKET") is True
