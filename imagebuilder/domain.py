"""The build VM as libvirt domain XML.

One builder for the three kinds of VM a build runs:

* the **installer**: direct kernel boot of the installer's kernel and initrd with
  ``autoinstall`` on the command line, UEFI through OVMF (AAVMF on arm64) with a per-build
  NVRAM copy, the installer ISO as a CD-ROM, the NoCloud seed and the base medium as
  read-only virtio disks, and a small writable raw disk (serial ``nodetrust-export``) that
  receives the installed system's kernel and initrd;
* the **provisioning boot**: direct kernel boot of the installed base's own kernel and
  initrd (no firmware at all, ``firmware="none"``), its disk a QCOW2 overlay on the cached
  base (``backing``), the staging medium read-only, no network;
* the **boot test** (and ``make demo``): the image itself through UEFI and its own boot
  loader (no kernel given), an overlay on the image, the NoCloud seed read-only, an
  emulated TPM 2.0 (an swtpm process of ours, ``tpm_socket``, as libvirt's ``external``
  backend), and optionally the listener's stream (``make demo``).

Always: the target disk on virtio (``discard=unmap`` so trimmed blocks leave the QCOW2); a
backing file is declared with ``relabel='no'`` so libvirt never changes the owner of a
cached base or a published image (QEMU reads it through its 0644 mode); the serial console
in a file kept with the build and a second serial port (the data port) in another file;
``on_poweroff``/``on_reboot`` destroy, ``on_crash`` preserve (the builder reads the crash
and says so).

Networking, when asked for, is QEMU user-mode networking with ``restrict=on`` (no route
anywhere) plus, with ``listener_port``, one ``guestfwd``: the guest's ``10.0.2.100:8080`` is a
character device connected to a loopback port of the host (the builder's event listener, or the
demo's relay). libvirt has no element for that, so it goes through the ``qemu:commandline``
namespace. (Per-connection ``guestfwd=...-cmd:`` relays are not used: libvirt's seccomp sandbox
kills QEMU when it spawns the command.)
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from imagebuilder.errors import VmError

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
NT_NS = "https://nodetrust.dev/imagebuilder"
GUEST_FORWARD = "10.0.2.100:8080"

# (code, vars template) candidates per architecture, most specific first
FIRMWARE = {
    "amd64": (
        ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"),
        ("/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"),
        ("/usr/share/edk2/ovmf/OVMF_CODE.fd", "/usr/share/edk2/ovmf/OVMF_VARS.fd"),
        ("/usr/share/edk2/x64/OVMF_CODE.fd", "/usr/share/edk2/x64/OVMF_VARS.fd"),
    ),
    "arm64": (
        ("/usr/share/AAVMF/AAVMF_CODE.fd", "/usr/share/AAVMF/AAVMF_VARS.fd"),
        ("/usr/share/edk2/aarch64/QEMU_EFI-pflash.raw", "/usr/share/edk2/aarch64/vars-template-pflash.raw"),
    ),
}
FIRMWARE_PACKAGE = {"amd64": "ovmf", "arm64": "qemu-efi-aarch64"}
QEMU_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}
#: The CPU an emulated (TCG) guest gets. qemu64 is the x86-64 baseline Ubuntu 24.04 is built for; TCG ran the
#: fixture installer's boot to its prompt 15 to 20 % faster with it than with "maximum" (every feature TCG
#: emulates: AVX2, SHA, ...), measured in pairs on the 2-core test machine. Under KVM the host's CPU is passed.
TCG_CPU_MODEL = {"amd64": "qemu64"}
MACHINE = {"amd64": "q35", "arm64": "virt"}
CONSOLE = {"amd64": "ttyS0", "arm64": "ttyAMA0"}
# The data port as the guest sees it: a second 16550 on x86, a virtio console on arm64 (one PL011 only).
DATA_PORT = {"amd64": "/dev/ttyS1", "arm64": "/dev/hvc0"}


def find_firmware(arch: str) -> tuple[Path, Path]:
    for code, template in FIRMWARE[arch]:
        if Path(code).is_file() and Path(template).is_file():
            return Path(code), Path(template)
    raise VmError(
        f"no UEFI firmware for {arch} found (looked for {', '.join(c for c, _ in FIRMWARE[arch])})",
        hint=f"apt-get install {FIRMWARE_PACKAGE[arch]}, or set firmware: bios in the definition",
    )


@dataclass(frozen=True)
class DomainSpec:
    name: str
    build_id: str
    arch: str
    accel: str  # kvm | tcg
    memory_mib: int
    cpus: int
    kernel: Path | None  # None: boot from the disk (firmware and the image's boot loader)
    initrd: Path | None
    cmdline: str
    disk: Path
    cdrom: Path | None
    readonly_disks: tuple[Path, ...]
    console_log: Path
    data_log: Path
    firmware: str = "uefi"  # uefi | bios | none (direct kernel boot without firmware)
    loader: Path | None = None
    nvram_template: Path | None = None
    nvram: Path | None = None
    listener_port: int | None = None  # the installer's event listener (guestfwd to a socket)
    mac: str = "52:54:00:6e:74:01"
    extra: dict[str, str] = field(default_factory=dict)
    backing: Path | None = None  # the disk is a QCOW2 overlay on this file (never relabelled)
    writable_disks: tuple[tuple[Path, str], ...] = ()  # (raw file, serial)
    tpm_socket: Path | None = None  # swtpm's control socket: an emulated TPM 2.0
    network: bool = False  # a NIC even without a listener (DHCP, no route anywhere)

    @property
    def has_network(self) -> bool:
        return self.listener_port is not None or self.network


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrs)
    if text is not None:
        element.text = text
    return element


def _norelabel(source: ET.Element) -> None:
    """Read-only media stay owned by the builder; QEMU reads them through their 0644 mode."""
    _sub(source, "seclabel", model="dac", relabel="no")


def domain_xml(spec: DomainSpec) -> str:
    ET.register_namespace("qemu", QEMU_NS)
    ET.register_namespace("nt", NT_NS)
    root = ET.Element("domain", {"type": "kvm" if spec.accel == "kvm" else "qemu"})
    _sub(root, "name", spec.name)
    meta = _sub(root, "metadata")
    build = _sub(meta, f"{{{NT_NS}}}build", id=spec.build_id)
    for key, value in sorted(spec.extra.items()):
        _sub(build, f"{{{NT_NS}}}{key}", value)
    _sub(root, "memory", str(spec.memory_mib), unit="MiB")
    _sub(root, "vcpu", str(spec.cpus))

    os_el = _sub(root, "os")
    _sub(os_el, "type", "hvm", arch=QEMU_ARCH[spec.arch], machine=MACHINE[spec.arch])
    if spec.firmware == "uefi":
        if spec.loader is None or spec.nvram is None or spec.nvram_template is None:
            raise VmError("UEFI needs a loader, an NVRAM template and an NVRAM path")
        _sub(os_el, "loader", str(spec.loader), readonly="yes", type="pflash")
        _sub(os_el, "nvram", str(spec.nvram), template=str(spec.nvram_template))
    if spec.kernel is not None:
        if spec.initrd is None:
            raise VmError("a direct kernel boot needs an initrd")
        _sub(os_el, "kernel", str(spec.kernel))
        _sub(os_el, "initrd", str(spec.initrd))
        _sub(os_el, "cmdline", spec.cmdline)
    elif spec.firmware == "none":
        raise VmError("without firmware the VM needs a kernel to boot")
    else:
        _sub(os_el, "boot", dev="hd")

    features = _sub(root, "features")
    _sub(features, "acpi")
    if spec.arch == "amd64":
        _sub(features, "apic")
    else:
        _sub(features, "gic", version="3")
    if spec.accel == "kvm":
        _sub(root, "cpu", mode="host-passthrough")
    elif spec.arch in TCG_CPU_MODEL:
        # emulated: the baseline model, not "maximum" (docs/building-images.md, Accelerators)
        cpu = _sub(root, "cpu", mode="custom", match="exact", check="none")
        _sub(cpu, "model", TCG_CPU_MODEL[spec.arch], fallback="forbid")
    else:
        _sub(root, "cpu", mode="maximum", check="none")
    _sub(root, "clock", offset="utc")
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "destroy")
    _sub(root, "on_crash", "preserve")

    devices = _sub(root, "devices")
    disk = _sub(devices, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type="qcow2", cache="unsafe", discard="unmap")
    _sub(disk, "source", file=str(spec.disk))
    if spec.backing is not None:
        backing = _sub(disk, "backingStore", type="file")
        _sub(backing, "format", type="qcow2")
        _norelabel(_sub(backing, "source", file=str(spec.backing)))
        _sub(backing, "backingStore")
    _sub(disk, "target", dev="vda", bus="virtio")
    _sub(disk, "serial", "nodetrust-target")

    if spec.cdrom is not None:
        cdrom = _sub(devices, "disk", type="file", device="cdrom")
        _sub(cdrom, "driver", name="qemu", type="raw")
        _norelabel(_sub(cdrom, "source", file=str(spec.cdrom)))
        _sub(cdrom, "target", dev="sda", bus="sata" if spec.arch == "amd64" else "scsi")
        _sub(cdrom, "readonly")
        if spec.arch == "arm64":
            _sub(devices, "controller", type="scsi", model="virtio-scsi")

    letters = iter("bcdefghijklmnop")
    for path in spec.readonly_disks:
        extra = _sub(devices, "disk", type="file", device="disk")
        _sub(extra, "driver", name="qemu", type="raw")
        _norelabel(_sub(extra, "source", file=str(path)))
        _sub(extra, "target", dev=f"vd{next(letters)}", bus="virtio")
        _sub(extra, "readonly")
    for path, disk_serial in spec.writable_disks:
        writable = _sub(devices, "disk", type="file", device="disk")
        _sub(writable, "driver", name="qemu", type="raw", cache="unsafe")
        _sub(writable, "source", file=str(path))
        _sub(writable, "target", dev=f"vd{next(letters)}", bus="virtio")
        _sub(writable, "serial", disk_serial)

    serial = _sub(devices, "serial", type="file")
    _sub(serial, "source", path=str(spec.console_log))
    _sub(serial, "target", port="0")
    if spec.arch == "amd64":
        data = _sub(devices, "serial", type="file")
        _sub(data, "source", path=str(spec.data_log))
        _sub(data, "target", port="1")
    else:
        data = _sub(devices, "console", type="file")
        _sub(data, "source", path=str(spec.data_log))
        _sub(data, "target", type="virtio", port="1")
    if spec.tpm_socket is not None:
        tpm = _sub(devices, "tpm", model="tpm-crb" if spec.arch == "amd64" else "tpm-tis")
        backend = _sub(tpm, "backend", type="external")
        _sub(backend, "source", type="unix", mode="connect", path=str(spec.tpm_socket))
    if spec.arch == "amd64":
        _sub(devices, "panic", model="isa")
    _sub(devices, "memballoon", model="none")
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")

    if spec.has_network:
        cmd = _sub(root, f"{{{QEMU_NS}}}commandline")
        netdev = "user,id=ntnet0,restrict=on"
        args: list[str] = []
        if spec.listener_port is not None:
            host, port = GUEST_FORWARD.split(":")
            args += ["-chardev", f"socket,id=ntev0,host=127.0.0.1,port={spec.listener_port},reconnect=1"]
            netdev += f",guestfwd=tcp:{host}:{port}-chardev:ntev0"
        for arg in (
            *args,
            "-netdev",
            netdev,
            "-device",
            # an explicit slot: QEMU creates command-line devices before libvirt's JSON ones, and libvirt
            # fills pcie.0 from slot 1 up with root ports; slot 0x0f stays free for any domain this small
            f"virtio-net-pci,netdev=ntnet0,mac={spec.mac},bus=pcie.0,addr=0x0f"
            if spec.arch == "amd64"
            else f"virtio-net-pci,netdev=ntnet0,mac={spec.mac}",
        ):
            _sub(cmd, f"{{{QEMU_NS}}}arg", value=arg)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"


def kernel_cmdline(arch: str, seed_args: str, extra: tuple[str, ...], *, accel: str = "kvm") -> str:
    """``autoinstall ds=nocloud...`` plus the console; ``---`` then what curtin carries into the target.

    Under TCG a loaded host can make the installer's kernel panic in its timer check
    ("IO-APIC + timer doesn't work"), so TCG adds ``no_timer_check`` *before* ``---``: the
    installer gets it, the installed system does not.
    """
    console = f"console={CONSOLE[arch]},115200"
    installer_only = ["no_timer_check"] if accel == "tcg" and arch == "amd64" else []
    carried = [a for a in extra if not a.startswith("console=")]
    return " ".join(["autoinstall", seed_args, console, *installer_only, "---", console, *carried]).strip()


def provision_cmdline(arch: str, root: str, init: str, *, accel: str = "kvm") -> str:
    """The provisioning boot's kernel command line: the base's root file system, read-write, with the
    provisioning hook as PID 1 and the data port named for it; ``no_timer_check`` under TCG (this
    command line never reaches the image)."""
    parts = [
        f"console={CONSOLE[arch]},115200",
        "quiet",  # the kernel's boot messages cost seconds on an emulated serial port; panics still show
        f"root={root}",
        "rw",
        f"init={init}",
        "fsck.mode=skip",
        f"nodetrust.data={DATA_PORT[arch]}",
    ]
    if accel == "tcg" and arch == "amd64":
        parts.append("no_timer_check")
    return " ".join(parts)
