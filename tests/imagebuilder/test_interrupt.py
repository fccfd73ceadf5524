"""Ctrl-C and SIGTERM stop a build in any phase and leave nothing behind (issue 11), without a VM.

The defect behind the flaky VM test: a process started in the background by a non-interactive shell
inherits SIGINT *ignored*, Python then installs no KeyboardInterrupt handler, and the builder ran on
through Ctrl-C, published and exited 0. These tests start the builder that way on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imagebuilder import interrupt
from imagebuilder.definition import Watchdog
from imagebuilder.domain import domain_xml
from imagebuilder.vm import Connection
from imagebuilder.watch import ProvisionWatcher
from tests.imagebuilder.conftest import REPO, Locked
from tests.imagebuilder.test_domain import TEST_URI, spec

CHILD = """
import signal, sys, time
from imagebuilder import interrupt
print("inherited", "ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default", flush=True)
try:
    with interrupt.stop_on_signals():
        print("ready", flush=True)
        while True:
            time.sleep(1)
except interrupt.Interrupted as exc:
    print("interrupted", exc.signum, flush=True)
    sys.exit(130)
"""


def _ignoring_sigint(argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
    """Start ``argv`` the way ``make test &`` in a script does: with SIGINT ignored (inherited)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_process_that_inherited_sigint_ignored(sig: signal.Signals) -> None:
    proc = _ignoring_sigint([sys.executable, "-c", CHILD], cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["inherited", "ignored"]  # the premise: Python's own is off
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert out.split() == ["interrupted", str(int(sig))]


def test_the_first_signal_raises_and_later_ones_never_break_the_clean_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cleaned = []
    with interrupt.stop_on_signals():
        with pytest.raises(interrupt.Interrupted) as caught:
            signal.raise_signal(signal.SIGINT)
        assert caught.value.signum == signal.SIGINT and isinstance(caught.value, KeyboardInterrupt)
        signal.raise_signal(signal.SIGTERM)  # a second Ctrl-C (or a SIGTERM) while cleaning up
        cleaned.append("domain removed")
    assert cleaned == ["domain removed"]
    assert "SIGTERM: already stopping; the clean-up runs to its end" in caplog.text
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_deferred_step_finishes_and_the_signal_is_raised_after_it() -> None:
    done = []
    with interrupt.stop_on_signals(), pytest.raises(interrupt.Interrupted) as caught:
        with interrupt.deferred():
            signal.raise_signal(signal.SIGTERM)
            done.append("whole work directory removed")
        done.append("never reached")
    assert done == ["whole work directory removed"] and caught.value.signum == signal.SIGTERM


def test_publishing_is_all_or_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with interrupt.stop_on_signals():
        # a signal during the rename: the folder is published, the build is done and exits 0

        def rename() -> str:
            signal.raise_signal(signal.SIGINT)
            return "published"

        assert interrupt.commit(rename) == "published"
        signal.raise_signal(signal.SIGINT)  # and later signals change nothing
    assert "too late, the build is already published" in caplog.text
    # a signal before the commit stops the build: nothing is published
    published = []
    with interrupt.stop_on_signals(), pytest.raises(interrupt.Interrupted), interrupt.deferred():
        signal.raise_signal(signal.SIGINT)
        interrupt.commit(lambda: published.append("folder"))
    assert published == []


def test_without_the_handler_the_helpers_just_run() -> None:
    with interrupt.deferred():
        pass
    assert interrupt.commit(lambda: 42) == 42


@pytest.mark.libvirt
def test_a_signal_while_a_vm_phase_runs_removes_the_domain(tmp_path: Path) -> None:
    """The watcher reports the VM's first phase once the domain runs; a signal right then stops the
    watch and the domain is destroyed and undefined on the way out (libvirt's test driver)."""
    conn = Connection(TEST_URI)
    phases: list[str] = []

    def on_phase(phase: str) -> None:
        phases.append(phase)
        assert spec(tmp_path).name in conn.domain_names()
        signal.raise_signal(signal.SIGINT)

    (tmp_path / "console.log").write_text("")
    (tmp_path / "data.log").write_text("")
    try:
        with (
            interrupt.stop_on_signals(),
            pytest.raises(interrupt.Interrupted),
            conn.domain(domain_xml(spec(tmp_path))) as dom,
        ):
            ProvisionWatcher(dom, tmp_path / "console.log", tmp_path / "data.log", None, Watchdog(),
                             on_phase=on_phase).run()  # fmt: skip
        assert phases == ["boot"]
        assert spec(tmp_path).name not in conn.domain_names()
    finally:
        conn.close()


# -- the real command line, stopped in a phase it reports, with nothing left behind --------------------------


@pytest.fixture
def stalled(locked: Locked) -> Iterator[str]:
    """The first input a build fetches answers nothing (for 30 s): the build waits in its fetch phase."""
    path = "/ovn-kubernetes/v2.4.2/ovn-kubernetes-2.4.2-linux-amd64.tar.gz"
    locked.server.stall_once.add(path)
    try:
        yield path
    finally:
        locked.server.stall_once.discard(path)


def _events(progress: Path) -> list[dict[str, object]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]


@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_build_command_stops_in_its_fetch_phase_and_leaves_nothing(
    locked: Locked, stalled: str, tmp_path: Path, sig: signal.Signals
) -> None:
    out, work, progress = tmp_path / "out", tmp_path / "work", tmp_path / "progress.jsonl"
    work.mkdir()
    argv = [sys.executable, "-m", "imagebuilder.cli", "build", str(locked.definition), "--lock", str(locked.lock),
            "--cache-dir", str(tmp_path / "empty-cache"), "--out", str(out), "--work-dir", str(work),
            "--libvirt-uri", "test:///default", "--progress", str(progress)]  # fmt: skip
    seen = len(locked.server.requests)  # the lock's own download of the same file came before
    proc = _ignoring_sigint(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # the build reports its fetch phase, and the stalled download has been asked for: it waits there
        while not (
            any(e.get("phase") == "fetch" and e["event"] == "start" for e in _events(progress))
            and any(p == stalled for p, _range in locked.server.requests[seen:])
        ):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "imagebuilder: interrupted; the build was cleaned up" in stderr
    events = _events(progress)
    fetch_end = next(e for e in events if e.get("phase") == "fetch" and e["event"] == "end")
    assert fetch_end["outcome"] == "interrupted"
    assert events[-1]["event"] == "result" and events[-1]["outcome"] == "interrupted"
    assert not any(e.get("phase") == "wheelhouse" for e in events)
    assert list(work.iterdir()) == [], "the work directory was not removed"
    assert not out.exists() or list(out.iterdir()) == [], "something was published"


def test_progress_lines_name_every_phase_with_its_outcome(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from imagebuilder.build import Phases
    from imagebuilder.progress import ProgressLog

    log_path = tmp_path / "progress.jsonl"
    progress = ProgressLog(log_path, "b-1", "b-1-abcdef")
    phases = Phases(progress)
    with phases.phase("fetch"):
        phases.vm_phase("provision")("boot")
    with pytest.raises(RuntimeError), phases.phase("media"):
        raise RuntimeError("boom")
    progress.emit("result", outcome="failed", exit_code=1)
    progress.close()
    events = _events(log_path)
    assert [(e["event"], e.get("phase"), e.get("outcome")) for e in events] == [
        ("start", "fetch", None), ("start", "provision/boot", None), ("end", "fetch", "ok"),
        ("start", "media", None), ("end", "media", "failed"), ("result", None, "failed"),
    ]  # fmt: skip
    assert all(
        e["build_id"] == "b-1" and e["run_id"] == "b-1-abcdef" and isinstance(e["time"], float)
        for e in events
    )
    with caplog.at_level(logging.INFO):
        unwritable = ProgressLog(None, "b-2")
        unwritable.emit("start", "check")  # no file: nothing happens
    from imagebuilder.errors import OutputError

    with pytest.raises(OutputError, match=r"--progress .*: cannot open it for appending"):
        ProgressLog(tmp_path / "missing" / "progress.jsonl", "b-3")
