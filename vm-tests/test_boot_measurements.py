"""The builder's boot reference values against a real measured boot: OVMF, the image's GRUB and kernel, swtpm.

One boot (about 80 s under TCG) carries all of these assertions:

* corroboration: the image's boot chain (:class:`imagebuilder.bootmeasure.GrubBoot`: a GRUB image
  made with the image's own ``grub-mkimage`` and modules, the ``tpm`` module and a project-owned
  configuration embedded; the image's Debian kernel; an initrd) is booted by OVMF with an swtpm
  TPM, and the TCG event log the kernel exposes in securityfs holds exactly the PCR 4, 8 and 9
  events :func:`imagebuilder.bootmeasure.reference` predicted from the files;
* admitted: a nodeserver pool listing that boot-measurements.json admits the node. The node is
  the same swtpm: the agent's own code attested it beforehand (its AK kept, recorded by the
  server) and asked BeginJoin for a nonce; in the booted guest TPM2_Load of the kept AK and
  TPM2_Quote over the nonce go to /dev/tpm0 as the bytes ESAPI sends (the guest has no Python);
  the agent's join client sends the quote and the guest's log;
* refused: the same boot's quote and log to a pool whose release differs from it in one link is
  refused, ``boot_not_accepted``, naming the PCR and the event that differ: another kernel command
  line (PCR 8, the ``kernel_cmdline`` event), another initrd (PCR 9, the initrd's digest) and another
  GRUB configuration (PCR 4: the configuration is embedded in BOOTX64.EFI, so the loader's Authenticode
  digest differs). The quotes are over one boot, so each pool sees the very log the node measured: a
  pool's release and the booted chain differ in exactly that link, whichever of the two was modified.

The files come from the fixture installer ISO's target root file system (casper/minimal.squashfs),
the packages the image is built from.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from conftest import wait_for_other_vms  # noqa: E402

from agent.attest_client import ServerTarget, attest  # noqa: E402
from agent.errors import RefusalError  # noqa: E402
from agent.join_client import begin_join_async, request_join_async  # noqa: E402
from agent.svid import SvidStore  # noqa: E402
from imagebuilder import bootmeasure  # noqa: E402
from protocol.quote import selection_bitmap  # noqa: E402
from tests.support.joinenv import CPU_POOL, cpu_report, start_join_env  # noqa: E402
from tests.support.measuredboot import pool_measured_boot  # noqa: E402
from tests.support.swtpm import LocalCa, Swtpm, manufacture  # noqa: E402

pytestmark = pytest.mark.vm
OVMF_CODE, OVMF_VARS = Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
ROOT_UUID = "6e0c1c5a-3b7d-4c1e-9a55-2f7d0b1e8c42"
CMDLINE = f"root=UUID={ROOT_UUID} ro console=ttyS0,115200"
BOOT_S = 600
FW_CFG = "opt/nodetrust"

INIT = """#!/bin/busybox sh
B=/bin/busybox
$B mkdir -p /proc /sys /dev /tmp
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
$B mount -t securityfs securityfs /sys/kernel/security
$B insmod /qemu_fw_cfg.ko
say() { echo "$@" > /dev/ttyS0; }
say NT-LOG-BEGIN
$B xxd -p /sys/kernel/security/tpm0/binary_bios_measurements > /dev/ttyS0
say NT-LOG-END
F=/sys/firmware/qemu_fw_cfg/by_name/opt/nodetrust
QUOTES=$($B cat $F/quotes/raw)
exec 3<>/dev/tpm0
tpm() {  # $1: a name; /tmp/cmd: the command. The response goes to the serial port and /tmp/$1.rsp.
  $B cat /tmp/cmd >&3
  $B dd bs=4096 count=1 <&3 2>/dev/null > /tmp/$1.rsp
  say NT-$1-BEGIN
  $B xxd -p /tmp/$1.rsp > /dev/ttyS0
  say NT-$1-END
}
$B cat $F/load/raw > /tmp/cmd
tpm load
# The quotes name the loaded AK by the handle TPM2_Load returned (bytes 10..13 of its response).
H=$($B xxd -p -s 10 -l 4 /tmp/load.rsp)
for c in $QUOTES; do
  Q=$($B xxd -p -c 4096 $F/$c/raw)
  echo "${Q:0:20}${H}${Q:28}" | $B xxd -r -p > /tmp/cmd
  tpm $c
done
$B poweroff -f
"""


def _run(*argv: object, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, timeout=300, **kwargs)  # type: ignore[call-overload, no-any-return]


@dataclass(frozen=True)
class Chain:
    grub_dir: Path
    mkimage: Path
    kernel: Path
    fw_cfg_module: Path


def _image_files(iso: Path, out: Path) -> Chain:
    """GRUB's modules and grub-mkimage, the kernel and the fw_cfg module of the image's target root file system."""
    _run("osirrox", "-indev", iso, "-extract", "/casper/minimal.squashfs", out / "minimal.squashfs")
    root = out / "root"
    # only what the chain needs (unsquashfs matches each path component as a wildcard): GRUB's modules and
    # grub-mkimage, the kernels, and the one kernel module the guest loads, not every module of the kernel
    fw_cfg = "*/kernel/drivers/firmware/qemu_fw_cfg.ko*"
    _run("unsquashfs", "-q", "-d", root, out / "minimal.squashfs", "usr/lib/grub/x86_64-efi", "usr/bin/grub-mkimage",
         "boot/vmlinuz-*", f"usr/lib/modules/{fw_cfg}", f"lib/modules/{fw_cfg}")  # fmt: skip
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    assert kernels, "the target root file system has no /boot/vmlinuz-*"
    version = kernels[-1].name.removeprefix("vmlinuz-")
    modules = next(p for p in (root / "usr/lib/modules", root / "lib/modules") if (p / version).is_dir())
    return Chain(root / "usr/lib/grub/x86_64-efi", root / "usr/bin/grub-mkimage", kernels[-1],
                 modules / version / "kernel/drivers/firmware/qemu_fw_cfg.ko")  # fmt: skip


def _initrd(chain: Chain, out: Path) -> Path:
    tree = out / "initrd-tree"
    (tree / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox") or "/bin/busybox", tree / "bin/busybox")
    shutil.copy(chain.fw_cfg_module, tree / "qemu_fw_cfg.ko")
    (tree / "init").write_text(INIT)
    (tree / "init").chmod(0o755)
    image = out / "initrd.img"
    files = subprocess.run(["find", "."], cwd=tree, capture_output=True, check=True).stdout
    image.write_bytes(subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, input=files,
                                     capture_output=True, check=True).stdout)  # fmt: skip
    return image


def _loader(chain: Chain, boot: bootmeasure.GrubBoot, config: str, out: Path) -> Path:
    """BOOTX64.EFI: the image's own GRUB, made by its grub-mkimage with ``config`` embedded."""
    out.mkdir(exist_ok=True)
    (out / "embedded.cfg").write_text(config)
    loader = out / "BOOTX64.EFI"
    argv = boot.mkimage_argv(str(chain.grub_dir), str(out / "embedded.cfg"), str(loader))
    _run(chain.mkimage, *argv[1:])
    return loader


def _disk(chain: Chain, boot: bootmeasure.GrubBoot, initrd: Path, out: Path) -> tuple[Path, Path]:
    """A GPT disk: the ESP with BOOTX64.EFI (our GRUB image), an ext4 root with the kernel and the initrd."""
    loader = _loader(chain, boot, boot.embedded_config(), out / "loader")
    rootfs = out / "rootfs"
    (rootfs / "boot").mkdir(parents=True)
    shutil.copy(chain.kernel, rootfs / boot.kernel.lstrip("/"))
    shutil.copy(initrd, rootfs / boot.initrd.lstrip("/"))
    _run("truncate", "-s", "96M", out / "root.ext4")
    _run("mkfs.ext4", "-q", "-F", "-U", ROOT_UUID, "-d", rootfs, out / "root.ext4")
    _run("truncate", "-s", "34M", out / "esp.vfat")
    _run("mkfs.vfat", "-F", "32", "-n", "UEFI", out / "esp.vfat")
    _run("mmd", "-i", out / "esp.vfat", "::/EFI", "::/EFI/BOOT")
    _run("mcopy", "-i", out / "esp.vfat", loader, "::/" + bootmeasure.LOADER_PATH)
    disk = out / "disk.raw"
    _run("truncate", "-s", "140M", disk)
    subprocess.run(["sfdisk", "-q", str(disk)], input="label: gpt\nsize=34MiB, type=U\nsize=96MiB, type=L\n",
                   text=True, check=True, capture_output=True)  # fmt: skip
    table = json.loads(_run("sfdisk", "-J", disk).stdout)["partitiontable"]["partitions"]
    for part, img in zip(table, ("esp.vfat", "root.ext4"), strict=True):
        _run(
            "dd",
            f"if={out / img}",
            f"of={disk}",
            "bs=512",
            f"seek={part['start']}",
            "conv=notrunc",
            "status=none",
        )
    return disk, loader


# -- TPM commands as ESAPI marshals them (TPM 2.0 Part 3: TPM2_Load 0x157, TPM2_Quote 0x158) -------------
_PASSWORD = struct.pack(">IHBH", 0x40000009, 0, 0, 0)  # TPM_RS_PW, empty nonce, no attributes, empty auth


def _command(cc: int, handles: list[int], params: bytes) -> bytes:
    body = (
        b"".join(struct.pack(">I", h) for h in handles)
        + struct.pack(">I", len(_PASSWORD))
        + _PASSWORD
        + params
    )
    return struct.pack(">HII", 0x8002, 10 + len(body), cc) + body


def _quote_command(handle: int, nonce: bytes, pcrs: tuple[int, ...]) -> bytes:
    params = (
        struct.pack(">H", len(nonce)) + nonce + struct.pack(">H", 0x0010)
    )  # qualifyingData, TPM_ALG_NULL
    params += struct.pack(">IHB", 1, 0x000B, 3) + selection_bitmap(list(pcrs))
    return _command(0x158, [handle], params)


def _response(raw: bytes, what: str) -> bytes:
    _tag, size, rc = struct.unpack(">HII", raw[:10])
    assert rc == 0, f"{what}: TPM response code 0x{rc:08x}"
    assert size == len(raw), f"{what}: response of {len(raw)} bytes, header says {size}"
    return raw[10:]


def _quote_response(raw: bytes) -> tuple[bytes, bytes]:
    body = _response(raw, "TPM2_Quote")
    (param_size,) = struct.unpack(">I", body[:4])
    params = body[4 : 4 + param_size]
    (n,) = struct.unpack(">H", params[:2])
    return params[2 : 2 + n], params[2 + n :]


def _section(serial: str, name: str) -> bytes:
    match = re.search(rf"NT-{name}-BEGIN\s*\n(.*?)NT-{name}-END", serial, re.S)
    assert match, f"the guest did not report {name}; serial tail:\n{serial[-3000:]}"
    return bytes.fromhex("".join(match.group(1).split()))


def test_the_predicted_boot_is_measured_quoted_and_admitted(tmp_path: Path) -> None:
    for tool in (
        "qemu-system-x86_64",
        "swtpm",
        "osirrox",
        "unsquashfs",
        "mkfs.ext4",
        "mkfs.vfat",
        "mcopy",
        "busybox",
    ):
        assert shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"), f"{tool} is missing"
    from fixtures.installer.build import build_installer_iso

    work = tmp_path
    chain = _image_files(build_installer_iso().iso, work)
    boot = bootmeasure.GrubBoot(ROOT_UUID, "/boot/vmlinuz", "/boot/initrd.img", CMDLINE)
    initrd = _initrd(chain, work)
    disk, loader = _disk(chain, boot, initrd, work)
    files = {
        "loader": loader.read_bytes(),
        "kernel": chain.kernel.read_bytes(),
        "initrd": initrd.read_bytes(),
    }
    ref = bootmeasure.reference("rig-1", boot, **files)
    # Releases that differ from the booted chain in one link each: the command line, the initrd, GRUB's configuration.
    other = bootmeasure.reference(
        "rig-2", bootmeasure.GrubBoot(ROOT_UUID, boot.kernel, boot.initrd, CMDLINE + " quiet"), **files
    )
    other_initrd = bootmeasure.reference("rig-3", boot, **{**files, "initrd": files["initrd"] + b"\0" * 512})
    grub_config = boot.embedded_config().replace("boot\n", "set debug=all\nboot\n")
    assert grub_config != boot.embedded_config()
    other_loader = _loader(chain, boot, grub_config, work / "loader-other").read_bytes()
    other_grub = bootmeasure.reference("rig-4", boot, **{**files, "loader": other_loader})
    releases: dict[str, tuple[str, Path, str]] = {}
    for name, r in (("rig-1", ref), ("rig-2", other), ("rig-3", other_initrd), ("rig-4", other_grub)):
        (work / name).mkdir()
        path = bootmeasure.write(work / name, r)
        releases[name] = (name, path, hashlib.sha256(path.read_bytes()).hexdigest())
    pools = {
        pool: {
            "profile": CPU_POOL,
            "measured_boot": {**pool_measured_boot(releases[rel]), "nonce_ttl": "10m"},
        }
        for pool, rel in (("mb", "rig-1"), ("other", "rig-2"), ("initrd", "rig-3"), ("grub", "rig-4"))
    }
    env = start_join_env(work / "server", pools=pools)
    try:
        ca = LocalCa(work / "ekca")
        manufacture(work / "warm", ca)
        ca.install_into(env.base / "ek-ca")
        env.srv.app.ek_trust.reload()  # type: ignore[union-attr]
        manufacture(work / "tpm", ca)
        # The agent attests with its own code (the server records the AK, the agent keeps it) and asks for nonces.
        state = work / "state"
        with Swtpm(work / "tpm") as tpm:
            attest(
                ServerTarget.parse(env.srv.address, "example.org", env.srv.bundle),
                tcti=tpm.tcti,
                state_dir=state,
            )
        svids = SvidStore(state)
        ak = svids.load_ak()
        assert ak is not None
        mtls = {"trust_domain": "example.org", "bundle_pem": env.srv.bundle, "svid_cert": svids.cert_path,
                "svid_key": svids.key_path}  # fmt: skip
        asked = {p: asyncio.run(begin_join_async(env.join_address, pool=p, **mtls)) for p in pools}  # type: ignore[arg-type]
        cmds: dict[str, bytes] = {}
        cmds["load"] = _command(0x157, [0x81000001], ak.private + ak.public)
        for pool, request in asked.items():
            assert request is not None
            cmds[f"quote-{pool}"] = _quote_command(
                0x80FFFFFF, request.nonce, request.pcrs
            )  # the guest sets the handle
        (work / "quotes").write_text(" ".join(f"quote-{pool}" for pool in asked))
        fw_cfg = ["-fw_cfg", f"name={FW_CFG}/quotes,file={work / 'quotes'}"]
        for name, raw in cmds.items():
            (work / f"{name}.bin").write_bytes(raw)
            fw_cfg += ["-fw_cfg", f"name={FW_CFG}/{name},file={work / f'{name}.bin'}"]

        wait_for_other_vms()
        sock = work / "swtpm.sock"
        swtpm = subprocess.Popen(["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={work / 'tpm'}",
                                  "--ctrl", f"type=unixio,path={sock}"], stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            shutil.copy(OVMF_VARS, work / "vars.fd")
            started = time.monotonic()
            qemu = subprocess.run(
                ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "512", "-display", "none",
                 "-no-reboot", "-net", "none",
                 "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
                 "-drive", f"if=pflash,format=raw,file={work / 'vars.fd'}",
                 "-drive", f"file={disk},format=raw,if=none,id=d0", "-device", "virtio-blk-pci,drive=d0,bootindex=1",
                 "-chardev", f"socket,id=chrtpm,path={sock}", "-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
                 "-device", "tpm-crb,tpmdev=tpm0", "-serial", f"file:{work / 'serial.log'}", *fw_cfg],
                capture_output=True, text=True, timeout=BOOT_S, check=False,
            )  # fmt: skip
            print(f"boot: {time.monotonic() - started:.0f} s")  # the VM tier's budget
        finally:
            swtpm.terminate()
            swtpm.wait(10)
        serial = (work / "serial.log").read_text(errors="replace")
        assert qemu.returncode == 0, qemu.stderr[-2000:] + serial[-2000:]

        log = _section(serial, "LOG")
        assert bootmeasure.corroborate(ref, log) == [], "the booted image measured what the build predicted"
        for differs in (other, other_initrd, other_grub):
            assert bootmeasure.corroborate(differs, log) != []
        _response(
            _section(serial, "load"), "TPM2_Load"
        )  # the kept AK loaded under the SRK in the booted TPM

        from agent.tpm.quote import QuoteEvidence

        def join(pool: str) -> object:
            request = asked[pool]
            assert request is not None
            quote, signature = _quote_response(_section(serial, f"quote-{pool}"))
            evidence = QuoteEvidence(nonce=request.nonce, quote=quote, signature=signature, event_log=log)
            return asyncio.run(request_join_async(env.join_address, pool=pool, node_name="rig-node", report=cpu_report(),
                                                  evidence=evidence, **mtls))  # type: ignore[arg-type]  # fmt: skip

        grant = join("mb")
        assert getattr(grant, "token", "")
        line = env.srv.audit_lines()[-1]
        assert line["result"] == "ok" and line["release"] == "rig-1" and line["checked_pcrs"] == [4, 8, 9]
        refusals = {}
        for pool in ("other", "initrd", "grub"):
            with pytest.raises(RefusalError) as refused:
                join(pool)
            refusals[pool] = refused.value
        assert {p: r.reason for p, r in refusals.items()} == dict.fromkeys(refusals, "boot_not_accepted")
        # each refusal names the PCR and the event of the link that differs, and only that PCR
        expected = {
            "other": ("PCR 8:", "kernel_cmdline: "),
            "initrd": ("PCR 9:", boot.initrd),
            "grub": ("PCR 4:", bootmeasure.LOADER_PATH),
        }
        for pool, (pcr, event) in expected.items():
            message = refusals[pool].message
            assert pcr in message and event in message, f"{pool}: {message}"
            assert [p for p in ("PCR 4:", "PCR 8:", "PCR 9:") if p in message] == [pcr], f"{pool}: {message}"
        joins = [e for e in env.srv.audit_lines() if e["event"] == "join"]
        assert [e["reason"] for e in joins[-3:]] == ["boot_not_accepted"] * 3, joins[-3:]  # one line each
    finally:
        env.srv.stop()
