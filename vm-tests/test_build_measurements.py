"""The session's full build (no boot of its own): its boot reference values, and the boot test's corroboration.

The build wrote boot-measurements.json from its own boot chain (the provisioning boot's
``bootloader`` step: a GRUB image with the tpm module and an embedded configuration), covered by
SHA256SUMS and the manifest; its boot test booted the image with OVMF and swtpm, the guest
reported the kernel's TCG event log, and the build compared it with the prediction
(``measured-boot/reference``). Here the prediction is recomputed from the published image with
independent readers (mtools and debugfs through imagecheck, hashlib, osslsigncode's Authenticode).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from conftest import Build
from imagecheck import ImageFiles, scratch

from protocol import eventlog, measurements


def _manifest(build: Build) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((build.folder / "manifest.json").read_text())
    return data


def test_the_build_published_its_boot_reference_values(full_build: Build) -> None:
    folder = full_build.folder
    raw = (folder / "boot-measurements.json").read_bytes()
    ref = measurements.load(raw)  # what nodeserver loads
    assert ref.bank == "sha256" and ref.image == folder.name and sorted(ref.pcrs) == [4, 8, 9]
    manifest = _manifest(full_build)
    assert manifest["boot_measurements"] == {"file": "boot-measurements.json", "pcrs": [4, 8, 9]}
    entry = next(o for o in manifest["outputs"] if o["name"] == "boot-measurements.json")
    assert entry["sha256"] == hashlib.sha256(raw).hexdigest()
    assert entry["media_type"] == "application/vnd.nodetrust.boot-measurements+json"
    assert (
        f"{hashlib.sha256(raw).hexdigest()}  boot-measurements.json" in (folder / "SHA256SUMS").read_text()
    )

    # Recomputed from the published image: the loader on the ESP, the kernel and initrd on the root file system.
    with scratch() as tmp:
        image = ImageFiles(folder / "fixture-node.qcow2", Path(tmp))
        info = json.loads(image.read("/etc/nodetrust/boot.json") or b"{}")
        assert re.fullmatch(r"/boot/vmlinuz-[0-9][^/]*", info["kernel"]) and "root=UUID=" in info["cmdline"]
        kernel, initrd = image.read(info["kernel"]), image.read(info["initrd"])
        assert kernel and initrd
        table = json.loads(
            subprocess.run(["sfdisk", "-J", str(image.raw)], capture_output=True, check=True).stdout
        )
        esp = next(
            p for p in table["partitiontable"]["partitions"] if p["type"].upper().startswith("C12A7328")
        )
        loader = Path(tmp) / "BOOTX64.EFI"
        subprocess.run(["mcopy", "-n", "-i", f"{image.raw}@@{int(esp['start']) * 512}", "::/EFI/BOOT/BOOTX64.EFI",
                        str(loader)], check=True, capture_output=True)  # fmt: skip
        ossl = subprocess.run(["osslsigncode", "verify", "-in", str(loader)], capture_output=True, text=True,
                              check=False).stdout  # fmt: skip
    pcr4 = ref.pcrs[4].events
    assert [e.type for e in pcr4] == [eventlog.EV_EFI_BOOT_SERVICES_APPLICATION]
    calculated = re.search(r"Calculated message digest\s*:\s*([0-9A-F]{64})", ossl)
    if (
        calculated
    ):  # osslsigncode prints it only for signed files; the unsigned GRUB image: compare with pesign
        assert pcr4[0].digest is not None and pcr4[0].digest.hex() == calculated.group(1).lower()
    else:
        out = subprocess.run(["pesign", "-i", str(loader), "-h", "-d", "sha256"], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        assert pcr4[0].digest is not None and pcr4[0].digest.hex() in out
    assert [e.digest for e in ref.pcrs[9].events] == [
        hashlib.sha256(kernel).digest(),
        hashlib.sha256(initrd).digest(),
    ]
    [cmdline] = ref.pcrs[8].events
    assert cmdline.text == f"kernel_cmdline: (hd0,gpt2){info['kernel']} {info['cmdline']}"


def test_the_boot_test_compared_the_booted_images_event_log_with_them(full_build: Build) -> None:
    report = json.loads((full_build.folder / "boot-test.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["measured-boot/event-log"]["ok"], checks["measured-boot/event-log"]
    reference = checks["measured-boot/reference"]
    assert reference["ok"] and "PCRs 4, 8, 9" in reference["detail"], reference
