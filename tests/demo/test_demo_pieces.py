"""``make demo``'s pieces that need no VM: the Ubuntu ISO check, the cluster's version, the node's disk read
offline, the dead-boot patterns and the verdict (the whole chain: vm-tests/test_demo.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import demo  # noqa: E402
import demo_rack  # noqa: E402
from demo_common import DemoError  # noqa: E402


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


def test_the_demos_control_plane_is_a_minor_behind_when_the_image_stages_one() -> None:
    from demo_common import demo_kubernetes_version

    assert (
        demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.34.2", "1.35.3", "1.37.2"]})
        == "1.35.3"
    )
    assert demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.35.1", "1.35.10"]}) == "1.35.10"
    assert demo_kubernetes_version({"installed": "1.36.3", "staged": ["1.34.2", "1.37.2"]}) == "1.36.3"
    assert demo_kubernetes_version({"installed": "1.36.3"}) == "1.36.3"


def test_a_console_that_shows_a_dead_boot_is_recognised() -> None:
    from tests.support.rack import BOOT_FAILURE

    for line in ("error: invalid arch-independent ELF magic.", "grub rescue> ",
                 "[   3.2] Kernel panic - not syncing: VFS: Unable to mount root fs"):  # fmt: skip
        assert BOOT_FAILURE.search(f"[    0.000000] Linux version 6.1.0\n{line}\n"), line
    # the firmware trying its network boot options first is no failure
    assert not BOOT_FAILURE.search(
        'BdsDxe: failed to load Boot0001 "UEFI PXEv4 (MAC:525400123456)": Not Found\n'
    )


DPKG_STATUS = """Package: kubeadm
Status: hold ok installed
Version: 1.35.3-1.1

Package: kubelet
Status: install ok installed
Version: 1.35.3-1.1

Package: bash
Status: install ok installed
Version: 5.2.15-2+b7
"""


@pytest.mark.subprocess  # mke2fs, sfdisk, debugfs: the node's disk read as the demo reads it
def test_the_nodes_disk_is_read_offline(tmp_path: Path) -> None:
    tree = tmp_path / "root"
    (tree / "var" / "lib" / "nodeagent").mkdir(parents=True)
    (tree / "var" / "lib" / "dpkg").mkdir(parents=True)
    (tree / "var" / "log" / "journal" / "0123abcd").mkdir(parents=True)
    (tree / "var" / "lib" / "nodeagent" / "state.json").write_text(
        '{"step": "joined", "kubernetes_version": "1.35.3"}'
    )
    (tree / "var" / "lib" / "nodeagent" / "joined").write_text("")
    (tree / "var" / "lib" / "dpkg" / "status").write_text(DPKG_STATUS)
    fs = tmp_path / "root.ext4"
    subprocess.run(["mke2fs", "-q", "-t", "ext4", "-d", str(tree), str(fs), "16M"], check=True)
    disk = tmp_path / "disk.raw"
    with disk.open("wb") as fh:
        fh.truncate(24 << 20)
    layout = "label: gpt\nstart=2048, size=2048, type=U\nstart=4096, size=32768, type=L\n"
    subprocess.run(["sfdisk", "-q", str(disk)], input=layout, text=True, check=True)
    subprocess.run(
        ["dd", f"if={fs}", f"of={disk}", "bs=512", "seek=4096", "conv=notrunc", "status=none"], check=True
    )
    read = demo_rack.NodeDisk.open(disk, "raw", tmp_path)
    assert read.offset == 4096 * 512  # the largest partition is the root
    kept = demo_rack.read_node(read, tmp_path)
    assert kept["state"] == {"step": "joined", "kubernetes_version": "1.35.3"} and kept["joined_marker"]
    assert kept["packages"] == {
        "kubeadm": {"version": "1.35.3-1.1", "status": "hold ok installed"},
        "kubelet": {"version": "1.35.3-1.1", "status": "install ok installed"},
    }
    assert kept["journal"] == ""  # a journal folder with no journal file in it
    assert read.listdir("/var/log/journal") == ["0123abcd"]
    assert read.read("/var/lib/nodeagent/absent") is None


class _Cluster:
    """The control plane's kubectl, answering what the verdict asks (a test double of ControlPlane.kubectl)."""

    def __init__(self) -> None:
        self.left = ""

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        del check
        assert args[:3] == ("-n", "kube-system", "get"), args
        return subprocess.CompletedProcess(list(args), 0, self.left, "")


class _Spire:
    """spire-server's agent list (a test double of tests.support.spire.SpireServer.agents)."""

    def __init__(self) -> None:
        self.listed: list[dict[str, Any]] = []

    def agents(self) -> list[dict[str, Any]]:
        return self.listed


def _devid() -> tuple[str, str]:
    """A certificate in PEM and the tpm_devid path SPIRE gives it (SHA-1 of the leaf's DER)."""
    import datetime as dt
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "devid")])
    now = dt.datetime.now(dt.UTC)
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
    builder = builder.serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
    cert = builder.sign(key, hashes.SHA256())
    digest = hashlib.sha1(cert.public_bytes(Encoding.DER), usedforsecurity=False).hexdigest()
    return cert.public_bytes(Encoding.PEM).decode(), f"/spire/agent/tpm_devid/{digest}"


def _node(version: str = "1.35.3", ready: str = "True") -> dict[str, Any]:
    labels = {"nodetrust.io/pool": "cpu", "nodetrust.io/demo": "true", "example.com/rack": "r1"}
    return {
        "metadata": {"labels": labels},
        "spec": {"taints": [{"key": "example.com/dedicated", "value": "demo", "effect": "NoSchedule"}]},
        "status": {
            "conditions": [{"type": "Ready", "status": ready}],
            "nodeInfo": {"kubeletVersion": f"v{version}"},
        },
    }


def test_the_verdict_reads_the_servers_the_clusters_and_the_nodes_records(tmp_path: Path) -> None:
    (tmp_path / "server" / "data").mkdir(parents=True)
    cluster = _Cluster()
    spire = _Spire()
    rack = demo_rack.Rack(tmp_path, cluster, None, None, None, spire, tmp_path / "releases", None)
    held = {
        n: {"version": "1.35.3-1.1", "status": "hold ok installed"}
        for n in ("kubeadm", "kubelet", "kubectl")
    }
    devid_pem, devid_path = _devid()
    kept: dict[str, Any] = {"state": {"kubernetes_version": "1.35.3"}, "joined_marker": True, "packages": held,
                            "journal": "nodeagent[1]: kubeadm join succeeded", "devid_cert": devid_pem}  # fmt: skip
    spire.listed = [
        {"id": {"trust_domain": "cluster.test", "path": devid_path}, "attestation_type": "tpm_devid"}
    ]
    log = tmp_path / "console.log"
    log.write_text("nothing secret\n")

    def verdict(**change: Any) -> list[str]:
        args: dict[str, Any] = {"node": _node(), "kept": kept, "version": "1.35.3", "release_name": "build-1",
                                "events": None, "logs": [log], **change}  # fmt: skip
        return demo_rack.verdict(rack, **args)

    def audit(*lines: dict[str, Any]) -> None:
        (tmp_path / "server" / "data" / "audit.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines)
        )

    # the Node is Ready, but the server issued nothing: the verdict fails
    problems = verdict()
    assert any("no successful attestation" in p for p in problems)
    assert any("no successful join of demo-node-1" in p for p in problems)
    attest = {"event": "attest", "result": "ok", "ek_trust": "ca"}
    join = {"event": "join", "result": "ok", "node_name": "demo-node-1", "pool": "cpu", "token_id": "abcdef",
            "verdict": "pass", "warned_checks": [], "release": "build-1"}  # fmt: skip
    joined = {"event": "joined", "result": "ok", "token_id": "abcdef", "token_revoked": True}
    devid = {"event": "devid", "result": "ok", "devid_agent_id": f"spiffe://demo.nodetrust.test{devid_path}"}
    audit(attest, join, devid)
    assert any("revoked []" in p for p in verdict())  # never revoked by the node's report
    audit(attest, join, joined)
    assert any("no DevID issued" in p for p in verdict())  # the node's DevID must be nodeserver's
    audit(attest, join, joined, devid)
    assert verdict() == []
    # the workload identity: the node's spire-agent attested to spire-server with tpm_devid and that DevID
    spire.listed = [{**spire.listed[0], "attestation_type": "join_token"}]
    assert any("no tpm_devid agent" in p for p in verdict())
    spire.listed = [
        {**spire.listed[0], "attestation_type": "tpm_devid", "id": {"path": "/spire/agent/tpm_devid/00"}}
    ]
    assert any("no tpm_devid agent" in p for p in verdict())
    spire.listed = [{"id": {"path": devid_path}, "attestation_type": "tpm_devid"}]
    assert any("no DevID certificate" in p for p in verdict(kept={**kept, "devid_cert": None}))
    cluster.left = "secret/bootstrap-token-abcdef"
    assert any("still in the cluster" in p for p in verdict())
    cluster.left = ""
    audit(attest, {**join, "warned_checks": ["node.time_sync"]}, joined, devid)
    assert any("did not pass every check" in p for p in verdict())
    audit(attest, {**join, "release": "another"}, joined, devid)
    assert any("not the build 'build-1'" in p for p in verdict())
    audit(attest, join, joined, devid)
    # the Node: Ready, the pool's labels and taint, the pool's kubelet
    assert any("is not Ready" in p for p in verdict(node=_node(ready="False")))
    assert any("not the pool's v1.35.3" in p for p in verdict(node=_node(version="1.36.3")))
    unlabelled = _node()
    del unlabelled["metadata"]["labels"]["example.com/rack"]
    assert any("label example.com/rack" in p for p in verdict(node=unlabelled))
    # the node's disk: the pool's version installed and held, the agent's state
    assert any(
        "kubectl package is absent" in p for p in verdict(kept={**kept, "packages": {**held, "kubectl": {}}})
    )
    unheld = {**held, "kubelet": {"version": "1.35.3-1.1", "status": "install ok installed"}}
    assert any("kubelet package" in p for p in verdict(kept={**kept, "packages": unheld}))
    assert any("the agent's state" in p for p in verdict(kept={**kept, "joined_marker": False}))
    # the imager's account, when the server was provisioned by iPXE
    chosen = {"event": "disk-chosen", "disk": {"serial": "NODE0TARGET"}}
    events = [
        {"event": "verified"},
        chosen,
        {"event": "written"},
        {"event": "boot-entry"},
        {"event": "done"},
    ]
    assert verdict(events=events) == []
    assert any("imager's events" in p for p in verdict(events=events[:-1]))
    assert any("not the disk with serial" in p for p in verdict(events=[events[0], {**chosen, "disk": {"serial": "X"}},
                                                                          *events[2:]]))  # fmt: skip
    # a token of the issued id in clear in any log, the node's journal included
    log.write_text("oops abcdef.0123456789abcdef\n")
    assert any("appears in a log" in p for p in verdict())
    log.write_text("token abcdef.<redacted>; xabcdef.0123456789abcdef0 is not it\n")
    assert verdict() == []
    assert any(
        "appears in a log" in p
        for p in verdict(kept={**kept, "journal": "kubeadm --token abcdef.0123456789abcdef"})
    )
