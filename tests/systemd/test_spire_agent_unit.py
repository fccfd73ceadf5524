"""The image's SPIRE agent unit (examples/files/spire-agent.service), shipped by both node definitions.

What it promises: the staged binary of the definition's spire-agent artifact with the release's
configuration, held back by conditions until the node agent has enrolled the DevID, the DevID files
handed over as credentials from the agent's state folder, least privilege (no root, no capability,
the TPM's resource manager as its only device), and an agent.conf in docs/attestation.md that names
exactly what the unit provides. Then systemd's own verdict (``systemd-analyze verify`` and
``security``) in a throw-away root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.config import AgentConfig
from agent.devid_client import DevidFiles
from imagebuilder.definition import load_definition
from tests.systemd.conftest import Unit, parse_unit

REPO = Path(__file__).resolve().parents[2]
UNIT_PATH = "/usr/lib/systemd/system/spire-agent.service"
DEFINITIONS = ("examples/fixture-node.yaml", "examples/ubuntu-2404-node.yaml")
SOURCE = REPO / "examples" / "files" / "spire-agent.service"
CONFIG = "/etc/spire/agent/agent.conf"
CREDENTIALS = "/run/credentials/spire-agent.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(SOURCE.read_text())


def _definition(name: str) -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load((REPO / name).read_text())
    return data


@pytest.mark.parametrize("name", DEFINITIONS)
def test_each_node_definition_ships_and_enables_the_unit(name: str) -> None:
    defn = load_definition(REPO / name, environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"})
    assert defn.node.host is not None
    shipped = {f.path: f for f in defn.node.host.files}
    assert shipped[UNIT_PATH].content == SOURCE.read_bytes()
    assert shipped[UNIT_PATH].mode == "0644" and shipped[UNIT_PATH].owner == "root:root"
    assert "spire-agent.service" in defn.node.host.enable


@pytest.mark.parametrize("name", DEFINITIONS)
def test_it_runs_the_binary_the_definition_stages(unit: Unit, name: str) -> None:
    artifacts = {a["name"]: a for a in _definition(name)["artifacts"]}  # type: ignore[attr-defined]
    spire = artifacts["spire-agent"]
    # The upstream tarball (spire-<v>/bin/spire-agent) unpacked with one component stripped.
    assert spire["strip_components"] == 1
    binary = f"{spire['destination'].rstrip('/')}/bin/spire-agent"
    assert unit["Service"]["ExecStart"] == [f"{binary} run -config {CONFIG}"]
    assert f"/{spire['version']}/" in binary


def test_it_waits_for_the_release_config_and_the_devid(unit: Unit) -> None:
    devid = DevidFiles(AgentConfig().devid_path)
    assert unit["Unit"]["ConditionPathExists"] == [CONFIG, str(devid.cert_path)]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert unit["Service"]["Restart"] == ["on-failure"]
    assert unit["Unit"]["StartLimitIntervalSec"] == ["0"]
    assert {"network-online.target", "time-sync.target"} <= set(unit["Unit"]["After"][0].split())
    # No ordering on nodeagent.service: the agent starts this unit from inside its own start job.
    assert not any(
        "nodeagent" in v for key in ("After", "Before", "Requires") for v in unit["Unit"].get(key, [])
    )


def test_the_devid_files_are_handed_over_as_credentials(unit: Unit) -> None:
    """The agent's default devid_dir, file by file, under the names agent.conf reads."""
    devid = DevidFiles(AgentConfig().devid_path)
    assert unit["Service"]["LoadCredential"] == [
        f"{p.name}:{p}" for p in (devid.cert_path, devid.priv_path, devid.pub_path)
    ]


def test_least_privilege(unit: Unit) -> None:
    service = unit["Service"]
    assert service["DynamicUser"] == ["yes"] and "User" not in service
    assert service["SupplementaryGroups"] == ["tss"]  # /dev/tpmrm0 is root:tss 0660 (tpm-udev)
    assert service["CapabilityBoundingSet"] == [""] and service["AmbientCapabilities"] == [""]
    assert service["DevicePolicy"] == ["closed"] and service["DeviceAllow"] == ["/dev/tpmrm0 rw"]
    assert "PrivateDevices" not in service, "it would hide the TPM"
    assert "ProtectProc" not in service, "the unix workload attestor reads the callers' /proc entries"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname",
                "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
                "MemoryDenyWriteExecute"):  # fmt: skip
        assert service[key] == ["yes"], key
    assert service["ProtectSystem"] == ["strict"]
    assert set(service["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert service["StateDirectory"] == ["spire-agent"] and service["RuntimeDirectory"] == ["spire-agent"]
    assert service["RuntimeDirectoryMode"] == ["0755"]  # workloads reach the socket below it


# -- the agent.conf a node-pool release writes (docs/attestation.md) -------------------------------------


def documented_agent_conf() -> str:
    text = (REPO / "docs" / "attestation.md").read_text()
    section = text.split("## After the join: the DevID and the SPIRE agent", 1)[1]
    match = re.search(r"```hcl\n(# /etc/spire/agent/agent\.conf.*?)```", section, re.S)
    assert match, "docs/attestation.md has no agent.conf example in its section on the SPIRE agent"
    return match.group(1)


def test_the_documented_agent_conf_names_what_the_unit_provides(unit: Unit) -> None:
    conf = documented_agent_conf()
    devid = DevidFiles(AgentConfig().devid_path)
    for key, path in (("devid_cert_path", devid.cert_path), ("devid_priv_path", devid.priv_path),
                      ("devid_pub_path", devid.pub_path)):  # fmt: skip
        assert re.search(rf'^\s*{key}\s*=\s*"{CREDENTIALS}/{path.name}"\s*$', conf, re.M), key
    assert re.search(r'^\s*tpm_device_path\s*=\s*"/dev/tpmrm0"\s*$', conf, re.M)
    assert re.search(r'NodeAttestor\s+"tpm_devid"', conf)
    state, runtime = unit["Service"]["StateDirectory"][0], unit["Service"]["RuntimeDirectory"][0]
    assert re.search(rf'^\s*data_dir\s*=\s*"/var/lib/{state}"\s*(#.*)?$', conf, re.M)
    assert re.search(rf'^\s*socket_path\s*=\s*"/run/{runtime}/public/api\.sock"\s*(#.*)?$', conf, re.M)
    bundle = re.search(r'^\s*trust_bundle_path\s*=\s*"([^"]+)"\s*(#.*)?$', conf, re.M)
    assert bundle and bundle.group(1).startswith("/etc/spire/agent/")  # readable under ProtectSystem=strict


# -- systemd's own verdict -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spire_root(tmp_path_factory: pytest.TempPathFactory, unit: Unit) -> Path:
    """The host's units, ours where the image installs it, a stand-in binary and the release's files."""
    root = tmp_path_factory.mktemp("spire-unit-root")
    host_units = next(
        p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()
    )
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / UNIT_PATH.lstrip("/")).write_text(SOURCE.read_text())
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    binary = root / unit["Service"]["ExecStart"][0].split()[0].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(binary, 0o755)  # noqa: S103 - a stand-in executable
    (root / CONFIG.lstrip("/")).parent.mkdir(parents=True)
    (root / CONFIG.lstrip("/")).write_text(documented_agent_conf())
    return root


@pytest.mark.subprocess
def test_systemd_analyze_verify(spire_root: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        parsed = parse_unit(SOURCE.read_text())
        assert set(parsed) == {"Unit", "Service", "Install"}
        return
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={spire_root}", "spire-agent.service"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == []


@pytest.mark.subprocess
def test_systemd_analyze_security_sees_the_least_privilege(spire_root: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        pytest.skip("no systemd-analyze on this machine")  # the directives are checked above
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", f"--root={spire_root}", "--json=short",
         "spire-agent.service"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    checks = {c["json_field"]: c for c in json.loads(result.stdout)}
    for field in ("UserOrDynamicUser", "NoNewPrivileges", "AmbientCapabilities", "CapabilityBoundingSet_CAP_SYS_ADMIN",
                  "CapabilityBoundingSet_CAP_NET_ADMIN", "CapabilityBoundingSet_CAP_DAC_FOWNER_IPC_OWNER",
                  "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts", "ProtectClock", "ProtectKernelLogs",
                  "ProtectKernelModules", "ProtectKernelTunables", "RestrictNamespaces_user", "MemoryDenyWriteExecute",
                  "RestrictAddressFamilies_AF_PACKET", "RestrictAddressFamilies_AF_NETLINK", "SystemCallFilter_mount",
                  "SystemCallFilter_module"):  # fmt: skip
        assert checks[field]["set"] is True, f"systemd does not see {field} as set: {checks[field]}"
    # systemd's own exposure level (0 best, 10 worst; 2.0 with systemd 252): low for a networked daemon
    # that needs a device.
    text = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", f"--root={spire_root}", "spire-agent.service"],
        capture_output=True, text=True, timeout=60, check=False,
    ).stdout  # fmt: skip
    level = re.search(r"Overall exposure level for spire-agent\.service: (\d+\.\d+)", text)
    assert level and float(level.group(1)) < 3.0, text[-400:]
