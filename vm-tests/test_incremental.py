"""Incremental rebuilds: a change to staged artifacts only reuses the installed base of the session's full
build (no installer run), and still yields a standalone QCOW2.

One extra build (conftest ``incremental_build``): the session's build (``full_build``, from the runtime payload
tree: stand-in kubeadm, kubelet, kubectl and SPIRE) installed and cached the base, or took it from the machine's
base cache; the incremental one locks against the real payload tree (the peers' Kubernetes and SPIRE) with one
staged Kubernetes version fewer, and builds again with ``--no-test``: that its image boots and works is the
demo's to show (vm-tests/test_demo.py boots it, attests, checks, verifies its measured boot and joins).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Build, domains
from imagecheck import ImageFiles, run, scratch

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]


def _manifest(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    return data


def _pins(manifest: dict[str, Any], name: str) -> set[str]:
    """The SHA-256 of every input called ``name`` in a build's manifest."""
    return {str(i["sha256"]) for i in manifest["inputs"] if i.get("name") == name}


def test_a_staged_artifact_change_reuses_the_installed_base(
    full_build: Build, incremental_build: Build
) -> None:
    full = _manifest(full_build.folder)
    staged = yaml.safe_load(incremental_build.definition.read_text())["kubernetes"]["staged"]
    folder, work = incremental_build.folder, incremental_build.work
    manifest = _manifest(folder)
    assert manifest["build_path"] == "incremental"
    assert manifest["base"]["key"] == full["base"]["key"]
    assert manifest["base"]["sha256"] == full["base"]["sha256"]
    assert manifest["base"]["created_by"] == full["base"]["created_by"]  # the build whose installer made it
    # the installer did not run: no installer phases, only the provisioning boot
    names = [p["name"] for p in manifest["phases"]]
    assert not [n for n in names if n == "install" or n.startswith(("install/", "installer"))], names
    assert "provision" in names and "provision/stage" in names
    assert manifest["installer"]["ran"] is False
    # the base compiled pip once (installer part of the console); this build's venv step ran that copy
    console = (folder / "console.log").read_text(errors="replace")
    assert re.search(r"nodetrust-stage: \[[^]]*\] pip pip-\S+\.whl: unpacked and byte-compiled", console)
    assert re.search(r"venv /opt/nodeagent/venv: \S+ \(pip compiled in the base\)", console)
    assert manifest["kubernetes"]["staged"] == staged
    # the staged artifacts did change: other kubeadm and spire-agent payloads (real ones in place of stand-ins)
    assert _pins(manifest, "kubeadm") and _pins(manifest, "kubeadm") != _pins(full, "kubeadm")
    assert _pins(manifest, "spire-agent") and _pins(manifest, "spire-agent") != _pins(full, "spire-agent")
    # a standalone image: no backing file
    info = json.loads(run("qemu-img", "info", "--output=json", str(folder / "fixture-node.qcow2")).stdout)
    assert info["format"] == "qcow2"
    assert "backing-filename" not in info and "full-backing-filename" not in info, info
    assert not [d for d in domains() if manifest["build_id"] in d]
    assert list(work.iterdir()) == []

    with scratch() as tmp:
        files = ImageFiles(folder / "fixture-node.qcow2", Path(tmp))
        try:
            assert set(files.listdir("/opt/nodetrust/staged/kubernetes")) == set(staged)
            assert files.exists("/opt/nodeagent/venv/bin/nodeagent")
            assert not files.exists("/usr/lib/nodetrust/provision-init")  # the hook removed itself
            assert not files.exists("/var/lib/nodetrust-build")  # the base's compiled pip is not shipped
            assert files.read("/etc/machine-id") == b""
            info_json = json.loads(files.text("/etc/nodetrust/image.json"))
            assert info_json["lock_sha256"] == manifest["lock"]["sha256"] and "build_id" not in info_json
        finally:
            files.close()

    # built with --no-test: the demo boots this image (vm-tests/test_demo.py), and no boot-test.json is claimed
    assert "boot-test" not in names and not (folder / "boot-test.json").exists(), names
