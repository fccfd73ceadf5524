"""``make demo``'s pieces that need no VM (its relay: tests/imagebuilder/test_relay.py): the seed it boots
with, the image's kubeadm stand-in, the Ubuntu ISO check and the host's verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import demo  # noqa: E402
from demo_common import DemoError  # noqa: E402

from agent.kubeadm import join_configuration, write_join_config  # noqa: E402


def test_the_seed_configures_the_agent_with_root_only_files_and_no_secret() -> None:
    text = demo.user_data(bundle=b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
                          kubeadm_path="/usr/local/sbin/nodetrust-demo-kubeadm")  # fmt: skip
    assert text.startswith("#cloud-config\n")
    cloud = yaml.safe_load(text)
    files = {f["path"]: f for f in cloud["write_files"]}
    # the time servers, as a node-pool release writes them (world-readable, as systemd's own drop-ins)
    timesyncd = files.pop(demo.TIMESYNCD_DROP_IN)
    assert (timesyncd["content"], timesyncd["permissions"]) == ("[Time]\nNTP=127.0.0.1\n", "0644")
    assert {f["permissions"] for f in files.values()} <= {"0600", "0700"}
    config = yaml.safe_load(files["/run/nodetrust-demo/config.yaml"]["content"])
    assert config["server"] == "127.0.0.1:8081" and config["join_server"] == "127.0.0.1:8082"
    assert config["tcti"] == "device:/dev/tpmrm0" and config["pool"] == "cpu"
    from agent.config import SETTINGS

    assert set(config) <= {s.key for s in SETTINGS}  # the agent refuses unknown keys
    # the relay to the host's services starts first (bootcmd), so the boot's wait for the clock ends as a
    # racked node's does: nothing is masked
    (relay_start,) = cloud["bootcmd"]
    assert relay_start[2].endswith("10.0.2.100:8080 --tcp 8081 --tcp 8082 --udp 123 --default-route")
    assert "mask --runtime" not in text
    assert cloud["runcmd"] == [
        [demo.VENV_PYTHON, "/run/nodetrust-demo/guest.py", "run", "/run/nodetrust-demo"]
    ]


def _join_doc(**change: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "token": "abcdef.0123456789abcdef",
        "api_server_endpoint": "192.0.2.10:6443",
        "ca_cert_hashes": ["sha256:" + "a" * 64],
        "node_name": "demo-node-1",
        "taints": [],
        "labels": {"nodetrust.io/pool": "cpu"},
    }
    return join_configuration(**{**inputs, **change})


def _stand_in(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    record = tmp_path / "record.jsonl"
    code = (
        f"import sys, pathlib; sys.path.insert(0, {str(SCRIPTS)!r}); import demo_guest;"
        f"demo_guest.RECORD = pathlib.Path({str(record)!r}); sys.exit(demo_guest.main(sys.argv[1:]))"
    )
    result = subprocess.run([sys.executable, "-c", code, "kubeadm", *argv], capture_output=True, text=True,
                            check=False, timeout=60)  # fmt: skip
    return result, [json.loads(line) for line in record.read_text().splitlines()]


def test_the_kubeadm_stand_in_accepts_the_agents_join_configuration_and_redacts_the_token(
    tmp_path: Path,
) -> None:
    path = tmp_path / "join.yaml"
    write_join_config(path, _join_doc())
    result, calls = _stand_in(tmp_path, "join", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "This node has joined the cluster" in result.stdout
    assert calls[0]["valid"] and calls[0]["mode"] == "0600"
    assert calls[0]["config"]["discovery"]["bootstrapToken"]["token"] == "abcdef.<redacted>"
    assert "0123456789abcdef" not in json.dumps(calls)
    assert demo.validate_join_configuration(calls[0]["config"]) == []


def test_the_kubeadm_stand_in_refuses_what_kubeadm_would(tmp_path: Path) -> None:
    path = tmp_path / "join.yaml"
    write_join_config(path, _join_doc())
    path.chmod(0o644)
    result, calls = _stand_in(tmp_path, "join", "--config", str(path))
    assert result.returncode == 1 and "must be 0600" in result.stderr
    doc = _join_doc()
    doc["discovery"]["bootstrapToken"]["caCertHashes"] = []
    doc["nodeRegistration"]["name"] = "Not_A_Name"
    write_join_config(path, doc)
    result, calls = _stand_in(tmp_path, "join", "--config", str(path))
    assert result.returncode == 1
    assert any("caCertHashes" in e for e in calls[-1]["errors"])
    assert any("DNS-1123" in e for e in calls[-1]["errors"])
    result, calls = _stand_in(tmp_path, "join", "--token", "x")
    assert result.returncode == 1 and "only takes `join --config FILE`" in result.stderr


def test_ubuntu_iso_must_be_an_iso_9660_image(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match=r"no such file; set UBUNTU_ISO to the Ubuntu 24\.04"):
        demo.check_ubuntu_iso(str(tmp_path / "missing.iso"))
    junk = tmp_path / "junk.iso"
    junk.write_bytes(b"\0" * 40000)
    with pytest.raises(DemoError, match="is not an ISO 9660 image"):
        demo.check_ubuntu_iso(str(junk))
    iso = tmp_path / "ok.iso"
    iso.write_bytes(b"\0" * 0x8001 + b"CD001" + b"\0" * 100)
    assert demo.check_ubuntu_iso(str(iso)) == iso.resolve()


def test_the_verdict_reads_the_servers_records(tmp_path: Path) -> None:
    tokens = tmp_path / "server" / "tokens"
    tokens.mkdir(parents=True)
    guest = demo.GuestSteps(4)
    for name in ("attest", "check", "join"):
        guest.entries.append({"name": name, "ok": True})
    config = json.loads(json.dumps(_join_doc()).replace("0123456789abcdef", "<redacted>"))
    packages = dict.fromkeys(("kubeadm", "kubelet", "kubectl"), "1.35.3-1.1")
    beside: dict[str, Any] = {
        "kubelet_version": "Kubernetes v1.35.3",
        "packages": packages,
        "held": ["kubeadm", "kubectl", "kubelet"],
    }
    call = {"config": config, **beside}
    guest.entries.append({"name": "kubeadm", "ok": True, "calls": [call]})
    guest.done = {"done": True, "ok": True}

    def verdict(logs: list[Path]) -> list[str]:
        return demo.verdict(tmp_path, audit, guest, logs, kubernetes_version="1.35.3")

    # the node says it joined, but the server issued nothing: the verdict fails
    problems = demo.verdict(tmp_path, [], guest, [], kubernetes_version="1.35.3")
    assert any("no successful attestation" in p for p in problems)
    assert any("no successful join of demo-node-1" in p for p in problems)
    audit: list[dict[str, Any]] = [
        {"event": "attest", "result": "ok", "ek_trust": "ca"},
        {"event": "join", "result": "ok", "node_name": "demo-node-1", "pool": "cpu", "token_id": "abcdef"},
    ]
    (tokens / "bootstrap-token-abcdef.yaml").write_text(
        "stringData:\n  token-id: abcdef\n  token-secret: 0123456789abcdef\n"
    )
    log = tmp_path / "console.log"
    log.write_text("nothing secret\n")
    # issued, but never revoked by the node's report: its manifest is still in the folder
    assert any("must revoke the token it used" in p for p in verdict([log]))
    audit.append({"event": "joined", "result": "ok", "token_id": "abcdef", "token_revoked": True})
    assert any("still has ['abcdef']" in p for p in verdict([log]))
    (tokens / "bootstrap-token-abcdef.yaml").unlink()
    assert verdict([log]) == []
    # with the manifest gone, the token of the issued id in clear in any log is still found
    log.write_text("oops abcdef.0123456789abcdef\n")
    assert any("appears in" in p for p in verdict([log]))
    log.write_text("token abcdef.<redacted>; xabcdef.0123456789abcdef0 is not it\n")
    assert verdict([log]) == []
    # kubeadm must have run beside the join answer's version, installed and held
    call["kubelet_version"] = "Kubernetes v1.36.3"
    assert any("not the pool's v1.35.3" in p for p in verdict([log]))
    call.update(beside, packages={**packages, "kubectl": "1.36.3-1.1"})
    assert any("not 1.35.3" in p for p in verdict([log]))
    call.update(beside, held=["kubelet"])
    assert any("not all held" in p for p in verdict([log]))
    call.update(beside)
    assert verdict([log]) == []


def test_the_demos_control_plane_is_a_minor_behind_when_the_image_stages_one() -> None:
    from demo_common import demo_kubernetes_version

    assert (
        demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.34.2", "1.35.3", "1.37.2"]})
        == "1.35.3"
    )
    assert demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.35.1", "1.35.10"]}) == "1.35.10"
    assert demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.34.2", "1.37.2"]}) == "1.36.3"
    assert demo_kubernetes_version({"installed": "1.36.3"}) == "1.36.3"


def test_a_console_that_shows_a_dead_boot_stops_the_demo_at_once() -> None:
    guest = demo.GuestSteps(4)
    guest.on_console("[    0.000000] Linux version 6.1.0-50-amd64")
    for line in ("\x1b[0m\x1b[37m\x1b[40merror: invalid arch-independent ELF magic.", "grub rescue> ",
                 "[   3.2] Kernel panic - not syncing: VFS: Unable to mount root fs"):  # fmt: skip
        with pytest.raises(DemoError, match="the image does not boot"):
            guest.on_console(line)
