"""The bare-metal path in a VM, as far as the disk boot: Debian's iPXE ROM on OVMF (its own NVRAM) ->
the release's entry.ipxe (dhcp, chain --autofree) -> boot.ipxe -> the imager's real boot environment
(built by imagebuilder.bootenv from pinned Debian packages) -> nodeimager verifies the release with the
pinned key, picks the disk of two by serial, writes it, reads it back, repairs the backup GPT, seeds the
node pool's cloud-init, creates the UEFI boot entry with efibootmgr in OVMF's NVRAM, and reboots; the
machine then boots again from that NVRAM and the firmware takes the new entry into the written disk.

Every step is asserted from its own evidence: the events the imager POSTed to the release's URL, the HTTP
server's request log, the target disk's contents (qemu-img compare against the signed image, sgdisk -v,
the CIDATA seed read back by mtools), the other disk left blank, the boot entry in the NVRAM file. About
2 minutes under TCG, plus the boot environment's build the first time (cached by its inputs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for_other_vms

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from imagebuilder.sign import generate_keypair  # noqa: E402
from imager.gpt import read_gpt  # noqa: E402
from tests.imager.conftest import QCOW2, _make_image, sign_build  # noqa: E402
from tests.imager.server import ReleaseServer, tls_certificate  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1800)]
OVMF_CODE, OVMF_VARS = Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
ROM = Path("/usr/lib/ipxe/qemu/efi-virtio.rom")
GUEST_HOST = "10.0.2.100"
TARGET, OTHER = "TARGET0001", "OTHER0002"


@pytest.fixture(scope="session")
def bootenv() -> Path:
    """The imager's boot environment, locked once and built once per set of inputs (kept in .cache)."""
    from tests.support.bootenv import imager_bootenv

    return imager_bootenv()


@pytest.fixture
def release(
    bootenv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, dict[str, object]]]:
    work = Path(os.environ.get("TMPDIR", "/var/tmp")) / f"imager-chain-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    image = _make_image(work, loader=bootenv / "vmlinuz")  # a kernel's EFI stub: a loader OVMF really runs
    build_dir = work / "build"
    build_dir.mkdir()
    shutil.copyfile(image.qcow2, build_dir / QCOW2)
    (build_dir / "console.log").write_text("[    0.000000] Linux version 6.1.0\n")
    private_pem, public_pem = generate_keypair("ecdsa-p256")
    (work / "release.key").write_bytes(private_pem)
    (work / "release.key").chmod(0o600)
    (work / "release.pub").write_bytes(public_pem)
    sign_build(build_dir, work / "release.key", raw=False)
    made = subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", "release", str(build_dir), "--build-key", str(work / "release.pub"),
         "--key", str(work / "release.key"), "--out", str(work / "srv"), "--base-url", f"http://{GUEST_HOST}/",
         "--imager", str(bootenv), "--pool", "h200", "--server", "10.0.2.2:8081", "--trust-domain", "nodetrust.test",
         "--bundle", str(tls_certificate(work)[0]), "--hint", f"serial={TARGET}",
         "--events-url", f"http://{GUEST_HOST}/events", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    info["raw"] = str(image.raw)
    yield work, info
    shutil.rmtree(work, ignore_errors=True)


def _disk_boot(work: Path, timeout: float = 300) -> str:
    """Boot the same machine again, its NVRAM as the imager left it and no boot order from QEMU, so the
    firmware follows BootOrder: the entry the imager created, on the disk it wrote."""
    console = work / "console-2.log"
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "1024", "-display", "none",
            "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,file={work / 'vars.fd'}",
            "-drive", f"if=none,id=d0,format=raw,file={work / 'target.img'}",
            "-device", f"virtio-blk-pci,drive=d0,serial={TARGET}",
            "-drive", f"if=none,id=d1,format=raw,file={work / 'other.img'}",
            "-device", f"virtio-blk-pci,drive=d1,serial={OTHER}",
            "-net", "none", "-serial", f"file:{console}", "-no-reboot"]  # fmt: skip
    wait_for_other_vms()  # one VM at a time on the shared machine (vm-tests/conftest.py)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            text = console.read_text(errors="replace") if console.exists() else ""
            if "BdsDxe: loading " in text:
                time.sleep(20)  # long enough for a failure to load or start it to show
                break
            time.sleep(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return console.read_text(errors="replace").replace("\r", "")


def _boot(work: Path, srv: ReleaseServer, name: str, timeout: float = 900) -> tuple[str, float]:
    for tool in ("qemu-system-x86_64", "busybox"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install qemu-system-x86 busybox-static")
    if not (OVMF_CODE.is_file() and ROM.is_file()):
        pytest.fail("apt-get install ovmf ipxe-qemu")
    shutil.copyfile(OVMF_VARS, work / "vars.fd")  # this VM's own NVRAM
    for disk, size in (("target.img", 256 << 20), ("other.img", 512 << 20)):
        with (work / disk).open("wb") as fh:
            fh.truncate(size)
    console = work / "console.log"
    port = srv.url.rsplit(":", 1)[1]
    netdev = (f"user,id=n0,restrict=on,bootfile=http://{GUEST_HOST}/{name}/entry.ipxe,"
              f"guestfwd=tcp:{GUEST_HOST}:80-cmd:busybox nc 127.0.0.1 {port}")  # fmt: skip
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "1536", "-smp", "2", "-display", "none",
            "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,file={work / 'vars.fd'}",
            "-drive", f"if=none,id=d0,format=raw,file={work / 'target.img'}",
            "-device", f"virtio-blk-pci,drive=d0,serial={TARGET},bootindex=2",
            "-drive", f"if=none,id=d1,format=raw,file={work / 'other.img'}", "-device", f"virtio-blk-pci,drive=d1,serial={OTHER}",
            "-netdev", netdev, "-device", f"virtio-net-pci,netdev=n0,bootindex=1,romfile={ROM}",
            "-serial", f"file:{console}", "-no-reboot"]  # fmt: skip
    started = time.monotonic()
    wait_for_other_vms()  # one VM at a time on the shared machine (vm-tests/conftest.py)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        proc.wait(timeout=timeout)  # the imager reboots when it is done; -no-reboot ends QEMU there
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(
            f"the VM did not finish within {timeout:.0f} s:\n{console.read_text(errors='replace')[-4000:]}"
        )
    return console.read_text(errors="replace").replace("\r", ""), time.monotonic() - started


def test_ipxe_boots_the_imager_which_writes_the_hinted_disk_and_sets_the_boot_entry(
    release: tuple[Path, dict[str, object]],
) -> None:
    work, info = release
    folder = Path(str(info["folder"]))
    manifest = json.loads((folder / "release.json").read_text())
    with ReleaseServer(work / "srv") as srv:
        text, seconds = _boot(work, srv, str(info["name"]))
        events = list(srv.recorder.events)
        paths = [p for m, p, _ in srv.recorder.requests if m == "GET"]
    print(f"\nimager chain VM: {seconds:.0f} s")
    name = f"/{info['name']}"
    # the boot path, in order, from the server's log
    assert paths[:4] == [
        f"{name}/entry.ipxe",
        f"{name}/boot.ipxe",
        f"{name}/imager.vmlinuz",
        f"{name}/imager.initrd",
    ]
    assert (
        paths.index(f"{name}/signature.dsse.json")
        < paths.index(f"{name}/release.json")
        < paths.index(f"{name}/{QCOW2}")
    )
    assert "nodetrust: this iPXE has no sha256sum" in text and "nodeimager-boot: network up on" in text
    # the imager's own account, POSTed to the release's events URL
    assert [e["event"] for e in events] == ["verified", "disk-chosen", "written", "boot-entry", "done"], (
        text[-3000:]
    )
    assert events[0]["signer"] == str(info["key"]).removeprefix("sha256:")
    assert events[1]["disk"]["serial"] == TARGET and "virtio-TARGET0001" in events[1]["disk"]["by_id"]
    assert events[2]["sha256"] == manifest["images"][0]["sha256"]
    # the target disk: the signed image, byte for byte, a sound GPT with the backup at the end, the seed
    target, other = work / "target.img", work / "other.img"
    vsize = 64 << 20
    body = f"offset={1 << 20},size={vsize - (2 << 20)}"  # the partitions (the GPT areas are rewritten by relocation)
    signed, written = (
        f"driver=raw,{body},file.filename={info['raw']}",
        f"driver=raw,{body},file.filename={target}",
    )
    compared = subprocess.run(["qemu-img", "compare", "--image-opts", signed, written], capture_output=True, text=True,
                              check=False)  # fmt: skip
    assert compared.returncode == 0, compared.stdout + compared.stderr
    sgdisk = subprocess.run(["sgdisk", "-v", str(target)], capture_output=True, text=True, check=False)
    assert sgdisk.returncode == 0 and "No problems found" in sgdisk.stdout, sgdisk.stdout
    table = read_gpt(target)
    assert not table.problems and len(table.entries) == 3
    esp, seed = table.esp(), table.entries[-1]
    assert esp is not None
    user_data = subprocess.run(["mtype", "-i", f"{target}@@{seed.offset}", "::user-data"], capture_output=True,
                               check=True).stdout  # fmt: skip
    assert user_data == (folder / "worker.user-data").read_bytes()
    # the other disk: never touched
    with other.open("rb") as fh:
        head = fh.read(1 << 20)
        fh.seek(-(1 << 20), os.SEEK_END)
        tail = fh.read()
    assert not any(head) and not any(tail), "the other disk was written"
    # the boot entry, in this VM's own NVRAM: its description and the ESP's partition GUID
    nvram = (work / "vars.fd").read_bytes()
    assert f"nodetrust {info['name']}".encode("utf-16-le") in nvram
    assert esp.part_guid.bytes_le in nvram
    assert events[3]["partition"] == str(esp.part_guid) and events[3]["order"][0] == events[3]["number"][4:]
    # the reboot: the firmware follows the new BootOrder into the loader on the written disk (a kernel's EFI
    # stub here, which starts and, given no root, stops)
    second = _disk_boot(work)
    number = events[3]["number"]
    loading = f'BdsDxe: loading {number} "nodetrust {info["name"]}" from HD({esp.number},GPT,{str(esp.part_guid).upper()},'
    assert loading in second, second[-3000:]
    after = second.split(loading, 1)[1]
    assert "failed to load" not in after and "Not Found" not in after, after[-2000:]
    assert (
        f'BdsDxe: starting {number} "nodetrust {info["name"]}"' in after
    )  # loaded and verified as a PE image
    print(f"\nsecond boot, after the firmware took the entry:\n{after[:600]}")
