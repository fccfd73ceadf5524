"""Boot the fixture installer ISO for real (QEMU, TCG, OVMF) and hold it to subiquity's contract.

1. A full autoinstall: the VM powers itself off, the webhook saw paired start/finish
   events ending in SUCCESS, and the installed disk boots (UEFI, no NVRAM entry) to
   multi-user with cloud-init done, showing what late-commands, ``curtin in-target``,
   the staging medium and ``packages`` (from an http apt source) put there.
2. A late-command that fails: FAIL events, error-commands ran, and the VM waits.
3. No ``autoinstall`` on the kernel command line: the confirmation prompt.
4. A seed without an ``autoinstall`` key: the interactive language screen.

Each test boots one VM at a time. Times are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.installer.aptrepo import make_flat_repo
from fixtures.installer.proc import run
from fixtures.installer.seed import make_seed, make_staging_medium
from tests.fixture_installer.conftest import BootFiles, new_disk
from tests.fixture_installer.qemu import GUEST_SERVICE, Listener, Vm, one_vm

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]

INSTALL_TIMEOUT = 1500.0
FIRST_BOOT_TIMEOUT = 900.0
BOOT_TO_INSTALLER_TIMEOUT = 600.0
WEBHOOK = f"http://{GUEST_SERVICE}/events"
# The installer's own boot; after `---` what curtin carries into the installed system.
INSTALL_CMDLINE = "autoinstall ds=nocloud console=ttyS0,115200 quiet --- no_timer_check"
# A hashed password for "ubuntu" (SHA-512 crypt); never used to log in.
PASSWORD_HASH = (
    "$6$nodetrust$6Zt6oQ0eE8kRzvX0tYvO1b3m0hq0iL9r3oH1c2rX6m4o8O8iS6ZfH2uJc1pV3q9yQmM4vT0sW2nB5dA7eK9gL."
)

FIRSTBOOT_SCRIPT = """\
#!/bin/sh
# Reports the installed system's first boot on the serial console, then powers off.
# (Like Ubuntu 24.04's installer, the fixture has cloud-init disable itself after the
# first boot, so `cloud-init status` ends as "disabled"; result.json tells the outcome.)
cloud-init status --wait >/dev/null 2>&1
errors=$(python3 -c 'import json; print(json.load(open("/run/cloud-init/result.json"))["v1"]["errors"])')
finished=no; [ -f /var/lib/cloud/instance/boot-finished ] && finished=yes
disabled=no; [ -f /etc/cloud/cloud-init.disabled ] && disabled=yes
system=$(systemctl is-system-running --wait 2>&1)
failed=$(systemctl --failed --no-legend --plain | awk '{print $1}' | tr '\\n' ' ')
echo "NODETRUST-FIRSTBOOT multi-user=$(systemctl is-active multi-user.target) system=$system" \\
  "failed=[$failed] cloud-init-errors=$errors boot-finished=$finished disabled-after=$disabled" \\
  "late=$(cat /etc/nodetrust-late-marker) in-target=$(cat /etc/nodetrust-in-target)" \\
  "staged=$(cat /etc/nodetrust-staged.txt) hello=$(cat /usr/share/nodetrust-fixture-hello/hello.txt)" \\
  "staged-pkg=$(cat /usr/share/nodetrust-fixture-staged/hello.txt)" \\
  "autoinstall-mode=$(stat -c %a /var/log/installer/autoinstall-user-data)" \\
  "user=$(id -un 1000) hostname=$(hostname) cmdline=[$(cat /proc/cmdline)]" > /dev/ttyS0
systemctl poweroff
"""

FIRSTBOOT_UNIT = """\
[Unit]
Description=nodetrust fixture test: report the first boot, then power off
After=multi-user.target cloud-final.service

[Service]
Type=simple
ExecStart=/bin/sh /usr/local/sbin/nodetrust-firstboot-check

[Install]
WantedBy=multi-user.target
"""


def user_data(autoinstall: dict[str, Any]) -> str:
    return "#cloud-config\n" + yaml.safe_dump({"autoinstall": autoinstall}, sort_keys=False)


def base_autoinstall(**extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "version": 1,
        "storage": {"layout": {"name": "direct"}},
        "identity": {"hostname": "node0", "username": "ubuntu", "password": PASSWORD_HASH},
        "ssh": {"install-server": True, "allow-pw": False},
        "reporting": {"builder": {"type": "webhook", "endpoint": WEBHOOK, "level": "INFO"}},
        "shutdown": "poweroff",
    }
    config.update(extra)
    return config


def check_event_stream(events: list[dict[str, Any]]) -> None:
    """Every event is well formed and every start has its finish, innermost first."""
    assert events, "no webhook events arrived"
    stack: list[str] = []
    for event in events:
        assert {"name", "description", "event_type", "origin", "timestamp", "level"} <= event.keys(), event
        assert isinstance(event["timestamp"], float), event
        assert event["origin"] in ("subiquity", "curtin"), event
        if event["event_type"] == "start":
            stack.append(event["name"])
        else:
            assert event["event_type"] == "finish", event
            assert event["result"] in ("SUCCESS", "WARN", "FAIL"), event
            assert stack and stack[-1] == event["name"], f"finish without its start: {event} (open: {stack})"
            stack.pop()
    assert not stack, f"starts without a finish: {stack}"


def build_deb(workdir: Path, name: str, text: str, out_dir: Path) -> Path:
    """A tiny arch-all package installing /usr/share/<name>/hello.txt."""
    root = workdir / f"{name}-pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / f"usr/share/{name}").mkdir(parents=True)
    (root / f"usr/share/{name}/hello.txt").write_text(text + "\n")
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: nodetrust tests <tests@nodetrust.invalid>\n"
        "Description: a package the fixture installer test installs\n"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    deb = out_dir / f"{name}_1.0_all.deb"
    run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)])
    return deb


def http_repo(workdir: Path) -> dict[str, bytes]:
    """A one-package flat apt repository, served at /repo/ by the listener (for ``packages``)."""
    repo = workdir / "http-repo"
    build_deb(workdir, "nodetrust-fixture-hello", "hello-from-http-repo", repo)
    make_flat_repo(repo)
    return {f"/repo/{p.name}": p.read_bytes() for p in repo.iterdir()}


def staging_medium(workdir: Path) -> Path:
    """The staging-medium convention: ISO 9660 labelled NTSTAGE with repo/ and files/."""
    tree = workdir / "ntstage"
    build_deb(workdir, "nodetrust-fixture-staged", "staged-from-ntstage-repo", tree / "repo")
    make_flat_repo(tree / "repo")
    (tree / "files").mkdir()
    (tree / "files/payload.txt").write_text("staged-from-ntstage\n")
    return make_staging_medium(tree, workdir / "ntstage.iso")


# What a builder's late-commands do with the staging medium (works the same on Ubuntu).
STAGING_LATE_COMMANDS: list[str | list[str]] = [
    "mkdir -p /target/media/ntstage && mount -o ro /dev/disk/by-label/NTSTAGE /target/media/ntstage",
    "echo 'deb [trusted=yes] file:/media/ntstage/repo ./' > /target/etc/apt/sources.list.d/ntstage.list",
    "curtin in-target --target=/target -- apt-get update -o Dir::Etc::sourcelist=sources.list.d/ntstage.list"
    " -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0",
    "curtin in-target --target=/target -- env DEBIAN_FRONTEND=noninteractive"
    " apt-get install -y --no-install-recommends nodetrust-fixture-staged",
    "cp /target/media/ntstage/files/payload.txt /target/etc/nodetrust-staged.txt",
    "rm /target/etc/apt/sources.list.d/ntstage.list && umount /target/media/ntstage",
]


def test_autoinstall_installs_a_bootable_node(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    listener.files.update(http_repo(tmp_path))
    config = base_autoinstall(
        **{
            "early-commands": ["systemctl stop ssh", "echo early-commands-ran"],
            "network": {"version": 2, "ethernets": {"wired": {"match": {"name": "en*"}, "dhcp4": True}}},
            "apt": {
                "geoip": False,
                "fallback": "offline-install",
                "sources": {
                    "nodetrust-staging": {"source": f"deb [trusted=yes] http://{GUEST_SERVICE}/repo ./"}
                },
            },
            "packages": ["nodetrust-fixture-hello"],
            # accepted the way an Ubuntu build would send them; offline they only leave notes
            "updates": "security",
            "refresh-installer": {"update": False},
            "source": {"id": "ubuntu-server-minimal", "search_drivers": False},
            "timezone": "Etc/UTC",
            "locale": "en_US.UTF-8",
            "keyboard": {"layout": "us"},
            "late-commands": [
                "echo late-marker > /target/etc/nodetrust-late-marker",
                "curtin in-target --target=/target -- sh -c 'echo in-target-ok > /etc/nodetrust-in-target'",
                *STAGING_LATE_COMMANDS,
                f"cat > /target/usr/local/sbin/nodetrust-firstboot-check <<'EOF'\n{FIRSTBOOT_SCRIPT}EOF\n",
                f"cat > /target/etc/systemd/system/nodetrust-firstboot-check.service <<'EOF'\n{FIRSTBOOT_UNIT}EOF\n",
                [
                    "curtin",
                    "in-target",
                    "--target=/target",
                    "--",
                    "systemctl",
                    "enable",
                    "nodetrust-firstboot-check",
                ],
            ],
            "error-commands": ["tail -n 40 /var/log/installer/installer.log"],
        }
    )
    seed = make_seed(user_data(config), "instance-id: fixture-install-1\n", tmp_path / "seed.iso")
    disk = new_disk(tmp_path / "node.qcow2")
    install = Vm(
        "install",
        tmp_path,
        drives=[
            (disk, "disk"),
            (boot_files.iso, "cdrom"),
            (seed, "seed"),
            (staging_medium(tmp_path), "cdrom"),
        ],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append=INSTALL_CMDLINE,
        listener_port=listener.port,
    )
    with one_vm(install):
        code = install.wait_exit(INSTALL_TIMEOUT)
    console = install.console()
    print(f"\ninstall: {install.elapsed():.0f} s until the VM powered itself off")
    assert code == 0, f"qemu exited with {code}"
    assert "early-commands-ran" in console
    assert "finish: subiquity/Install/install: SUCCESS: installing system" in console
    assert "finish: subiquity/Shutdown/shutdown: SUCCESS: mode=POWEROFF" in console

    events = listener.snapshot()
    check_event_stream(events)
    names = [e["name"] for e in events if e["event_type"] == "start"]
    for phase in (
        "subiquity/Early/run",
        "subiquity/Install/install/partitioning",
        "subiquity/Install/install/extract",
        "subiquity/Install/install/curthooks",
        "subiquity/Install/install/postinstall/install_nodetrust-fixture-hello",
        "subiquity/Late/run",
        "subiquity/Shutdown/copy_logs_to_target",
        "subiquity/Shutdown/shutdown",
    ):
        assert phase in names, f"no {phase} event; got {names}"
    assert all(e["level"] == "INFO" for e in events), "the webhook asked for INFO and got DEBUG events"
    assert not [e for e in events if e.get("result") == "FAIL"]
    last = events[-1]
    assert (last["name"], last["event_type"], last["result"]) == (
        "subiquity/Shutdown/shutdown",
        "finish",
        "SUCCESS",
    )
    assert "GET /repo/Packages" in listener.requests

    first_boot = Vm("first-boot", tmp_path, drives=[(disk, "disk")])
    with one_vm(first_boot):
        code = first_boot.wait_exit(FIRST_BOOT_TIMEOUT)
    console = first_boot.console()
    print(f"first boot: {first_boot.elapsed():.0f} s until the check unit powered it off")
    assert code == 0
    report = next((line for line in console.splitlines() if "NODETRUST-FIRSTBOOT" in line), None)
    assert report is not None, "the first-boot check did not report:\n" + console[-4000:]
    for expected in (
        "multi-user=active",
        "system=running",
        "cloud-init-errors=[]",
        "boot-finished=yes",
        "disabled-after=yes",
        "late=late-marker",
        "in-target=in-target-ok",
        "staged=staged-from-ntstage",
        "hello=hello-from-http-repo",
        "staged-pkg=staged-from-ntstage-repo",
        "autoinstall-mode=400",
        "user=ubuntu",
        "hostname=node0",
        "console=ttyS0,115200",
        "no_timer_check",
    ):
        assert expected in report, f"{expected!r} not in the first-boot report: {report}"


def test_failing_late_command_reports_fail_and_waits(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    config = base_autoinstall(
        **{
            "late-commands": ["echo before-the-failure", "false", "echo never-runs"],
            "error-commands": ["echo NODETRUST-ERROR-COMMANDS-RAN state=$(cat /run/subiquity/server-state)"],
        }
    )
    seed = make_seed(user_data(config), "instance-id: fixture-install-2\n", tmp_path / "seed.iso")
    vm = Vm(
        "install-fails",
        tmp_path,
        drives=[(new_disk(tmp_path / "node.qcow2"), "disk"), (boot_files.iso, "cdrom"), (seed, "seed")],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append=INSTALL_CMDLINE,
        listener_port=listener.port,
    )

    def failed() -> bool:
        return (
            any(e.get("result") == "FAIL" and e["name"] == "subiquity/Late/run" for e in listener.snapshot())
            and "the installer is waiting (state ERROR)" in vm.console()
        )

    with one_vm(vm):
        vm.wait_for("a FAIL event for the late-commands and the ERROR state", failed, INSTALL_TIMEOUT)
        print(f"\nfailing install: FAIL reported after {vm.elapsed():.0f} s")
        time.sleep(20)
        assert vm.running(), "the installer powered off after a failure; it must wait in state ERROR"
        console = vm.console()
    events = listener.snapshot()
    check_event_stream(events)
    fails = {e["name"] for e in events if e.get("result") == "FAIL"}
    assert fails == {"subiquity/Late/run/command_1", "subiquity/Late/run"}, fails
    assert "subiquity/Error/run" in {e["name"] for e in events}
    assert not [e for e in events if e["name"].startswith("subiquity/Shutdown")]
    assert "finish: subiquity/Late/run/command_1: FAIL: false" in console
    assert "NODETRUST-ERROR-COMMANDS-RAN state=LATE_COMMANDS" in console
    assert "An error occurred during installation" in console
    assert "never-runs" not in console


def test_without_autoinstall_argument_asks_for_confirmation(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    config = base_autoinstall(**{"early-commands": ["echo early-before-prompt"]})
    listener.files["/seed/user-data"] = user_data(config).encode()
    listener.files["/seed/meta-data"] = b"instance-id: fixture-prompt\n"
    vm = Vm(
        "prompt",
        tmp_path,
        drives=[(new_disk(tmp_path / "node.qcow2"), "disk"), (boot_files.iso, "cdrom")],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append=f"ds=nocloud;s=http://{GUEST_SERVICE}/seed/ console=ttyS0,115200 quiet no_timer_check",
        listener_port=listener.port,
    )
    with one_vm(vm):
        vm.wait_console(r"Continue with autoinstall\? \(yes\|no\)", BOOT_TO_INSTALLER_TIMEOUT)
        print(f"\nconfirmation prompt after {vm.elapsed():.0f} s")
        console = vm.console()
    assert "GET /seed/user-data" in listener.requests
    assert "early-before-prompt" in console.split("Continue with autoinstall?")[0]
    assert "subiquity/Install/install" not in console
    assert not [e for e in listener.snapshot() if e["name"].startswith("subiquity/Install")]


def test_seed_without_autoinstall_key_falls_back_to_interactive(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    seed = make_seed(
        "#cloud-config\nhostname: not-an-autoinstall\n",
        "instance-id: fixture-ui\n",
        tmp_path / "seed.img",
        fmt="vfat",
    )
    vm = Vm(
        "interactive",
        tmp_path,
        drives=[(new_disk(tmp_path / "node.qcow2"), "disk"), (boot_files.iso, "cdrom"), (seed, "seed")],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append="autoinstall ds=nocloud console=ttyS0,115200 quiet no_timer_check",
    )
    with one_vm(vm):
        vm.wait_console(r"Use UP, DOWN and ENTER keys to select your language\.", BOOT_TO_INSTALLER_TIMEOUT)
        print(f"\nlanguage screen after {vm.elapsed():.0f} s")
        console = vm.console()
    assert "Willkommen! Bienvenue! Welcome!" in console
    assert "start: subiquity/" not in console
