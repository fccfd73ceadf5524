"""A full build of examples/fixture-node.yaml: the published folder, the image's contents against the
manifest (read offline), and the image booted again with an emulated TPM."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Build, domains, wait_for_other_vms
from imagecheck import ImageFiles, boot_image, boot_report, dpkg_status, scratch

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(5400)]
REPO = Path(__file__).resolve().parent.parent


def _manifest(build: Build) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((build.folder / "manifest.json").read_text())
    return data


def _lock(build: Build) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(build.lock.read_text())
    return data


def test_the_published_folder(full_build: Build) -> None:
    folder = full_build.folder
    assert folder.parent == full_build.out and folder.name.startswith("fixture-node-")
    names = sorted(p.name for p in folder.iterdir())
    assert {"fixture-node.qcow2", "console.log", "manifest.json", "SHA256SUMS"} <= set(names)
    sums: dict[str, str] = {}
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    for name, digest in sums.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    assert set(sums) == set(names) - {"SHA256SUMS", "signature.dsse.json"}
    manifest = _manifest(full_build)
    assert manifest["schema"] == "https://nodetrust.dev/image-manifest/v1"
    assert manifest["build_id"] == folder.name
    assert manifest["definition"]["sha256"] == hashlib.sha256(full_build.definition.read_bytes()).hexdigest()
    assert manifest["lock"]["sha256"] == hashlib.sha256(full_build.lock.read_bytes()).hexdigest()
    outputs = {o["name"]: o for o in manifest["outputs"]}
    for name, entry in outputs.items():
        assert entry["sha256"] == sums[name] and entry["size"] == (folder / name).stat().st_size
    assert outputs["fixture-node.qcow2"]["media_type"] == "application/x-qemu-disk"
    locked = {(i["name"], i["sha256"]) for i in _lock(full_build)["inputs"]}
    assert locked <= {(i["name"], i["sha256"]) for i in manifest["inputs"]}
    assert {"nodeagent", "autoinstall-user-data"} <= {i["name"] for i in manifest["inputs"]}
    assert manifest["kubernetes"] == {"installed": "1.36.3", "staged": ["1.34.2", "1.35.3", "1.37.2"]}
    phases = [p["name"] for p in manifest["phases"]]
    for phase in ("fetch", "wheelhouse", "media", "install", "image", "install/boot", "install/late"):
        assert phase in phases
    assert all(p["duration_s"] >= 0 for p in manifest["phases"])
    assert {"qemu-img", "libvirt", "python", "imagebuilder"} <= set(manifest["tools"])
    assert manifest["image"]["virtual_size"] == 6 * 2**30
    assert manifest["installed_size"] > 100 * 2**20
    # the installer's events reached the builder's listener through the restricted user-mode network
    assert manifest["installer"]["network"] == "listener"
    assert manifest["installer"]["webhook_events"] > 10, manifest["installer"]
    # nothing temporary is left: no domain, no work directory, no partial folder
    assert not [d for d in domains() if full_build.folder.name in d]
    assert list(full_build.work.iterdir()) == []
    assert [p.name for p in full_build.out.iterdir()] == [folder.name]


def test_the_image_contents_match_the_manifest(full_build: Build) -> None:
    manifest = _manifest(full_build)
    with scratch() as tmp:
        files = ImageFiles(full_build.folder / "fixture-node.qcow2", Path(tmp))
        try:
            installed = dpkg_status(files.text("/var/lib/dpkg/status"))
            listed = {f"{p['name']}:{p['architecture']}": p["version"] for p in manifest["packages"]}
            assert listed == {name: fields["Version"] for name, fields in installed.items()}
            for package in ("kubeadm", "kubelet", "kubectl"):
                fields = installed[f"{package}:amd64"]
                assert fields["Version"] == "1.36.3-1.1"
                assert fields["Status"] == "hold ok installed", f"{package} is not held"
            assert (
                "libtss2-fapi1:amd64" in installed
            )  # a real Debian package through the staging apt repository
            # staged artifacts at fixed versioned paths, byte for byte what the lock pinned
            for item in _lock(full_build)["inputs"]:
                if item["role"] == "stage" and item["kind"] == "deb":
                    data = files.read(item["destination"] + item["filename"])
                    assert data is not None, f"{item['key']} is not staged"
                    assert hashlib.sha256(data).hexdigest() == item["sha256"], item["key"]
            assert files.exists("/opt/spire/1.14.1/bin/spire-agent")
            assert files.exists("/opt/spire/plugins/tpm/1.9.0/tpm_attestor_agent")
            assert files.exists("/opt/nodetrust/staged/ovn-kubernetes/2.4.2/bin/ovnkube")
            assert set(files.listdir("/opt/nodetrust/staged/kubernetes")) == {"1.34.2", "1.35.3", "1.37.2"}
            # the image contract
            assert files.read("/etc/machine-id") == b""
            assert not [n for n in files.listdir("/etc/ssh") if n.startswith("ssh_host_")]
            assert files.listdir("/etc/nodeagent") == []
            site = "/opt/nodeagent/venv/lib/python3.11/site-packages"
            assert {"agent", "protocol", "tpm2_pytss", "cryptography"} <= set(files.listdir(site))
            assert files.exists("/opt/nodeagent/venv/bin/nodeagent")
            unit = files.text("/etc/systemd/system/nodeagent.service")
            assert unit == (REPO / "agent/systemd/nodeagent.service").read_text()
            wants = "/etc/systemd/system/multi-user.target.wants/nodeagent.service"
            assert files.symlink_target(wants) == "/etc/systemd/system/nodeagent.service"
            assert files.exists("/etc/systemd/system/kubelet.service.d/10-nodeagent.conf")
            info = json.loads(files.text("/etc/nodetrust/image.json"))
            assert info["build_id"] == manifest["build_id"]
            # the node's own first boot belongs to its datasource, not to the installer's cloud-init
            assert "99-installer.cfg" not in files.listdir("/etc/cloud/cloud.cfg.d")
            assert "nodeadmin" in files.text("/etc/passwd")
            assert files.text("/home/nodeadmin/.ssh/authorized_keys").startswith("ssh-ed25519 ")
            assert "PasswordAuthentication no" in files.text("/etc/ssh/sshd_config.d/60-nodetrust.conf")
        finally:
            files.close()


def test_the_image_boots_and_the_agent_uses_its_tpm(full_build: Build) -> None:
    wait_for_other_vms()
    with scratch() as tmp:
        console = boot_image(full_build.folder / "fixture-node.qcow2", Path(tmp))
    report = boot_report(console)
    assert report["kubeadm"] == "kubeadm v1.36.3 (nodetrust fixture stand-in)"
    assert report["kubelet"] == "kubelet v1.36.3 (nodetrust fixture stand-in)"
    assert set(report["held"].split()) == {"kubeadm", "kubectl", "kubelet"}
    assert report["nodeagent-enabled"] == "enabled"
    assert report["machine-id-length"] == "32"  # generated at first boot, from the empty one in the image
    assert report["spire-agent"] == "spire-agent 1.14.1 (nodetrust fixture stand-in)"
    assert report["staged"].split() == ["1.34.2", "1.35.3", "1.37.2"]
    # tpm2-pytss (compiled by the lock for Python 3.11) and the agent's TPM code against a real TPM 2.0
    assert report.get("tpm-attestation-data") == "ok", console[-4000:]
    assert len(report["tpm-agent-id"]) == 64
    assert report["agent-python-exit"] == "0"
