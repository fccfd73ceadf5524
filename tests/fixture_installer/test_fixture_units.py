"""Fast checks of the fixture installer's logic, on the host, without a VM.

The live installer's modules are plain Python; here they run against temporary
directories and a fake runner. Seeds, apt repositories and the initrd archive format
are checked with the real tools (marker ``subprocess``).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from fixtures.installer import build, media, rootfs
from fixtures.installer.aptrepo import make_flat_repo
from fixtures.installer.live import configure, curtin
from fixtures.installer.live.autoinstall import (
    AutoinstallError,
    KernelCmdline,
    Seed,
    from_cloud_config,
    validate,
)
from fixtures.installer.live.reporting import Console, Event, Reporter
from fixtures.installer.live.runner import Result, Runner
from fixtures.installer.live.storage import Disk, Layout, StorageError, choose_disk
from fixtures.installer.proc import run
from fixtures.installer.seed import make_seed

# -- kernel command line ------------------------------------------------------------------


def test_cmdline_autoinstall_and_seed_url() -> None:
    cmdline = KernelCmdline.parse(
        "BOOT_IMAGE=/casper/vmlinuz autoinstall 'ds=nocloud;s=http://10.0.2.2:3003/x/' quiet"
    )
    assert cmdline.autoinstall
    assert cmdline.nocloud_seed_url() == "http://10.0.2.2:3003/x/"
    assert (
        KernelCmdline.parse("ds=nocloud-net;seedfrom=/cdrom/nocloud/").nocloud_seed_url()
        == "/cdrom/nocloud/"
    )
    assert KernelCmdline.parse("ds=nocloud console=ttyS0").nocloud_seed_url() is None
    assert not KernelCmdline.parse("autoinstall=no ds=nocloud").autoinstall


def test_cmdline_carryover_is_curtins() -> None:
    cmdline = KernelCmdline.parse(
        "BOOT_IMAGE=/casper/vmlinuz autoinstall console=tty0 console=ttyS0,115200 quiet --- no_timer_check BOOTIF=01-aa"
    )
    assert cmdline.carryover() == ["console=tty0", "console=ttyS0,115200", "no_timer_check"]
    assert KernelCmdline.parse("autoinstall console=ttyS0").carryover() == ["console=ttyS0"]


# -- autoinstall data ---------------------------------------------------------------------


def test_cloud_config_needs_header_and_autoinstall_key() -> None:
    good = Seed("test", b"#cloud-config\nautoinstall:\n  version: 1\n")
    config = from_cloud_config(good)
    assert config is not None
    assert config.data == {"version": 1}
    assert from_cloud_config(Seed("test", b"autoinstall:\n  version: 1\n")) is None
    assert from_cloud_config(Seed("test", b"#cloud-config\nhostname: x\n")) is None


def test_validate() -> None:
    base: dict[str, Any] = {"version": 1, "identity": {"username": "u", "password": "x"}}
    assert validate(base) == []
    assert validate({"version": 1, "user-data": {"users": []}}) == []
    warnings = validate({**base, "frobnicate": True, "snaps": []})
    assert any("unknown autoinstall key 'frobnicate'" in w for w in warnings)
    assert any("'snaps'" in w for w in warnings)
    bad: list[Mapping[str, Any]] = [
        {},
        {"version": 2},
        {"version": 1},
        {**base, "late-commands": "echo not a list"},
        {**base, "storage": {"config": []}},
        {**base, "shutdown": "halt"},
        {"version": 1, "identity": {"username": "u"}},
        {**base, "reporting": {"hook": {"endpoint": "http://x/"}}},
    ]
    for data in bad:
        with pytest.raises(AutoinstallError):
            validate(data)


# -- reporting ----------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.level = 10
        self.events: list[Event] = []

    def publish(self, event: Event) -> None:
        self.events.append(event)

    def flush(self, timeout: float) -> None:
        return None


def test_event_formats() -> None:
    start = Event("start", "subiquity/Install/install", "installing system", "subiquity", "INFO", 1.5)
    finish = Event(
        "finish", "subiquity/Install/install", "installing system", "subiquity", "INFO", 2.5, "FAIL"
    )
    assert start.as_string() == "start: subiquity/Install/install: installing system"
    assert finish.as_string() == "finish: subiquity/Install/install: FAIL: installing system"
    assert finish.as_dict() == {
        "name": "subiquity/Install/install",
        "description": "installing system",
        "event_type": "finish",
        "origin": "subiquity",
        "timestamp": 2.5,
        "level": "INFO",
        "result": "FAIL",
    }
    assert "result" not in start.as_dict()


def test_failure_bubbles_to_every_parent(tmp_path: Path) -> None:
    reporter = Reporter(Console(str(tmp_path / "console")))
    recorder = Recorder()
    reporter.handlers = [recorder]
    with pytest.raises(RuntimeError), reporter.step("subiquity/Late/run", "late") as late:
        with late.child("command_0", "true"):
            pass
        with late.child("command_1", "false"):
            raise RuntimeError("boom")
    assert [(e.event_type, e.name, e.result) for e in recorder.events] == [
        ("start", "subiquity/Late/run", None),
        ("start", "subiquity/Late/run/command_0", None),
        ("finish", "subiquity/Late/run/command_0", "SUCCESS"),
        ("start", "subiquity/Late/run/command_1", None),
        ("finish", "subiquity/Late/run/command_1", "FAIL"),
        ("finish", "subiquity/Late/run", "FAIL"),
    ]


def test_reporting_config_keeps_builtin_print_and_filters_levels(tmp_path: Path) -> None:
    console_file = tmp_path / "console"
    console_file.touch()
    reporter = Reporter(Console(str(console_file)))
    reporter.configure({"builtin": {"type": "print"}, "quiet": {"type": "print", "level": "ERROR"}})
    with reporter.step("a", "visible"), reporter.step("a/b", "debug only", level="DEBUG"):
        pass
    text = console_file.read_text()
    assert text.count("start: a: visible") == 1  # the ERROR-level printer dropped it
    assert "start: a/b: debug only" in text


# -- what goes into the target ------------------------------------------------------------


def test_fstab_and_grub(tmp_path: Path) -> None:
    layout = Layout(Disk("vda", 8 << 30, "", "", False), "/dev/vda1", "/dev/vda2", "AAAA-BBBB", "1234-uuid")
    fstab = configure.fstab_text(layout)
    assert "/dev/disk/by-uuid/1234-uuid / ext4 defaults 0 1" in fstab
    assert "/dev/disk/by-uuid/AAAA-BBBB /boot/efi vfat defaults 0 1" in fstab
    grub = tmp_path / "etc/default/grub"
    grub.parent.mkdir(parents=True)
    grub.write_text('GRUB_TIMEOUT=0\nGRUB_CMDLINE_LINUX_DEFAULT="quiet"\nGRUB_CMDLINE_LINUX=""\n')
    configure.set_grub_cmdline(tmp_path, ["console=ttyS0,115200", "no_timer_check"])
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="console=ttyS0,115200 no_timer_check"\n' in grub.read_text()


def test_apt_plan() -> None:
    plan = configure.apt_plan(
        {
            "geoip": False,
            "primary": [{"arches": ["default"], "uri": "http://archive.ubuntu.com/ubuntu"}],
            "sources": {
                "stage": {"source": "deb [trusted=yes] http://10.0.2.100:8080/repo ./"},
                "k8s.list": {"source": "deb $MIRROR $RELEASE main", "key": "KEY"},
            },
        }
    )
    assert (
        plan.source_files["/etc/apt/sources.list.d/stage.list"]
        == "deb [trusted=yes] http://10.0.2.100:8080/repo ./\n"
    )
    assert (
        plan.source_files["/etc/apt/sources.list.d/k8s.list"]
        == "deb http://archive.ubuntu.com/ubuntu bookworm main\n"
    )
    assert plan.key_files == {"/etc/apt/trusted.gpg.d/k8s.asc": "KEY"}
    assert any("recorded only" in note for note in plan.notes)


def test_cloud_config_like_subiquity() -> None:
    autoinstall: dict[str, Any] = {
        "identity": {"hostname": "n0", "username": "ubuntu", "password": "$6$x", "realname": "U"},
        "ssh": {"install-server": True, "allow-pw": False, "authorized-keys": ["ssh-ed25519 AAA k"]},
        "user-data": {"users": [{"name": "ops"}], "runcmd": ["true"]},
    }
    config = configure.cloud_config(autoinstall, ["adm", "sudo"])
    assert [u["name"] for u in config["users"]] == ["ubuntu", "ops"]
    assert config["users"][0]["ssh_authorized_keys"] == ["ssh-ed25519 AAA k"]
    assert config["users"][0]["groups"] == "adm,sudo"
    assert config["ssh_pwauth"] is False
    assert config["runcmd"] == ["true"]
    assert config["write_files"][-1]["path"] == "/etc/cloud/cloud-init.disabled"
    files = {
        path: (content, mode)
        for path, content, mode in configure.cloud_init_files(config, {"version": 2}, "n0")
    }
    installer_cfg = yaml.safe_load(files["/etc/cloud/cloud.cfg.d/99-installer.cfg"][0])
    assert installer_cfg["datasource_list"] == ["None"]
    assert installer_cfg["datasource"]["None"]["userdata_raw"].startswith("#cloud-config\n")
    assert files["/etc/cloud/cloud.cfg.d/99-installer.cfg"][1] == 0o600
    assert files["/etc/hostname"][0] == "n0\n"
    assert "network" in yaml.safe_load(files["/etc/cloud/cloud.cfg.d/90-installer-network.cfg"][0])


def test_resolved_autoinstall_is_cloud_config() -> None:
    text = configure.resolved_autoinstall({"version": 1})
    assert text.startswith("#cloud-config\n")
    assert yaml.safe_load(text) == {"autoinstall": {"version": 1}}


# -- disk choice --------------------------------------------------------------------------


class FakeRunner(Runner):
    """Answers the blkid/findmnt/lsblk questions of the disk choice with nothing."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(Console(str(tmp_path / "console")))

    def run(self, argv: Sequence[str], **kwargs: Any) -> Result:
        return Result(0, "")


def _fake_sys_block(root: Path, disks: Mapping[str, int]) -> Path:
    for name, gib in disks.items():
        entry = root / name
        (entry / "queue").mkdir(parents=True)
        (entry / "size").write_text(str(gib * 2**30 // 512))
        (entry / "ro").write_text("0")
        (entry / "queue/rotational").write_text("0")
    return root


def test_choose_disk_largest_first_by_name(tmp_path: Path) -> None:
    sys_block = _fake_sys_block(tmp_path / "sys", {"vda": 8, "vdb": 8, "vdc": 0, "loop0": 100, "sr0": 1})
    runner = FakeRunner(tmp_path)
    assert choose_disk(runner, {}, 2 << 30, sys_block=sys_block).name == "vda"
    assert choose_disk(runner, {"path": "/dev/vdb"}, 2 << 30, sys_block=sys_block).name == "vdb"
    with pytest.raises(StorageError, match="large enough"):
        choose_disk(runner, {}, 9 << 30, sys_block=sys_block)
    bigger = _fake_sys_block(tmp_path / "sys2", {"vda": 8, "vdb": 20})
    assert choose_disk(runner, {}, 2 << 30, sys_block=bigger).name == "vdb"


# -- curtin --------------------------------------------------------------------------------


def test_curtin_in_target_arguments() -> None:
    args = curtin.parse_args(["in-target", "--target=/target", "--", "sh", "-c", "echo -n x"])
    assert args.command == "in-target"
    assert args.target == "/target"
    assert curtin.command_of(args) == ["sh", "-c", "echo -n x"]
    args = curtin.parse_args(["system-install", "-t", "/t", "--", "hello", "world"])
    assert curtin.command_of(args) == ["hello", "world"]


# -- the build ----------------------------------------------------------------------------


def test_recipe_key_covers_the_recipe_only() -> None:
    names = {p.relative_to(build.PACKAGE_DIR).as_posix() for p in build.recipe_files()}
    assert {"build.py", "rootfs.py", "media.py", "files/initrd-init.sh", "live/install.py"} <= names
    assert "seed.py" not in names
    assert build.recipe_key() == build.recipe_key()


def test_package_manifest(tmp_path: Path) -> None:
    status = tmp_path / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text(
        "Package: b\nStatus: install ok installed\nVersion: 2\n\n"
        "Package: a\nStatus: deinstall ok config-files\nVersion: 1\n\n"
        "Package: c\nStatus: install ok installed\nVersion: 3\n"
    )
    assert rootfs.package_manifest(tmp_path) == "b\t2\nc\t3\n"


@pytest.mark.subprocess
@pytest.mark.parametrize("script", ["initrd-init.sh", "target-setup.sh", "curtin"])
def test_shell_scripts_parse(script: str) -> None:
    run(["sh", "-n", str(media.FILES / script)])


@pytest.mark.subprocess
def test_initrd_archive_lists_with_cpio(tmp_path: Path) -> None:
    data = media._newc(
        [
            media._Entry("bin", 0o040755),
            media._Entry("bin/sh", 0o120777, b"busybox"),
            media._Entry("init", 0o100755, b"x"),
        ]
    )
    listing = run(["cpio", "-t", "--quiet"], input_bytes=data).stdout.decode().split()
    assert listing == ["bin", "bin/sh", "init"]


@pytest.mark.subprocess
@pytest.mark.parametrize("fmt", ["iso9660", "vfat"])
def test_make_seed(tmp_path: Path, fmt: Literal["iso9660", "vfat"]) -> None:
    out = make_seed(
        "#cloud-config\nautoinstall: {version: 1}\n", "instance-id: i\n", tmp_path / "seed.img", fmt=fmt
    )
    label = run(["blkid", "-o", "value", "-s", "LABEL", str(out)]).stdout.decode().strip()
    assert label == "CIDATA"
    if fmt == "vfat":
        listing = run(["mdir", "-b", "-i", str(out), "::/"]).stdout.decode()
    else:
        listing = run(["xorriso", "-indev", str(out), "-ls", "/"]).stdout.decode()
    assert "user-data" in listing
    assert "meta-data" in listing


@pytest.mark.subprocess
def test_flat_repo(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: t\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t.invalid>\nDescription: t\n"
    )
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(repo / "t_1_all.deb")])
    make_flat_repo(repo)
    packages = (repo / "Packages").read_text()
    assert "Package: t\n" in packages
    assert "Filename: ./t_1_all.deb\n" in packages
    assert "SHA256: " in packages
    assert " Packages\n" in (repo / "Release").read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_fixture_build_stops_on_a_signal_even_with_sigint_inherited_ignored(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A mirror that accepts the connection and never answers holds debootstrap; the signal then stops the
    build (started the way a script's background job is, with SIGINT ignored) and nothing is cached."""
    mirror = socket.socket()
    mirror.bind(("127.0.0.1", 0))
    mirror.listen(8)
    mirror.settimeout(600)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fixtures.installer.build", "--cache-dir", str(tmp_path / "cache"),
             "--mirror", f"http://127.0.0.1:{mirror.getsockname()[1]}/debian"],
            cwd=Path(build.__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        held, _ = mirror.accept()  # debootstrap asks the mirror: the build is in its rootfs step
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=120)
        held.close()
    finally:
        mirror.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "fixture installer build interrupted; nothing was cached" in err
    left = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".lock-"))
    assert left in ([], ["packages"]), (
        f"a build folder or an entry was left: {left}"
    )  # packages: debootstrap's cache
    assert build.cached_iso(tmp_path / "cache") is None
