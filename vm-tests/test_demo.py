"""``make demo``'s VM chain on the session's incremental fixture build (``scripts/demo.py --image``): one boot,
the only one that image gets (it was built with --no-test).

The verdict comes from the server's own records (its audit log and the file token backend's
folder) and from the node's data port, not from the demo's console text: the node attested
with a CA-trusted EK, its checks passed against the CPU pool, its quote proved the build's boot,
the broker issued a token for it, kubeadm received that token in a valid JoinConfiguration from
a 0600 file, the node's report revoked it, and no whole token appears in any log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Build, domains

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from demo_common import leaked_tokens  # noqa: E402


def _demo(*args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "demo.py"), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=2400)
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # the demo removes its VM, swtpm and server on SIGTERM
        proc.communicate(timeout=300)
        raise
    print(
        "\n" + "\n".join(line for line in out.splitlines() if re.match(r"demo: |  the node ran for", line))
    )
    kept = re.search(r"^demo: kept (\S+)$", out, re.MULTILINE)
    assert kept, f"the demo did not say which folder it kept:\n{out[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), Path(kept.group(1))


def _data_port(work: Path) -> list[dict[str, Any]]:
    lines = (work / "vm" / "data.log").read_text(errors="replace").splitlines()
    return [json.loads(line.partition("NODETRUST-DEMO ")[2]) for line in lines if "NODETRUST-DEMO " in line]


def test_demo_attests_checks_and_joins_the_booted_image(incremental_build: Build) -> None:
    """The session's incremental build (its only boot: it was built with --no-test)."""
    result, work = _demo("--image", str(incremental_build.folder), "--keep")
    try:
        assert result.returncode == 0, f"the demo failed ({result.returncode}):\n{result.stdout[-8000:]}"

        audit = [json.loads(x) for x in (work / "server" / "data" / "audit.jsonl").read_text().splitlines()]
        attests = [e for e in audit if e["event"] == "attest"]
        joins = [e for e in audit if e["event"] == "join"]
        assert attests and all(e["result"] == "ok" for e in attests), attests
        assert {e["ek_trust"] for e in attests} == {"ca"}  # the manufactured EK certificate, via the EK CA
        assert attests[0]["spiffe_id"].startswith("spiffe://demo.nodetrust.test/spire/agent/tpm/")
        assert attests[0]["peer"].startswith("ipv4:127.0.0.1:")  # through the guestfwd relay
        assert len(joins) == 1, joins
        join = joins[0]
        assert (join["result"], join["node_name"], join["pool"], join["verdict"]) == (
            "ok", "demo-node-1", "cpu", "pass",
        )  # fmt: skip
        assert join["spiffe_id"] in {e["spiffe_id"] for e in attests}
        # The pool lists the build's boot-measurements.json: the booted image's quote (the agent's own TPM2_Quote
        # over BeginJoin's nonce, with the kernel's event log of the OVMF + swtpm boot) proved that release.
        assert join["release"] == incremental_build.folder.name, join
        assert (join["checked_pcrs"], join["unchecked_pcrs"]) == ([4, 8, 9], [0, 1, 2, 3, 5, 6, 7]), join

        # the node reported the join (ReportJoined): the broker revoked its token and its manifest is gone
        joined = [e for e in audit if e["event"] == "joined"]
        assert [(e["reason"], e["token_id"], e["token_revoked"]) for e in joined] == [
            ("token_revoked", join["token_id"], True)
        ], joined
        assert not list((work / "server" / "tokens").glob("*.yaml"))

        steps = {e.get("name"): e for e in _data_port(work) if "name" in e}
        assert [e for e in _data_port(work) if e.get("done")] == [{"done": True, "ok": True}]
        assert steps["boot"]["unit"]["ExecMainStatus"] == "2"  # the unconfigured first run, as shipped
        assert steps["attest"]["ok"] and steps["check"]["ok"] and steps["join"]["joined"]
        # the node's clock, synchronised with the site NTP server (chronyd on the host) through the relay, and
        # every node check fatal as the cpu preset has it: all passed (no check turned into a warning)
        assert "NTPSynchronized=yes" in steps["configure"]["output"], steps["configure"]["output"]
        # the boot waited for the clock (nothing masked): the relay ran from bootcmd, before time-sync.target
        assert "systemd-time-wait-sync.service: active" in steps["configure"]["output"]
        assert "nodetrust-relay.service: active" in steps["configure"]["output"]
        check = steps["check"]["output"]
        for rule in (
            "time_sync",
            "swap",
            "kernel_modules",
            "sysctl",
            "cgroup",
            "container_runtime",
            "disk",
            "kubelet",
        ):
            assert re.search(rf"^\s*pass\s+node\.{rule}\b", check, re.MULTILINE), f"node.{rule}:\n{check}"
        assert not re.search(r"^\s*warn\s+node\.", check, re.MULTILINE), check
        assert steps["join"]["unit"]["Result"] == "success"
        calls = steps["kubeadm"]["calls"]
        assert len(calls) == 1 and calls[0]["valid"] and calls[0]["mode"] == "0600", calls
        assert calls[0]["argv"][:2] == ["join", "--config"]
        discovery = calls[0]["config"]["discovery"]["bootstrapToken"]
        assert discovery["token"] == f"{join['token_id']}.<redacted>"
        assert discovery["apiServerEndpoint"] == "192.0.2.10:6443"
        assert calls[0]["config"]["nodeRegistration"]["name"] == "demo-node-1"
        # the pool's control plane runs 1.35.3 (the join answer's version): the image installs 1.36.3 and
        # stages 1.35.3, and the agent made the staged one the installed, held one before kubeadm ran
        manifest = json.loads((incremental_build.folder / "manifest.json").read_text())
        assert (
            manifest["kubernetes"]["installed"] == "1.36.3" and "1.35.3" in manifest["kubernetes"]["staged"]
        )
        assert "the cluster runs Kubernetes v1.35.3; the image installs 1.36.3" in result.stdout
        assert calls[0]["kubelet_version"] == "Kubernetes v1.35.3", calls[0]
        assert calls[0]["packages"] == dict.fromkeys(("kubeadm", "kubelet", "kubectl"), "1.35.3-1.1"), calls[
            0
        ]
        assert {"kubeadm", "kubelet", "kubectl"} <= set(calls[0]["held"]), calls[0]
        assert "kubernetes: 1.35.3" in steps["status"]["output"], steps["status"]

        # no whole token of the issued id (only its redacted form) in the demo's output or the node's logs
        for text in (result.stdout, *(p.read_text(errors="replace") for p in (work / "vm").glob("*.log"))):
            assert not leaked_tokens(text, {join["token_id"]})
        assert not [d for d in domains() if "-demo-" in d]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_demo_refuses_a_missing_ubuntu_iso(tmp_path: Path) -> None:
    """No VM: the real image's path stops at once, naming the variable and the ISO it wants."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py")],
        cwd=REPO,
        env={**os.environ, "UBUNTU_ISO": str(tmp_path / "missing.iso")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1
    assert f"UBUNTU_ISO={tmp_path / 'missing.iso'}: no such file" in result.stderr
    assert "ubuntu-24.04.4-live-server-amd64.iso" in result.stderr
