"""How builds fail: a tampered payload before any VM starts; an installer error, diagnosed from its console
and logs; a hang, caught by the idle watchdog; and Ctrl-C or SIGTERM in a VM phase the build reports, which
leave nothing behind (the same without a VM: tests/imagebuilder/test_interrupt.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    REPO,
    Build,
    Env,
    domains,
    extras_source,
    imagebuilder,
    variant,
    wait_for_other_vms,
    work_dir,
)

from imagebuilder.vm import DOMAIN_PREFIX

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]
SPIRE = "/spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz"


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """The build's --work-dir, reachable by QEMU; removed after the test whatever happened."""
    path = work_dir(tmp_path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _no_leftovers(work: Path, out: Path, *, domain: str | None = None) -> None:
    """Nothing of the build left; ``domain``: only that one must be gone (other sessions' VMs may run)."""
    left = [d for d in domains() if domain is None or d == domain]
    assert not left, f"libvirt domains left behind: {left}"
    assert list(work.iterdir()) == [], f"temporary files left in {work}: {list(work.iterdir())}"
    assert not out.exists() or list(out.iterdir()) == [], f"something was published: {list(out.iterdir())}"


def test_a_tampered_payload_fails_the_build_before_any_vm_starts(env: Env, full_build: Build, tmp_path: Path,
                                                                 work: Path) -> None:  # fmt: skip
    lock = json.loads(full_build.lock.read_text())
    spire = next(i for i in lock["inputs"] if i["key"] == "artifact/spire-agent")
    # a cache like the shared one, except that its SPIRE entry is corrupt: it must not be used...
    cache = tmp_path / "cache"
    shutil.copytree(
        env.cache, cache, copy_function=os.link, ignore=shutil.ignore_patterns("*.lock", "*.part")
    )
    entry = cache / "sha256" / spire["sha256"][:2] / spire["sha256"]
    entry.unlink()
    entry.write_bytes(b"corrupted in the cache")
    # ...and the server now serves a tampered tarball: the build must stop in its fetch phase
    env.payloads.tamper(SPIRE, b"a tampered spire-agent tarball")
    out = tmp_path / "out"
    try:
        result = imagebuilder(env, "build", str(full_build.definition), "--lock", str(full_build.lock),
                              "--cache-dir", str(cache), "--out", str(out), "--work-dir", str(work))  # fmt: skip
    finally:
        del env.payloads.overrides[SPIRE]
    assert result.returncode == 5, result.stderr[-3000:]  # VerificationError
    assert "spire-agent: no source served the pinned content" in result.stderr
    assert "cache entry" in result.stderr and "is corrupt" in result.stderr
    assert "== install" not in result.stderr and "build VM" not in result.stderr  # stopped before any VM
    _no_leftovers(work, out)


def _variant_build(
    env: Env, tmp_path: Path, work: Path, name: str, package: str, *extra: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    definition = variant(
        tmp_path, {"name": name, "apt_sources+": [extras_source(env)], "packages+": [package]}
    )
    lock = tmp_path / f"{name}.lock.json"
    locked = imagebuilder(env, "lock", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache))
    assert locked.returncode == 0, locked.stderr[-3000:]
    wait_for_other_vms()
    started = time.monotonic()
    result = imagebuilder(env, "build", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache),
                          "--out", str(tmp_path / "out"), "--work-dir", str(work), *extra)  # fmt: skip
    return result, time.monotonic() - started


def test_an_installer_error_is_diagnosed_from_its_console(env: Env, tmp_path: Path, work: Path) -> None:
    result, seconds = _variant_build(env, tmp_path, work, "fixture-fails", "nodetrust-fixture-fails")
    assert result.returncode == 6, result.stderr[-5000:]  # InstallerError
    error = result.stderr[result.stderr.index("imagebuilder: error:") :]
    assert "the installer failed: subiquity/Late/run" in error
    assert "--- installer logs (error-commands) ---" in error
    assert "nodetrust-fixture-fails" in error
    assert "(error-commands dumped no logs)" not in error
    print(f"\ninstaller error diagnosed after {seconds:.0f} s")
    _no_leftovers(work, tmp_path / "out")


def test_a_hanging_staging_plan_is_caught_by_the_watchdog(env: Env, full_build: Build, tmp_path: Path,
                                                           work: Path) -> None:  # fmt: skip
    """A package whose postinst never returns, silently, in the provisioning boot: the build reuses the session's
    installed base (the Kubernetes packages are provisioned, not installed), so only the boot the hang happens in
    runs. The watchdog is the same for the installer's phases (tests/imagebuilder/test_watch.py)."""
    assert full_build.bases is not None
    kube = yaml.safe_load(full_build.definition.read_text())["kubernetes"]
    repository = {**kube["repository"], "url": env.payloads.url + "/k8s-hangs/core:/stable:/v{minor}/deb/"}
    definition = variant(
        tmp_path, {"name": "fixture-hangs", "kubernetes": {**kube, "staged": [], "repository": repository}}
    )
    lock = tmp_path / "fixture-hangs.lock.json"
    locked = imagebuilder(env, "lock", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache))
    assert locked.returncode == 0, locked.stderr[-3000:]
    wait_for_other_vms()
    started = time.monotonic()
    # The idle limit must exceed the longest quiet step of an honest plan under TCG; the package hangs for ever,
    # so a larger limit only costs its own time.
    result = imagebuilder(env, "build", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache),
                          "--base-cache", str(full_build.bases), "--out", str(tmp_path / "out"), "--work-dir", str(work),
                          "--idle-limit", "late=90")  # fmt: skip
    seconds = time.monotonic() - started
    assert result.returncode == 6, result.stderr[-5000:]
    assert "== install" not in result.stderr, "the session's installed base was not reused"
    error = result.stderr[result.stderr.index("imagebuilder: error:") :]
    assert "the staging plan showed no progress for 9" in error and "(idle limit 90 s)" in error, error
    assert "Setting up kubelet (1.36.3-1.1)" in error, error  # the console tail shows where it stopped
    print(f"\nhang caught after {seconds:.0f} s")
    _no_leftovers(work, tmp_path / "out")


def _events(progress: Path) -> list[dict[str, Any]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]


def _stop_at(env: Env, full_build: Build, tmp_path: Path, work: Path, *, bases: Path, phase: str,
             sig: signal.Signals) -> tuple[str, list[dict[str, Any]]]:  # fmt: skip
    """Build with ``--progress``, send ``sig`` once the build reports ``phase`` (a VM phase: its domain runs),
    and check that it stopped there and left nothing; return the domain's name and the events.

    The build starts with SIGINT ignored, as a build started in the background by a script (``make test &``,
    nohup, many CI runners) inherits it: the way the old test once saw a Ctrl-C lost and a build published."""
    out, progress = (
        tmp_path / f"out-{phase.replace('/', '-')}",
        tmp_path / f"{phase.replace('/', '-')}.jsonl",
    )
    argv = [sys.executable, "-m", "imagebuilder.cli", "build", str(full_build.definition), "--lock", str(full_build.lock),
            "--cache-dir", str(env.cache), "--base-cache", str(bases), "--out", str(out), "--work-dir", str(work),
            "--progress", str(progress)]  # fmt: skip
    wait_for_other_vms()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(argv, cwd=REPO, env=env.environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 900
        while not any(e.get("phase") == phase and e["event"] == "start" for e in _events(progress)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"the build never reported {phase}"
            time.sleep(0.5)
        own = (
            DOMAIN_PREFIX + _events(progress)[0]["run_id"]
        )  # the build id is the lock's: one per run is not
        assert own in domains(), f"no build VM {own} while the build reports {phase}: {domains()}"
        proc.send_signal(sig)
        _stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "imagebuilder: interrupted; the build was cleaned up" in stderr
    events = _events(progress)
    assert events[-1]["event"] == "result" and events[-1]["outcome"] == "interrupted", events[-3:]
    parent = phase.split("/", 1)[0]
    assert [e["outcome"] for e in events if e.get("phase") == parent and e["event"] == "end"] == [
        "interrupted"
    ]
    _no_leftovers(work, out, domain=own)
    return own, events


def test_sigint_and_sigterm_stop_the_build_in_a_vm_phase_and_leave_nothing(env: Env, full_build: Build,
                                                                             tmp_path: Path, work: Path) -> None:  # fmt: skip
    """Ctrl-C in the incremental path's provisioning boot, SIGTERM in the full path's installer: each stops the
    build in the phase it reported, removes the domain, the work directory and the unpublished folder."""
    assert full_build.bases is not None
    started = time.monotonic()
    _own, events = _stop_at(env, full_build, tmp_path, work, bases=full_build.bases, phase="provision/boot",
                            sig=signal.SIGINT)  # fmt: skip
    assert not any(e.get("phase") == "install" for e in events), "the session's base was not reused"
    incremental = time.monotonic() - started
    # the full path: an empty base cache, so the installer runs; SIGTERM once its VM boots
    bases = Path(tempfile.mkdtemp(prefix="vmtest-bases-", dir="/var/tmp"))
    try:
        _own, events = _stop_at(env, full_build, tmp_path, work, bases=bases, phase="install/boot",
                                sig=signal.SIGTERM)  # fmt: skip
        assert any(e.get("phase") == "installer-media" for e in events)
        assert not list(bases.glob("*/base.json")) and not list(bases.glob(".tmp-*")), "a base was stored"
    finally:
        shutil.rmtree(bases, ignore_errors=True)
    print(
        f"\nsignals: incremental path stopped after {incremental:.0f} s, both paths {time.monotonic() - started:.0f} s"
    )
