"""The build VM's domain XML, and its lifecycle against libvirt's built-in test driver."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET  # our own XML, never untrusted input
from pathlib import Path

import pytest

from imagebuilder.domain import QEMU_NS, DomainSpec, domain_xml, kernel_cmdline
from imagebuilder.errors import VmError
from imagebuilder.vm import DOMAIN_PREFIX, Connection, owner_metadata, remove_orphans

pytestmark = pytest.mark.libvirt
TEST_URI = "test:///default"


def spec(tmp_path: Path, **changes: object) -> DomainSpec:
    values: dict[str, object] = {
        "name": DOMAIN_PREFIX + "unit-1", "build_id": "unit-1", "arch": "amd64", "accel": "tcg",
        "memory_mib": 2048, "cpus": 2, "kernel": tmp_path / "vmlinuz", "initrd": tmp_path / "initrd",
        "cmdline": kernel_cmdline("amd64", "ds=nocloud", ("no_timer_check",)), "disk": tmp_path / "disk.qcow2",
        "cdrom": tmp_path / "installer.iso", "readonly_disks": (tmp_path / "seed.iso", tmp_path / "staging.iso"),
        "console_log": tmp_path / "console.log", "data_log": tmp_path / "data.log",
        "loader": Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), "nvram_template": Path("/usr/share/OVMF/OVMF_VARS_4M.fd"),
        "nvram": tmp_path / "nvram.fd", "listener_port": 40123, "extra": owner_metadata(),
    }  # fmt: skip
    values.update(changes)
    return DomainSpec(**values)  # type: ignore[arg-type]


def _parse(text: str) -> ET.Element:
    return ET.fromstring(text)  # noqa: S314 - the builder's own XML


def test_the_kernel_command_line() -> None:
    assert kernel_cmdline("amd64", "ds=nocloud", ("no_timer_check",)) == (
        "autoinstall ds=nocloud console=ttyS0,115200 --- console=ttyS0,115200 no_timer_check"
    )
    assert kernel_cmdline("arm64", "ds=nocloud", ()).startswith(
        "autoinstall ds=nocloud console=ttyAMA0,115200"
    )


def test_the_domain_xml(tmp_path: Path) -> None:
    root = _parse(domain_xml(spec(tmp_path)))
    assert root.get("type") == "qemu"
    assert root.findtext("os/kernel") == str(tmp_path / "vmlinuz")
    assert root.findtext("os/cmdline", "").startswith("autoinstall ds=nocloud ")
    assert root.find("os/loader") is not None and root.find("os/nvram") is not None
    assert [root.findtext(t) for t in ("on_poweroff", "on_reboot", "on_crash")] == [
        "destroy",
        "destroy",
        "preserve",
    ]
    disks = root.findall("devices/disk")
    assert [(d.get("device"), d.find("target").get("bus")) for d in disks] == [  # type: ignore[union-attr]
        ("disk", "virtio"), ("cdrom", "sata"), ("disk", "virtio"), ("disk", "virtio"),
    ]  # fmt: skip
    assert disks[0].find("driver").get("discard") == "unmap"  # type: ignore[union-attr]
    assert all(d.find("readonly") is not None for d in disks[1:])
    serials = root.findall("devices/serial")
    assert [s.find("source").get("path") for s in serials] == [  # type: ignore[union-attr]
        str(tmp_path / "console.log"), str(tmp_path / "data.log"),
    ]  # fmt: skip
    assert root.find("devices/interface") is None  # never a libvirt network, bridge or route
    args = [a.get("value") for a in root.findall(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]
    netdev = args[args.index("-netdev") + 1]
    assert netdev == "user,id=ntnet0,restrict=on,guestfwd=tcp:10.0.2.100:8080-chardev:ntev0"
    assert args[args.index("-chardev") + 1] == "socket,id=ntev0,host=127.0.0.1,port=40123,reconnect=1"
    assert "hostfwd" not in " ".join(a or "" for a in args)


def test_no_network_at_all(tmp_path: Path) -> None:
    root = _parse(domain_xml(spec(tmp_path, listener_port=None)))
    assert root.find(f"{{{QEMU_NS}}}commandline") is None
    assert root.find("devices/interface") is None


def test_an_emulated_amd64_guest_gets_the_baseline_cpu(tmp_path: Path) -> None:
    cpu = _parse(domain_xml(spec(tmp_path))).find("cpu")
    assert cpu is not None and (cpu.get("mode"), cpu.get("match")) == ("custom", "exact")
    assert cpu.findtext("model") == "qemu64"


def test_kvm_and_bios(tmp_path: Path) -> None:
    root = _parse(domain_xml(spec(tmp_path, accel="kvm", firmware="bios")))
    assert root.get("type") == "kvm"
    assert root.find("cpu").get("mode") == "host-passthrough"  # type: ignore[union-attr]
    assert root.find("os/loader") is None
    with pytest.raises(VmError, match="UEFI needs"):
        domain_xml(spec(tmp_path, loader=None))


def test_define_start_and_remove_with_the_test_driver(tmp_path: Path) -> None:
    conn = Connection(TEST_URI)
    try:
        with conn.domain(domain_xml(spec(tmp_path))) as dom:
            state = dom.state()
            assert state.running and state.state == "running"
            assert dom.name in conn.domain_names()
            dom.destroy()
            assert dom.state().state == "shutoff" and dom.state().reason == "destroyed"
        assert DOMAIN_PREFIX + "unit-1" not in conn.domain_names()
        assert conn.versions()["libvirt"].count(".") == 2
    finally:
        conn.close()


def test_the_domain_is_removed_when_the_build_fails(tmp_path: Path) -> None:
    conn = Connection(TEST_URI)
    try:
        with (
            pytest.raises(RuntimeError),
            conn.domain(domain_xml(spec(tmp_path, name=DOMAIN_PREFIX + "unit-2"))),
        ):
            raise RuntimeError("the watcher failed")
        assert DOMAIN_PREFIX + "unit-2" not in conn.domain_names()
    finally:
        conn.close()


def test_orphans_of_dead_builders_are_removed(tmp_path: Path) -> None:
    conn = Connection(TEST_URI)
    try:
        dead = {**owner_metadata(), "pid": str(2**22 + 7)}  # beyond pid_max: no such process
        for name, extra in ((DOMAIN_PREFIX + "orphan", dead), (DOMAIN_PREFIX + "alive", owner_metadata())):
            conn.conn.defineXML(domain_xml(spec(tmp_path, name=name, extra=extra))).create()
        assert remove_orphans(conn) == [DOMAIN_PREFIX + "orphan"]
        assert DOMAIN_PREFIX + "alive" in conn.domain_names()
        alive = conn.conn.lookupByName(DOMAIN_PREFIX + "alive")
        alive.destroy()
        alive.undefine()
    finally:
        conn.close()
    assert os.getpid() > 0


def test_an_unreachable_daemon_names_the_fix() -> None:
    with pytest.raises(VmError, match="cannot connect to libvirt") as caught:
        Connection("qemu+unix:///system?socket=/nonexistent/libvirt-sock")
    assert "scripts/services.sh start" in caught.value.hint


def test_arm64_uses_the_virt_machine_and_a_virtio_data_port(tmp_path: Path) -> None:
    root = _parse(domain_xml(spec(tmp_path, arch="arm64", loader=Path("/x/AAVMF_CODE.fd"),
                                  nvram_template=Path("/x/AAVMF_VARS.fd"))))  # fmt: skip
    assert root.find("os/type").get("machine") == "virt"  # type: ignore[union-attr]
    assert root.find("os/type").get("arch") == "aarch64"  # type: ignore[union-attr]
    assert root.find("devices/disk[@device='cdrom']/target").get("bus") == "scsi"  # type: ignore[union-attr]
    console = root.find("devices/console")
    assert console is not None and console.find("target").get("type") == "virtio"  # type: ignore[union-attr]
    assert root.find("devices/panic") is None
