"""Incremental rebuilds: a change to staged artifacts only reuses the installed base of the session's full
build (no installer run), and still yields a standalone QCOW2 that boots and passes the boot test.

One extra build: the session's full build (conftest ``full_build``, run with ``--full``) installed and
cached the base; this test changes the staged Kubernetes versions, locks and builds again.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Build, Env, domains, imagebuilder, variant, wait_for_other_vms, work_dir
from imagecheck import ImageFiles, run, scratch

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]


def _manifest(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    return data


def test_a_staged_artifact_change_reuses_the_installed_base(
    env: Env, full_build: Build, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    full = _manifest(full_build.folder)
    assert full["build_path"] == "full"
    assert any(p["name"] == "install/late" for p in full["phases"])
    kube = yaml.safe_load(full_build.definition.read_text())["kubernetes"]
    staged = kube["staged"][:-1]  # drop the newest staged version: only staged artifacts change
    definition = variant(tmp_path, {"kubernetes": {**kube, "staged": staged}})
    lock = tmp_path / "fixture-node.lock.json"
    locked = imagebuilder(env, "lock", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache))
    assert locked.returncode == 0, f"imagebuilder lock failed:\n{locked.stderr[-5000:]}"
    out, work = tmp_path / "out", work_dir(tmp_path)
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    wait_for_other_vms()
    started = time.monotonic()
    assert full_build.bases is not None
    built = imagebuilder(env, "build", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache),
                         "--base-cache", str(full_build.bases), "--out", str(out), "--work-dir", str(work))  # fmt: skip
    seconds = time.monotonic() - started
    assert built.returncode == 0, f"incremental build failed ({built.returncode}):\n{built.stderr[-8000:]}"
    folder = Path(built.stdout.strip().splitlines()[-1])
    print(f"\nincremental fixture build: {seconds:.0f} s (full: {full_build.seconds:.0f} s) -> {folder}")

    manifest = _manifest(folder)
    assert manifest["build_path"] == "incremental"
    assert manifest["base"]["key"] == full["base"]["key"]
    assert manifest["base"]["sha256"] == full["base"]["sha256"]
    assert manifest["base"]["created_by"] == full["build_id"]
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
            assert info_json["build_id"] == manifest["build_id"]
        finally:
            files.close()

    # the builder's own boot test ran at the end of the build (a failed one publishes nothing)
    assert "boot-test" in names, names
    report = json.loads((folder / "boot-test.json").read_text())
    assert report["passed"] is True, report
    assert report["build_id"] == manifest["build_id"]
