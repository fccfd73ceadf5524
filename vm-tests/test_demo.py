"""The whole chain of one racked server, in one run of ``make demo --ipxe`` on the session's incremental build.

``scripts/demo.py --image FOLDER --build-key PUB --ipxe``: a rack in a network namespace (a real control plane
at the pool's Kubernetes version, nodeserver with the ``kubernetes`` token backend, chronyd, the release
server); ``imagebuilder release`` of the build; a VM with OVMF (its own NVRAM), an swtpm TPM and two empty
disks netboots through Debian's iPXE ROM into the imager, which writes the verified image to the disk the
release's hint names and creates the boot entry; the firmware then boots that entry, cloud-init applies the
node-pool release, and ``nodeagent.service`` attests, checks (every node check fatal), quotes the boot,
switches Kubernetes to the pool's version and joins with the real kubeadm; the kubelet's Node becomes Ready.

This one boot carries the assertions of issue 13's chain (each hop from its own evidence: the release
server's log, the imager's events, the disk, the NVRAM, the console), issue 14's measured boot (the PCRs
the server compared), issue 15's node (the fatal checks, the staged version switch, the held packages) and
issue 17's real join (the Node Ready with the pool's labels and taint, the token revoked in the cluster).
It is also the only boot of the incremental build (built with --no-test).
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
from conftest import Build

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
from demo_common import leaked_tokens  # noqa: E402

from imager.gpt import read_gpt  # noqa: E402

TARGET, OTHER = "NODE0TARGET", "NODE1OTHER"
VERSION = "1.35.3"  # the pool's: the image installs 1.36.3 and stages 1.35.3


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
        out, _ = proc.communicate(timeout=3000)
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # the demo stops its VM, TPM, servers and namespace on SIGTERM
        proc.communicate(timeout=300)
        raise
    print(
        "\n"
        + "\n".join(
            line for line in out.splitlines() if re.match(r"demo: |  provisioned in|  the Node is", line)
        )
    )
    kept = re.search(r"^demo: kept (\S+)$", out, re.MULTILINE)
    assert kept, f"the demo did not say which folder it kept:\n{out[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), Path(kept.group(1))


def _audit(work: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (work / "server" / "data" / "audit.jsonl").read_text().splitlines()]


def test_ipxe_imager_first_boot_attest_and_join_a_real_cluster(incremental_build: Build) -> None:
    assert incremental_build.key is not None
    result, work = _demo("--image", str(incremental_build.folder), "--build-key", str(incremental_build.key),
                         "--ipxe", "--keep")  # fmt: skip
    try:
        assert result.returncode == 0, f"the demo failed ({result.returncode}):\n{result.stdout[-10000:]}"
        release = next(p for p in (work / "releases").iterdir() if p.is_dir())
        manifest = json.loads((release / "release.json").read_text())

        # -- the boot path, in order, from the release server's own log
        served = json.loads((work / "release-server.json").read_text())
        gets = [path for method, path, _range in served["requests"] if method == "GET"]
        name = f"/{release.name}"
        assert gets[:4] == [
            f"{name}/entry.ipxe",
            f"{name}/boot.ipxe",
            f"{name}/imager.vmlinuz",
            f"{name}/imager.initrd",
        ]
        image = manifest["images"][0]
        assert (
            gets.index(f"{name}/signature.dsse.json")
            < gets.index(f"{name}/release.json")
            < gets.index(f"{name}/{image['name']}")
        )  # the signature is checked before any digest is trusted, the digests before the image
        provisioning = (work / "server-vm" / "provision.console.log").read_text(errors="replace")
        # Debian's iPXE has no digest commands: the script says so, and the imager's init brought the NIC up
        assert (
            "nodetrust: this iPXE has no sha256sum" in provisioning
            and "nodeimager-boot: network up on" in provisioning
        )
        # -- the imager's own account, POSTed to the release's events URL
        events = served["events"]
        assert [e["event"] for e in events] == [
            "verified",
            "disk-chosen",
            "written",
            "boot-entry",
            "done",
        ], events
        assert events[0]["signer"] == manifest["boot"]["key"].removeprefix("sha256:")
        assert events[1]["disk"]["serial"] == TARGET and f"virtio-{TARGET}" in events[1]["disk"]["by_id"]
        assert events[2]["sha256"] == image["sha256"]
        # verified in the boot environment with the release's signed BLAKE3
        assert events[2]["digest"] == "blake3"
        # -- the disks: the image's partitions compared byte for byte before the first boot (qemu-img compare),
        # a sound GPT with the backup at the end, the pool's cloud-init in the seed, the other disk untouched
        assert (work / "compare.txt").read_text().startswith("exit 0\n"), (work / "compare.txt").read_text()
        target, other = work / "server-vm" / "target.img", work / "server-vm" / "other.img"
        sgdisk = subprocess.run(["sgdisk", "-v", str(target)], capture_output=True, text=True, check=False)
        assert sgdisk.returncode == 0 and "No problems found" in sgdisk.stdout, sgdisk.stdout
        table = read_gpt(target)
        esp, seed = table.esp(), table.entries[-1]
        assert esp is not None and not table.problems
        user_data = subprocess.run(["mtype", "-i", f"{target}@@{seed.offset}", "::user-data"], capture_output=True,
                                   check=True).stdout  # fmt: skip
        assert user_data == (release / "worker.user-data").read_bytes()
        with other.open("rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(-(1 << 20), os.SEEK_END)
            assert not any(head) and not any(fh.read()), "the other disk was written"
        # -- the boot entry in the server's NVRAM, and the firmware taking it at the next power-on
        nvram = (work / "server-vm" / "OVMF_VARS.fd").read_bytes()
        assert f"nodetrust {release.name}".encode("utf-16-le") in nvram and esp.part_guid.bytes_le in nvram
        console = (work / "server-vm" / "node.console.log").read_text(errors="replace").replace("\r", "")
        number = events[3]["number"]
        assert f'BdsDxe: loading {number} "nodetrust {release.name}" from HD({esp.number},GPT,' in console

        # -- attestation and the join, from the server's audit log
        audit = _audit(work)
        attests = [e for e in audit if e["event"] == "attest"]
        assert attests and all(e["result"] == "ok" for e in attests), attests
        assert {e["ek_trust"] for e in attests} == {"ca"}  # the manufactured EK certificate, via the EK CA
        assert attests[0]["spiffe_id"].startswith("spiffe://demo.nodetrust.test/spire/agent/tpm/")
        joins = [e for e in audit if e["event"] == "join"]
        assert len(joins) == 1, joins
        join = joins[0]
        assert (join["result"], join["node_name"], join["pool"], join["verdict"]) == (
            "ok",
            "demo-node-1",
            "cpu",
            "pass",
        )
        # every node check fatal as the cpu preset has it, and every one passed: none only warned
        assert join["warned_checks"] == [], join
        for rule in ("time_sync", "swap", "kernel_modules", "sysctl", "cgroup", "container_runtime", "network",
                     "disk", "kubelet"):  # fmt: skip
            assert any(c == f"node.{rule}" or c.startswith(f"node.{rule}.") for c in join["passed_checks"]), (
                rule, join["passed_checks"],
            )  # fmt: skip
        # the pool admits only the build's boot: the quote over the broker's nonce, the event log replayed
        assert join["release"] == incremental_build.folder.name, join
        assert (join["checked_pcrs"], join["unchecked_pcrs"]) == ([4, 8, 9], [0, 1, 2, 3, 5, 6, 7]), join
        joined = [e for e in audit if e["event"] == "joined"]
        assert [(e["reason"], e["token_id"], e["token_revoked"]) for e in joined] == [
            ("token_revoked", join["token_id"], True)
        ], joined

        # -- the Node, as the API server had it when it became Ready
        node = json.loads((work / "node.json").read_text())
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["status"]["conditions"]
        labels = node["metadata"]["labels"]
        assert (labels["nodetrust.io/pool"], labels["nodetrust.io/demo"], labels["example.com/rack"]) == (
            "cpu",
            "true",
            "r1",
        )
        assert node["spec"]["taints"] == [
            {"key": "example.com/dedicated", "value": "demo", "effect": "NoSchedule"}
        ]
        # the staged version switch: the image installs 1.36.3, the pool's cluster runs 1.35.3
        assert node["status"]["nodeInfo"]["kubeletVersion"] == f"v{VERSION}"
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        built = json.loads((incremental_build.folder / "manifest.json").read_text())
        assert built["kubernetes"]["installed"] == "1.36.3" and VERSION in built["kubernetes"]["staged"]

        # -- the node's disk after power-off: the agent's state, the packages installed and held
        kept = json.loads((work / "kept.json").read_text())
        assert kept["state"]["kubernetes_version"] == VERSION and kept["joined_marker"], kept["state"]
        for package in ("kubeadm", "kubelet", "kubectl"):
            assert kept["packages"][package]["version"] == f"{VERSION}-1.1", kept["packages"]
            assert kept["packages"][package]["status"].startswith("hold "), kept["packages"]
        journal = (work / "journal.txt").read_text(errors="replace")
        assert "kubeadm join succeeded" in journal, journal[-4000:]

        # -- the workload identity: after the join the agent enrolled a DevID with nodeserver and started the image's
        # spire-agent, which attested to the stock spire-server with tpm_devid through the node's kernel TPM
        issued = [e for e in audit if e["event"] == "devid"]
        assert [e["result"] for e in issued] == ["ok"], issued
        spire = json.loads((work / "spire-agents.json").read_text())
        assert [(a["attestation_type"], a["id"]["path"]) for a in spire] == [
            ("tpm_devid", issued[0]["devid_agent_id"].split("demo.nodetrust.test", 1)[1])
        ], spire
        selectors = {f"{s['type']}:{s['value']}" for s in spire[0]["selectors"]}
        assert f"tpm_devid:subject:cn:{attests[0]['ek_hash']}" in selectors, (
            selectors
        )  # the machine, by its EK
        assert kept["state"]["after_join"]["step"] == "done", kept["state"]

        # -- no whole token of the issued id in any log: the demo's output, the consoles, the server, the journal
        logs = [result.stdout, journal, (work / "server.log").read_text(errors="replace")]
        logs += [p.read_text(errors="replace") for p in (work / "server-vm").glob("*.console.log")]
        for text in logs:
            assert not leaked_tokens(text, {join["token_id"]})
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


def test_the_boot_environments_own_python_loads_the_pinned_blake3() -> None:
    """The blake3 wheel the lock pins works with the boot environment's Debian Python 3.11, glibc and libgcc_s:
    ``initrd.img`` unpacked and entered with chroot (about 1 s once the boot environment is built; it runs before
    the demo, which needs every peer, and builds the boot environment the demo then reuses)."""
    from imagebuilder.bootenv import recipe
    from tests.support.bootenv import imager_bootenv, run_in_bootenv

    folder = imager_bootenv()
    wheels = json.loads((folder / "bootenv.json").read_text())["wheels"]
    assert [f"{w['name']}=={w['version']}" for w in wheels] == list(recipe.WHEELS)
    program = "import blake3; print(blake3.blake3(b'').hexdigest())"
    result = run_in_bootenv(folder, ["/usr/bin/python3", "-c", program])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
