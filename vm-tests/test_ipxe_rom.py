"""The release's iPXE scripts under the real iPXE ROM QEMU loads (Debian's ipxe-qemu, efi-virtio.rom), on
OVMF, over user-mode networking restricted to a loopback HTTP server. One boot, about a minute under TCG.

The DHCP boot file is a probe that asks the ROM for its integrity commands, then chains the rendered
entry script (``dhcp``, ``chain --autofree``), which chains the rendered ``boot.ipxe``; that fetches a
real Debian kernel and a tiny initramfs whose ``/init`` prints ``/proc/cmdline`` on the serial console
and powers off. Evidence: the console (what the ROM has and lacks, the script's own messages, the
command line as the kernel saw it, split with the kernel's rules) and the HTTP server's request log.
The server fails the first fetch of the initramfs: the script says what to check, pauses and retries.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for_other_vms

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from imagebuilder.release.ipxe import BootScript, render_boot, render_entry  # noqa: E402
from protocol.cmdline import kernel_params  # noqa: E402
from tests.imager.server import Fault, ReleaseServer  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
OVMF_CODE, OVMF_VARS = Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
ROM = Path("/usr/lib/ipxe/qemu/efi-virtio.rom")
GUEST_HOST = "10.0.2.100"
PROBE = """#!ipxe
echo PROBE platform=${platform} buildarch=${buildarch}
sha256sum || echo PROBE sha256sum failed
imgverify || echo PROBE imgverify failed
imgtrust || echo PROBE imgtrust failed
chain --autofree http://10.0.2.100/r/entry.ipxe
"""
INIT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc
/bin/busybox mount -t proc proc /proc
echo "IMAGER-CMDLINE:$(/bin/busybox cat /proc/cmdline)" > /dev/console
/bin/busybox poweroff -f
"""


def _kernel(work: Path) -> Path:
    from fixtures.installer.build import build_installer_iso

    iso = build_installer_iso().iso
    subprocess.run(["xorriso", "-osirrox", "on", "-indev", str(iso), "-extract", "/casper/vmlinuz", str(work / "vmlinuz")],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    return work / "vmlinuz"


def _initrd(work: Path) -> Path:
    tree = work / "initrd-tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "dev").mkdir()
    shutil.copyfile("/bin/busybox", tree / "bin" / "busybox")
    (tree / "bin" / "busybox").chmod(0o755)
    (tree / "init").write_text(INIT)
    (tree / "init").chmod(0o755)
    names = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    out = work / "initrd.img"
    with out.open("wb") as fh:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, input="\n".join(names).encode(),
                       stdout=fh, check=True, timeout=120)  # fmt: skip
    return out


PARAMS = (
    ("console", "ttyS0,115200"),
    ("nodeimager.release", f"http://{GUEST_HOST}/r/"),
    ("nodeimager.key", "sha256:" + "a" * 64),
    ("nodeimager.serial", "S-TARGET-01"),
    ("nodeagent.server", "10.0.2.2:8081"),
    ("nodeagent.node_name", "gpu-rack3-u12"),
)


def _boot(work: Path, srv: ReleaseServer, *, until: str, timeout: float = 420) -> str:
    for tool in ("qemu-system-x86_64", "busybox"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install qemu-system-x86 busybox-static")
    if not (OVMF_CODE.is_file() and ROM.is_file()):
        pytest.fail("apt-get install ovmf ipxe-qemu")
    vars_copy = work / "vars.fd"
    shutil.copyfile(OVMF_VARS, vars_copy)
    console = work / "console.log"
    console.unlink(missing_ok=True)
    port = srv.url.rsplit(":", 1)[1]
    netdev = (f"user,id=n0,restrict=on,bootfile=http://{GUEST_HOST}/probe.ipxe,"
              f"guestfwd=tcp:{GUEST_HOST}:80-cmd:busybox nc 127.0.0.1 {port}")  # fmt: skip
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "512", "-display", "none",
            "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}", "-drive", f"if=pflash,format=raw,file={vars_copy}",
            "-netdev", netdev, "-device", f"virtio-net-pci,netdev=n0,bootindex=1,romfile={ROM}",
            "-serial", f"file:{console}", "-no-reboot"]  # fmt: skip
    wait_for_other_vms()  # one VM at a time on the shared machine (vm-tests/conftest.py)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            seen = console.read_text(errors="replace") if console.exists() else ""
            if until in seen:
                time.sleep(2)
                break
            if "Kernel panic" in seen:
                pytest.fail(f"the kernel panicked:\n{seen[-3000:]}")
            time.sleep(1)
        else:
            if proc.poll() is None:
                pytest.fail(
                    f"no {until!r} within {timeout:.0f} s:\n{console.read_text(errors='replace')[-4000:]}"
                )
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    return console.read_text(errors="replace").replace("\r", "")


@pytest.fixture
def release(tmp_path: Path) -> Iterator[Path]:
    work = Path(os.environ.get("TMPDIR", "/var/tmp")) / f"ipxe-rom-{os.getpid()}-{tmp_path.name}"
    work.mkdir(parents=True)
    folder = work / "srv" / "r"
    folder.mkdir(parents=True)
    kernel, initrd = _kernel(work), _initrd(work)
    shutil.copyfile(kernel, folder / "imager.vmlinuz")
    shutil.copyfile(initrd, folder / "imager.initrd")
    script = BootScript(
        release="k8s-1.36.3-amd64-fixture", base_url=f"http://{GUEST_HOST}/r/", kernel="imager.vmlinuz",
        initrd="imager.initrd", kernel_sha256=hashlib.sha256(kernel.read_bytes()).hexdigest(),
        initrd_sha256=hashlib.sha256(initrd.read_bytes()).hexdigest(), params=PARAMS, retries=2, pause_s=1,
    )  # fmt: skip
    (folder / "boot.ipxe").write_text(render_boot(script))
    (folder / "entry.ipxe").write_text(render_entry(f"http://{GUEST_HOST}/r/", retries=2, pause_s=1))
    (work / "srv" / "probe.ipxe").write_text(PROBE)
    yield work
    shutil.rmtree(work, ignore_errors=True)


def test_debians_ipxe_rom_runs_the_release_scripts_into_the_imager_kernel(release: Path) -> None:
    with ReleaseServer(release / "srv") as srv:
        srv.faults["/r/imager.initrd"] = Fault(status=503, times=1)  # the first attempt fails: one retry
        text = _boot(release, srv, until="IMAGER-CMDLINE:")
        paths = [path for method, path, _ in srv.recorder.requests if method == "GET"]
    # what Debian's 2019 build has: no digest and no signature commands (docs/bare-metal.md says so)
    assert "PROBE platform=efi buildarch=x86_64" in text
    for command in ("sha256sum", "imgverify", "imgtrust"):
        assert f"{command}: command not found" in text and f"PROBE {command} failed" in text
    # the chain: probe -> entry (chain --autofree) -> boot.ipxe -> kernel + initrd
    first = ["/r/imager.vmlinuz", "/r/imager.initrd"]
    assert paths == ["/probe.ipxe", "/r/entry.ipxe", "/r/boot.ipxe", *first, *first]
    # the failed attempt: a console message naming what to check, a pause, the retry (imgfree: test_ipxe.py)
    assert "attempt 1 of 2" in text and "attempt 2 of 2" in text
    assert (
        text.count("nodetrust: cannot fetch the imager from http://10.0.2.100/r/: check the release server")
        == 1
    )
    assert "nodetrust: release k8s-1.36.3-amd64-fixture from http://10.0.2.100/r/" in text
    assert "nodetrust: this iPXE has no sha256sum" in text
    # the kernel got exactly the parameters, split with the kernel's rules, the platform expanded
    (line,) = [x for x in text.splitlines() if x.startswith("IMAGER-CMDLINE:")]
    parsed = [
        (p.decode(), (v or b"").decode())
        for p, v in kernel_params(line.removeprefix("IMAGER-CMDLINE:").encode())
    ]
    # iPXE's EFI loader puts the image's name first; initrd= is for the kernel's EFI stub
    assert parsed[:2] == [("nt_kernel", ""), ("initrd", "nt_initrd")]
    assert parsed[2:] == [*PARAMS, ("nodeimager.firmware", "uefi")]
