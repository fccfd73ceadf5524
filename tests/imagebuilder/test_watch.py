"""The watcher's diagnoses, driven by a fake domain, console and data port on a fake clock."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
from pathlib import Path

import pytest

from imagebuilder.definition import Watchdog
from imagebuilder.errors import InstallerError, VmError
from imagebuilder.vm import DomainState
from imagebuilder.watch import DataPort, EventListener, InstallerEvent, LineTail, ProvisionWatcher, Watcher

RUNNING = DomainState(True, "running", "1")
POWERED_OFF = DomainState(False, "shutoff", "shutdown")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Script:
    """A fake VM: at given fake times, console lines, data lines and states appear."""

    name = "fake"

    def __init__(self, tmp: Path, clock: Clock) -> None:
        self.console = tmp / "console.log"
        self.data = tmp / "data.log"
        self.console.write_text("")
        self.data.write_text("")
        self.clock = clock
        self.steps: list[tuple[float, str, str]] = []  # (time, kind, text)
        self.final = RUNNING
        self.states: list[tuple[float, DomainState]] = []

    def at(self, t: float, kind: str, text: str) -> Script:
        self.steps.append((t, kind, text))
        return self

    def stop_at(self, t: float, state: DomainState = POWERED_OFF) -> Script:
        self.states.append((t, state))
        return self

    def state(self) -> DomainState:
        elapsed = self.clock() - 1000.0
        for t, kind, text in list(self.steps):
            if t <= elapsed:
                target = self.console if kind == "console" else self.data
                with target.open("a") as fh:
                    fh.write(text + "\r\n")
                self.steps.remove((t, kind, text))
        for t, state in self.states:
            if t <= elapsed and not self.steps:
                return state
        return RUNNING


def watcher(script: Script, clock: Clock, watchdog: Watchdog | None = None) -> Watcher:
    limits = watchdog or Watchdog(boot=60, install=60, late=60, shutdown=60, total=3600)
    return Watcher(script, script.console, script.data, None, limits, poll_s=1.0, clock=clock,
                   wall=clock, sleep=clock.sleep)  # fmt: skip


def packages_block(lines: list[str]) -> list[str]:
    digest = hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()
    return ["NODETRUST-PACKAGES-BEGIN", *lines, f"NODETRUST-PACKAGES-END {len(lines)} {digest}"]


def successful(script: Script) -> Script:
    script.at(1, "console", "[    0.000000] Linux version 6.1.0")
    script.at(5, "console", "start: subiquity/Install/install: installing system")
    script.at(9, "console", "finish: subiquity/Install/install: SUCCESS: installing system")
    script.at(10, "console", "start: subiquity/Late/run: running late-commands")
    script.at(11, "data", "NODETRUST-STAGE-BEGIN")
    for i, line in enumerate(packages_block(["base-files\t12.4\tamd64", "libc6:amd64\t2.36-9\tamd64"])):
        script.at(12 + i * 0.01, "data", line)
    script.at(13, "data", "NODETRUST-INSTALLED-SIZE 1234567")
    script.at(14, "data", "NODETRUST-STAGE-DONE")
    script.at(15, "console", "finish: subiquity/Late/run: SUCCESS: running late-commands")
    return script.stop_at(20)


def test_a_successful_install(tmp_path: Path) -> None:
    clock = Clock()
    result = watcher(successful(Script(tmp_path, clock)), clock).run()
    assert result.packages == [
        {"name": "base-files", "version": "12.4", "architecture": "amd64"},
        {"name": "libc6", "version": "2.36-9", "architecture": "amd64"},
    ]
    assert result.installed_size == 1234567
    assert [p.name for p in result.phases] == ["boot", "install", "late", "shutdown"]
    assert all(p.duration_s >= 0 for p in result.phases)
    assert result.events == 4


def test_no_console_output_is_a_boot_hang_caught_within_the_idle_limit(tmp_path: Path) -> None:
    clock = Clock()
    with pytest.raises(InstallerError, match=r"printed nothing on its console for 6\d s") as caught:
        watcher(Script(tmp_path, clock), clock).run()
    assert clock() - 1000.0 <= 62
    assert "--accel tcg" in caught.value.hint


def test_the_confirmation_prompt(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(3, "console", "Continue with autoinstall? (yes|no)")
    with pytest.raises(InstallerError, match="waiting for a confirmation") as caught:
        watcher(script, clock).run()
    assert "autoinstall` is missing from the kernel command line" in caught.value.hint


def test_the_interactive_fallback(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(
        3, "console", "  Use UP, DOWN and ENTER keys to select your language."
    )
    with pytest.raises(InstallerError, match="interactive UI") as caught:
        watcher(script, clock).run()
    assert "#cloud-config" in caught.value.hint


def test_a_kernel_panic(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(
        2, "console", "[ 3.1] Kernel panic - not syncing: VFS: Unable to mount root fs"
    )
    with pytest.raises(InstallerError, match="the guest kernel panicked: Kernel panic - not syncing: VFS"):
        watcher(script, clock).run()


def test_a_crashed_domain(tmp_path: Path) -> None:
    clock = Clock()
    script = (
        Script(tmp_path, clock)
        .at(1, "console", "booting")
        .stop_at(5, DomainState(False, "crashed", "panicked"))
    )
    with pytest.raises(InstallerError, match="the guest crashed"):
        watcher(script, clock).run()


def test_an_installer_error_is_diagnosed_with_its_logs(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock)
    script.at(2, "console", "start: subiquity/Late/run: running late-commands")
    script.at(3, "console", "finish: subiquity/Late/run/command_1: FAIL: sh /run/nodetrust-staging/stage.sh")
    script.at(3.5, "console", "finish: subiquity/Late/run: FAIL: running late-commands")
    script.at(4, "console", "An error occurred during installation: Command failed: exit status 100")
    for i, line in enumerate(["NODETRUST-INSTALLER-LOGS-BEGIN", "==== /var/log/installer/installer.log",
                              "E: Unable to locate package kubelet", "NODETRUST-INSTALLER-LOGS-END"]):  # fmt: skip
        script.at(10 + i * 0.1, "data", line)
    with pytest.raises(InstallerError) as caught:
        watcher(script, clock).run()
    message = caught.value.message
    assert message.startswith(
        "the installer failed: subiquity/Late/run/command_1: sh /run/nodetrust-staging"
    )
    assert "An error occurred during installation: Command failed" in message
    assert "E: Unable to locate package kubelet" in message
    assert clock() - 1000.0 < 15  # as soon as the dump is complete


def test_an_installer_error_without_a_dump_is_reported_after_a_grace_period(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(2, "console", "An error occurred during installation: boom")
    with pytest.raises(InstallerError, match="error-commands dumped no logs"):
        watcher(script, clock).run()
    assert 120 <= clock() - 1000.0 <= 125


def test_idle_limits_per_phase(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(2, "console", "start: subiquity/Install/install: installing system")
    limits = Watchdog(boot=600, install=30, late=600, shutdown=600, total=3600)
    with pytest.raises(
        InstallerError, match=r"the installer showed no progress for 3\d s .*idle limit 30 s"
    ):
        watcher(script, clock, limits).run()
    clock = Clock()
    (tmp_path / "b").mkdir()
    script = Script(tmp_path / "b", clock)
    script.at(1, "data", "NODETRUST-STAGE-BEGIN").at(2, "data", "NODETRUST-STAGE-DONE")
    limits = Watchdog(boot=600, install=600, late=600, shutdown=20, total=3600)
    with pytest.raises(InstallerError, match="did not power off"):
        watcher(script, clock, limits).run()


def test_the_total_limit(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock)
    for t in range(1, 200):
        script.at(t, "console", f"line {t}")
    with pytest.raises(InstallerError, match=r"longer than watchdog.total \(100 s\)"):
        watcher(script, clock, Watchdog(boot=60, install=60, late=60, shutdown=60, total=100)).run()


def test_power_off_before_the_staging_step_finished(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(1, "console", "start: subiquity/Install/install: x").stop_at(3)
    with pytest.raises(
        InstallerError,
        match=r"powered off before the late-command \(stage\.sh, the base plan\) reported completion",
    ):
        watcher(script, clock).run()
    clock = Clock()
    (tmp_path / "d").mkdir()
    script = (
        Script(tmp_path / "d", clock)
        .at(1, "console", "x")
        .stop_at(3, DomainState(False, "shutoff", "destroyed"))
    )
    with pytest.raises(VmError, match=r"stopped unexpectedly \(shutoff, destroyed\)"):
        watcher(script, clock).run()


def test_a_damaged_package_list_is_refused() -> None:
    port = DataPort()
    for line in ["NODETRUST-PACKAGES-BEGIN", "a\t1\tamd64", f"NODETRUST-PACKAGES-END 2 {'0' * 64}"]:
        with pytest.raises(InstallerError, match="damaged") if "END" in line else _nothing():
            port.feed(line)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def test_line_tail_handles_partial_lines_and_escapes(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    tail = LineTail(path)
    assert tail.read() == []
    path.write_bytes(b"\x1b[0mfirst\r\nsec")
    assert tail.read() == ["first"]
    with path.open("ab") as fh:
        fh.write(b"ond\r\n")
    assert tail.read() == ["second"]
    assert tail.tail() == "first\nsecond"


def test_the_listener_takes_webhook_events_one_after_another_on_one_connection() -> None:
    listener = EventListener("tok")
    try:
        event = {"name": "subiquity/Install/install", "description": "installing system", "event_type": "start",
                 "origin": "subiquity", "timestamp": 1.5, "level": "INFO"}  # fmt: skip
        # like QEMU's guestfwd chardev: every guest connection's bytes arrive on one host connection
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            for path in ("/nodetrust/tok/events", "/nodetrust/wrong/events", "/nodetrust/tok/events"):
                body = json.dumps(event).encode()
                sock.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
                )
                reply = sock.recv(1024)
                assert reply.startswith(b"HTTP/1.1 200" if "tok" in path else b"HTTP/1.1 404"), reply
        # and an ordinary client, one request per connection
        conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=5)
        conn.request(
            "POST", "/nodetrust/tok/events", json.dumps({**event, "event_type": "finish", "result": "FAIL"})
        )
        assert conn.getresponse().status == 200
        conn.close()
        got = [listener.events.get(timeout=5) for _ in range(3)]
        assert got[0] == InstallerEvent(
            "start", "subiquity/Install/install", "installing system", "", "INFO"
        )
        assert got[2].result == "FAIL"
        assert listener.received == 3
    finally:
        listener.close()


# -- the provisioning boot ------------------------------------------------------------------------


def provision_watcher(script: Script, clock: Clock) -> ProvisionWatcher:
    limits = Watchdog(boot=60, install=60, late=60, shutdown=60, total=3600)
    return ProvisionWatcher(script, script.console, script.data, None, limits, poll_s=1.0, clock=clock,
                            wall=clock, sleep=clock.sleep)  # fmt: skip


def provisioned(script: Script) -> Script:
    script.at(1, "console", "[    0.000000] Linux version 6.1.0-28-amd64")
    script.at(4, "console", "nodetrust-provision: running the staging plan from /dev/vdb")
    script.at(5, "data", "NODETRUST-STAGE-BEGIN")
    script.at(6, "console", "nodetrust-stage: [6.1s] apt install kubeadm=1.36.3-1.1")
    for i, line in enumerate(packages_block(["kubeadm\t1.36.3-1.1\tamd64"])):
        script.at(30 + i * 0.01, "data", line)
    script.at(31, "data", "NODETRUST-INSTALLED-SIZE 7654321")
    script.at(32, "data", "NODETRUST-STAGE-DONE")
    script.at(33, "console", "nodetrust-provision: powering off")
    return script


def test_a_successful_provisioning_boot(tmp_path: Path) -> None:
    clock = Clock()
    result = provision_watcher(provisioned(Script(tmp_path, clock)).stop_at(35), clock).run()
    assert result.packages == [{"name": "kubeadm", "version": "1.36.3-1.1", "architecture": "amd64"}]
    assert result.installed_size == 7654321
    assert [p.name for p in result.phases] == ["boot", "stage", "shutdown"]
    assert result.events == 0


def test_a_failed_staging_plan_in_the_provisioning_boot(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock)
    script.at(1, "console", "[    0.000000] Linux version 6.1.0-28-amd64")
    script.at(5, "data", "NODETRUST-STAGE-BEGIN")
    script.at(6, "console", "E: Unable to locate package kubeadm")
    script.at(7, "data", "NODETRUST-STAGE-FAILED 100")
    with pytest.raises(
        InstallerError, match=r"the staging plan failed \(stage\.sh exited with status 100\)"
    ):
        provision_watcher(script, clock).run()


def test_the_base_kernel_cannot_find_its_root(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock).at(
        2, "console", "[ 3.1] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)"
    )
    with pytest.raises(InstallerError, match="the base's kernel panicked") as caught:
        provision_watcher(script, clock).run()
    assert "wrong root=" in caught.value.hint


def test_a_provisioning_boot_that_stops_making_progress(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock)
    script.at(1, "console", "[    0.000000] Linux version 6.1.0-28-amd64")
    script.at(5, "data", "NODETRUST-STAGE-BEGIN")
    script.at(6, "console", "nodetrust-stage: [6.1s] venv /opt/nodeagent/venv: nodetrust[agent]==0.1.0")
    with pytest.raises(
        InstallerError, match=r"the staging plan showed no progress for 6\d s \(idle limit 60 s\)"
    ):
        provision_watcher(script, clock).run()


def test_a_provisioning_boot_that_powers_off_early(tmp_path: Path) -> None:
    clock = Clock()
    script = Script(tmp_path, clock)
    script.at(1, "console", "[    0.000000] Linux version 6.1.0-28-amd64")
    script.at(5, "data", "NODETRUST-STAGE-BEGIN")
    script.stop_at(8)
    with pytest.raises(InstallerError, match="powered off before the staging plan reported completion"):
        provision_watcher(script, clock).run()
