"""Reproducible images: the session's full build, built again from its definition and lock with a cold base
cache by `imagebuilder rebuild`, is the same image, byte for byte, with the same boot reference values and
SBOM, and the same manifest and provenance except the fields that record the run (docs/reproducible.md).

One full build beyond the session's own (the installer runs again, its own base cache): it also exercises
the rebuild command end to end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import Build, Env, imagebuilder, wait_for_other_vms, work_dir

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(5400)]


def test_a_second_cold_build_of_the_lock_is_the_same_image(
    env: Env, full_build: Build, tmp_path_factory: pytest.TempPathFactory
) -> None:
    work = work_dir(tmp_path_factory.mktemp("rebuild"))
    wait_for_other_vms()
    started = time.monotonic()
    done = imagebuilder(env, "rebuild", str(full_build.folder), "--json", "--cache-dir", str(env.cache),
                        "--work-dir", str(work), timeout=4800)  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode in (0, 1), (
        f"imagebuilder rebuild could not run ({done.returncode}):\n{done.stderr[-6000:]}"
    )
    report = json.loads(done.stdout)
    print(f"\nrebuild (a full build with a cold base cache) and comparison: {seconds:.0f} s")
    print(json.dumps({k: report[k] for k in ("image", "boot_measurements", "identical_files", "differences", "tools")
                      if k in report}, indent=1)[:6000])  # fmt: skip
    assert report["image"]["same"], json.dumps(report.get("image_differences"), indent=1)[:8000]
    assert done.returncode == 0 and report["same"], report
    manifest = json.loads((full_build.folder / "manifest.json").read_text())
    assert report["image"]["published"] == next(
        o["sha256"] for o in manifest["outputs"] if o["name"].endswith(".qcow2")
    )
    assert report["rebuilt_build_id"] == report["build_id"] == full_build.folder.name
    assert report["boot_measurements"]["same"] is True
    assert report["identical_files"] == {"sbom.spdx.json": True, "boot-measurements.json": True}
    assert report["differences"] == {"manifest": [], "provenance": []}
    assert list(Path(work).iterdir()) == []  # the rebuild's folder, base cache and work directory are gone
