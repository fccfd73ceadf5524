"""A full build of examples/fixture-node.yaml: the published folder, the image's contents against the
manifest (read offline), the build's own boot test (the image booted with an emulated TPM and checked
from inside), and `imagebuilder test` failing a deliberately broken copy of the image."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Build, Env, domains, imagebuilder, wait_for_other_vms
from imagecheck import ImageFiles, dpkg_status, scratch

from imagebuilder.boottest import expect_from_manifest, expected_checks

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(5400)]
REPO = Path(__file__).resolve().parent.parent


def _manifest(build: Build) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((build.folder / "manifest.json").read_text())
    return data


def _domain_xml(name: str) -> str:
    result = subprocess.run(["virsh", "-c", "qemu:///system", "dumpxml", name], capture_output=True, text=True,
                            check=False)  # fmt: skip
    return result.stdout


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
    assert "signature.dsse.json" in names  # signed with the session's build key
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
    for phase in ("fetch", "wheelhouse", "media", "provision", "seal", "image", "boot-test"):
        assert phase in phases
    # the installer ran only when the machine's base cache lacked this base; the full path's own assertions are
    # vm-tests/test_reproducible.py's, on a rebuild with a cold base cache
    assert ("install/late" in phases) == (manifest["build_path"] == "full") == manifest["installer"]["ran"]
    assert all(p["duration_s"] >= 0 for p in manifest["phases"])
    assert {"qemu-img", "libvirt", "python", "imagebuilder"} <= set(manifest["tools"])
    assert manifest["image"]["virtual_size"] == 6 * 2**30
    assert manifest["installed_size"] > 100 * 2**20
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
            # the container runtime's images are in containerd's store, imported at build time, not tarballs
            assert files.exists("/var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db")
            assert not files.exists("/opt/nodetrust/staged/images")
            assert "SystemdCgroup = true" in files.text("/etc/containerd/config.toml")
            assert files.text("/etc/sysctl.d/90-nodetrust.conf").endswith("net.ipv4.ip_forward = 1\n")
            site = "/opt/nodeagent/venv/lib/python3.11/site-packages"
            assert {"agent", "protocol", "tpm2_pytss", "cryptography"} <= set(files.listdir(site))
            assert files.exists("/opt/nodeagent/venv/bin/nodeagent")
            # packaged units in the vendor layer; /etc/systemd/system holds only the enablement link
            unit = files.text("/usr/lib/systemd/system/nodeagent.service")
            assert unit == (REPO / "agent/systemd/nodeagent.service").read_text()
            wants = "/etc/systemd/system/multi-user.target.wants/nodeagent.service"
            # systemd of a merged-/usr Debian 12 finds the unit through /lib first; Ubuntu 24.04's through /usr/lib
            assert files.symlink_target(wants) in {"/usr/lib/systemd/system/nodeagent.service",
                                                   "/lib/systemd/system/nodeagent.service"}  # fmt: skip
            assert files.exists("/usr/lib/systemd/system/kubelet.service.d/10-nodeagent.conf")
            assert not files.exists("/etc/systemd/system/nodeagent.service")
            assert not files.exists("/etc/systemd/system/kubelet.service.d/10-nodeagent.conf")
            info = json.loads(files.text("/etc/nodetrust/image.json"))
            # nothing of the run in the image: the lock names what it was built from (docs/reproducible.md)
            assert info["lock_sha256"] == manifest["lock"]["sha256"] and "build_id" not in info
            assert not files.exists(
                "/var/log/installer"
            )  # the installer's logs and its copy of the user-data
            assert files.listdir("/var/log/apt") == [] and not files.exists("/var/log/dpkg.log")
            # the node's own first boot belongs to its datasource, not to the installer's cloud-init
            assert "99-installer.cfg" not in files.listdir("/etc/cloud/cloud.cfg.d")
            assert "nodeadmin" in files.text("/etc/passwd")
            assert files.text("/home/nodeadmin/.ssh/authorized_keys").startswith("ssh-ed25519 ")
            assert "PasswordAuthentication no" in files.text("/etc/ssh/sshd_config.d/60-nodetrust.conf")
        finally:
            files.close()


# The checks the issue names: each must be in the build's report, and have passed.
NAMED_CHECKS = (
    "image/machine-id",
    "image/ssh-host-keys",
    "image/agent-config",
    "image/build-leftovers",
    "image/build-credentials",
    "kubernetes/installed",
    "kubernetes/held",
    "kubernetes/staged",
    "files/kubernetes 1.34.2 (staged)",
    "files/kubernetes 1.35.3 (staged)",
    "files/kubernetes 1.37.2 (staged)",
    "files/nodeagent units",
    "files/ovn-kubernetes 2.4.2",
    "files/spire-agent 1.14.1",
    "files/spire-tpm-plugin 1.9.0",
    "agent/venv",
    "agent/units",
    "agent/tpm",
    "agent/service",
    # the node (imagebuilder.nodespec, checked by imagebuilder/guest/nodecheck.py)
    "node/files",
    "node/units",
    "node/kernel-modules",
    "node/sysctls",
    "node/swap",
    "node/cgroup",
    "node/time-sync",
    "container-runtime/containerd",
    "container-runtime/images",
    "gpu/packages",
    "gpu/kernel-modules",
    "gpu/container-toolkit",
    "packages",
    "cloud-init",
    "measured-boot/event-log",
    "measured-boot/reference",
)


def test_the_build_boot_tested_the_image(full_build: Build) -> None:
    """The build booted its image (swtpm, NoCloud seed) before publishing, and every check passed inside."""
    folder = full_build.folder
    report = json.loads((folder / "boot-test.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
    assert report["passed"] is True and not failed, failed
    assert list(checks) == list(NAMED_CHECKS)  # the report's checks, in the order expect.json asks for them
    assert expected_checks(expect_from_manifest(_manifest(full_build))) == list(NAMED_CHECKS)
    assert report["build_id"] == folder.name and report["image"] == "fixture-node.qcow2"
    assert report["accelerator"] in ("kvm", "tcg") and report["kernel"]
    assert (
        checks["kubernetes/installed"]["detail"]
        == "kubeadm 1.36.3-1.1; kubelet 1.36.3-1.1; kubectl 1.36.3-1.1"
    )
    assert checks["kubernetes/staged"]["detail"] == "staged: 1.34.2, 1.35.3, 1.37.2"
    assert checks["agent/units"]["detail"] == "nodeagent.service enabled, nodeagent-reattest.timer enabled"
    assert "ran at boot and stopped with status 2" in checks["agent/service"]["detail"]
    # the node: containerd running with the images the build imported (seen through CRI by crictl), the host
    # configuration applied at this boot, the GPU stand-ins' modules built for the running kernel
    assert (
        "3 imported into k8s.io at build time, listed by crictl"
        in checks["container-runtime/images"]["detail"]
    )
    assert (
        "CRI enabled, systemd cgroups, sandbox registry.k8s.io/pause:3.10.2"
        in (checks["container-runtime/containerd"]["detail"])
    )
    assert checks["node/sysctls"]["detail"] == "3 applied at boot"
    assert checks["node/swap"]["detail"] == "no active swap; swap.target masked"
    # the clock: set from the boot test's NTP server on the host's loopback, through the guest's relay, before
    # time-sync.target (systemd-time-wait-sync held the boot until then: nothing was masked)
    assert "synchronised with 127.0.0.1: yes" in checks["node/time-sync"]["detail"], checks["node/time-sync"]
    assert "systemd-time-wait-sync.service: active" in checks["node/time-sync"]["detail"]
    assert "NTPSynchronized=yes" in checks["node/time-sync"]["detail"]
    assert checks["gpu/kernel-modules"]["detail"].startswith(
        f"precompiled for the running kernel {report['kernel']}"
    )
    # tpm2-pytss (compiled by the lock for Python 3.11) and the agent's TPM code read the swtpm's EK
    assert re.fullmatch(r".*sha256 [0-9a-f]{64}", checks["agent/tpm"]["detail"])
    # the report is an output of the build: in the manifest, SHA256SUMS and the phases
    manifest = _manifest(full_build)
    assert manifest["boot_test"] == {"passed": True, "report": "boot-test.json", "checks": len(NAMED_CHECKS)}
    entry = next(o for o in manifest["outputs"] if o["name"] == "boot-test.json")
    assert entry["sha256"] == hashlib.sha256((folder / "boot-test.json").read_bytes()).hexdigest()
    assert "  boot-test.json" in (folder / "SHA256SUMS").read_text()
    boot = next(p for p in manifest["phases"] if p["name"] == "boot-test")
    print(f"\nboot test inside the build: {boot['duration_s']:.0f} s ({report['accelerator']})")
    assert f"boot test passed: {len(NAMED_CHECKS)} checks" in full_build.stderr


TOKEN = "5f4e3d2c1b0a99887766554433221100"


def test_imagebuilder_test_fails_an_image_that_shipped_its_identity(env: Env, full_build: Build) -> None:
    """A copy of the image with a machine id, an SSH host key, the build's no-daemons policy and the installer's
    copy of the autoinstall user-data (with a webhook token) written offline, as a build that forgot to
    generalise and clean up would ship it: `imagebuilder test` boots it, exits 1 and names exactly those
    checks; the token is never printed."""
    with scratch() as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        files = ImageFiles(full_build.folder / "fixture-node.qcow2", work)
        try:
            files.replace("/etc/machine-id", b"0123456789abcdef0123456789abcdef\n")
            files.replace(
                "/etc/ssh/ssh_host_ed25519_key.pub", b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIshipped\n"
            )
            files.replace("/usr/sbin/policy-rc.d", b"#!/bin/sh\nexit 101\n")
            leaked = (
                f"reporting:\n  builder: {{endpoint: http://10.0.2.100:8080/nodetrust/{TOKEN}/events}}\n"
            )
            files.replace("/var/log/autoinstall-user-data", leaked.encode())
            broken = files.save_qcow2(work / "broken.qcow2")
        finally:
            files.close()
        (work / "credentials").write_text(TOKEN + "\n")
        wait_for_other_vms()
        report = work / "report.json"
        tested = imagebuilder(env, "test", str(broken), "--manifest", str(full_build.folder / "manifest.json"),
                              "--work-dir", str(work), "--cache-dir", str(env.cache), "--report", str(report),
                              "--credentials", str(work / "credentials"), timeout=2400)  # fmt: skip
        assert tested.returncode == 1, f"exit {tested.returncode}\n{tested.stdout}\n{tested.stderr[-4000:]}"
        report_text = report.read_text()  # before scratch() removes it
        verdict = json.loads(report_text)
        # the test VM is gone (other engineers' boot tests may run at the same time: only ours counts)
        assert not [d for d in domains() if "boottest" in d and str(work) in _domain_xml(d)]
    failed = {c["name"]: c["detail"] for c in verdict["checks"] if not c["ok"]}
    assert set(failed) == {"image/machine-id", "image/ssh-host-keys", "image/build-leftovers",
                           "image/build-credentials"}, failed  # fmt: skip
    assert "credentials line 1 in /var/log/autoinstall-user-data" in failed["image/build-credentials"]
    assert (
        "the builder's webhook address (with a build's token) in /var/log/autoinstall-user-data"
        in (failed["image/build-credentials"])
    )
    assert TOKEN not in tested.stdout + tested.stderr + report_text
    assert "shipped a machine id (01234567..." in failed["image/machine-id"]
    assert "ssh_host_ed25519_key.pub" in failed["image/ssh-host-keys"]
    assert failed["image/build-leftovers"] == "the image ships what the build used: /usr/sbin/policy-rc.d"
    assert len(verdict["checks"]) == len(NAMED_CHECKS)  # the rest of the image still passes
    assert "FAIL image/machine-id:" in tested.stdout
    assert tested.stdout.rstrip().endswith(
        f"boot test FAILED: 4 of {len(NAMED_CHECKS)} checks failed: "
        "image/machine-id, image/ssh-host-keys, image/build-leftovers, image/build-credentials"
    )
