"""Reproducible images: a release of the session's build, rebuilt by `imagebuilder rebuild` from its definition
and lock with a cold base cache, is the same image, byte for byte, with the same boot reference values; the
rebuilt build folder has the same SBOM, and the same manifest and provenance except the fields that record the
run (docs/reproducible.md).

The rebuild is this tier's installer path on every run: the session's build takes its installed base from the
machine's base cache when an earlier run made it (vm-tests/conftest.py), the rebuild's installer runs now, so
the two images come from two independent installer runs. The full path's own assertions are here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, Build, Env, imagebuilder, wait_for_other_vms, work_dir

from imagebuilder.commands.rebuild import compare, read_published
from imagebuilder.sign import generate_keypair
from tests.imager.server import tls_certificate

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(5400)]


def _release(full_build: Build, tmp: Path) -> Path:
    """`imagebuilder release` of the session's signed build (the imager's boot files are stand-ins: nothing
    boots this release; its image, its digest and its signature are what a third party starts from)."""
    assert full_build.key is not None
    imager = tmp / "imager"
    imager.mkdir()
    (imager / "vmlinuz").write_bytes(b"MZ imager kernel stand-in")
    (imager / "initrd.img").write_bytes(b"070701 imager initramfs stand-in")
    private, public = generate_keypair("ecdsa-p256")
    (tmp / "release.key").write_bytes(private)
    (tmp / "release.key").chmod(0o600)
    (tmp / "release.pub").write_bytes(public)
    argv = [sys.executable, "-m", "imagebuilder.cli", "release", str(full_build.folder),
            "--build-key", str(full_build.key), "--key", str(tmp / "release.key"), "--out", str(tmp / "releases"),
            "--base-url", "http://127.0.0.1:9/releases/", "--imager", str(imager), "--pool", "cpu",
            "--server", "127.0.0.1:8081", "--trust-domain", "nodetrust.test",
            "--bundle", str(tls_certificate(tmp)[0]), "--ntp", "127.0.0.1", "--json"]  # fmt: skip
    made = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert made.returncode == 0, made.stderr[-4000:]
    return Path(json.loads(made.stdout)["folder"])


def _same_commit_as(full_build: Build) -> None:
    """The rebuild builds the agent from this checkout, as the session build did: a commit made since (during
    the run) changes the agent, so the image differs for a reason of the run, not of the builder; said so."""
    recorded = json.loads((full_build.folder / "manifest.json").read_text())["agent"]["source"]["commit"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()  # fmt: skip
    assert head == recorded, (
        f"the checkout's HEAD moved during the run ({recorded[:12]} at the session build, {head[:12]} now): "
        "the rebuild would build another agent. Do not commit while the VM tier runs; run it again"
    )


def test_a_release_rebuilt_with_a_cold_base_cache_is_the_same_image(
    env: Env, full_build: Build, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("rebuild")
    _same_commit_as(full_build)
    release = _release(full_build, tmp)
    work = work_dir(tmp)
    rebuilt_out = work_dir(tmp_path_factory.mktemp("rebuilt"))
    try:
        wait_for_other_vms()
        started = time.monotonic()
        done = imagebuilder(env, "rebuild", str(release), "--key", str(tmp / "release.pub"),
                            "--definition", str(full_build.definition),
                            "--lock", str(full_build.lock), "--out", str(rebuilt_out), "--json",
                            "--cache-dir", str(env.cache), "--work-dir", str(work), timeout=4800)  # fmt: skip
        seconds = time.monotonic() - started
        assert done.returncode in (0, 1), (
            f"imagebuilder rebuild could not run ({done.returncode}):\n{done.stderr[-6000:]}"
        )
        report = json.loads(done.stdout)
        print(f"\nrebuild of {release.name} (a full build, cold base cache) and comparison: {seconds:.0f} s")
        print(
            json.dumps(
                {k: report[k] for k in ("image", "boot_measurements", "tools") if k in report}, indent=1
            )
        )
        diff = report.get("image_differences") or {}
        assert report["image"]["same"], "\n".join(
            [diff.get("summary", ""), *diff.get("file_systems", []), *diff.get("notes", [])]
            + [f"{f['tree']}:{f['path']}: {f['change']} {f['detail']}" for f in diff.get("files", [])[:80]]
        )
        assert done.returncode == 0 and report["same"] and report["kind"] == "release", report
        manifest = json.loads((full_build.folder / "manifest.json").read_text())
        assert report["image"]["published"] == next(
            o["sha256"] for o in manifest["outputs"] if o["name"].endswith(".qcow2")
        )
        assert report["rebuilt_build_id"] == report["build_id"] == full_build.folder.name
        assert report["boot_measurements"]["same"] is True
        assert list(Path(work).iterdir()) == []  # the rebuild's base cache and work directory are gone

        # the rebuilt build folder against the session's: SBOM, manifest and provenance too
        rebuilt = rebuilt_out / full_build.folder.name
        folders = compare(read_published(full_build.folder), rebuilt, tmp)
        assert folders["same"], folders
        assert folders["identical_files"] == {"sbom.spdx.json": True, "boot-measurements.json": True}
        assert folders["differences"] == {"manifest": [], "provenance": []}

        # the full path, asserted on every run: the installer ran, its events reached the builder's listener
        # through the restricted user-mode network, and made the base the provisioning boot started from
        again = json.loads((rebuilt / "manifest.json").read_text())
        phases = [p["name"] for p in again["phases"]]
        for phase in ("installer-media", "install", "install/boot", "install/install", "install/late",
                      "base-store", "provision", "seal", "image"):  # fmt: skip
            assert phase in phases, phases
        assert "boot-test" not in phases  # a rebuild boots nothing unless asked
        assert again["build_path"] == "full" and again["installer"]["ran"] is True
        assert again["installer"]["network"] == "listener"
        assert again["installer"]["webhook_events"] > 10, again["installer"]
        assert again["base"]["key"] == manifest["base"]["key"]  # the same base recipe, installed twice
    finally:
        shutil.rmtree(rebuilt_out, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
