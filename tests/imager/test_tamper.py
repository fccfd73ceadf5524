"""The tamper matrix (issue 13, section 5), the rows a VM adds nothing to: each tampered link is refused
with its own reason, and nothing bootable is left behind.

Refusals about the release come before any disk is chosen: every disk is left exactly as it was
(here: blank). Refusals after the disk is chosen (the image's bytes, its QCOW2 header) find the
target holding an old, bootable install with a boot entry: after the refusal it has no partition
table at either end and no boot entry points at it. docs/bare-metal.md has the table.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from imager.errors import ImagerError, Reason
from imager.gpt import read_gpt
from imager.params import Params
from tests.imager.conftest import (
    QCOW2,
    RAW,
    TARGET_SERIAL,
    Keys,
    Machine,
    NodeImage,
    has_partition_table,
    sh,
)
from tests.imager.server import Fault, ReleaseServer
from tests.imager.sysfs import FakeDisk, FakePart

pytestmark = pytest.mark.subprocess

DISKS = ("nvme0n1", "nvme1n1", "sda")


def _params(server: ReleaseServer, folder: Path, **kw: object) -> Params:
    base: dict[str, object] = {"release": f"{server.url}/{folder.name}/", "hints": {"serial": TARGET_SERIAL},
                               "reboot": "no"}  # fmt: skip
    base.update(kw)
    return Params(**base)  # type: ignore[arg-type]


def _old_install(m: Machine, node_image: NodeImage) -> int:
    """Put a bootable install on the target with its boot entry, as a re-imaged server has."""
    target = m.node("nvme0n1")
    with node_image.raw.open("rb") as src, target.open("r+b") as dst:
        shutil.copyfileobj(src, dst)
    esp = read_gpt(target).esp()
    assert esp is not None
    return m.firmware.add("debian (old install)", esp.part_guid, "\\EFI\\BOOT\\BOOTX64.EFI")


def _nothing_bootable(m: Machine, error: ImagerError, reason: Reason) -> None:
    assert error.reason == reason, f"{error.reason}: {error.message}"
    for name in DISKS:
        assert not has_partition_table(m.node(name)), f"{name} still has a partition table"
    assert all(entry.part_guid is None for entry in m.firmware.entries()), m.firmware.entries()
    failed = [e for e in m.events.sent if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["reason"] == str(reason)
    assert "written" not in [e["event"] for e in m.events.sent]


# -- the image's bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
def test_an_image_byte_flipped_is_refused_and_the_disk_wiped(
    fmt: str, build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine],
    node_image: NodeImage, baked: Path,
) -> None:  # fmt: skip
    folder = build_folder()
    name = RAW if fmt == "raw" else QCOW2
    server.faults[f"/{folder.name}/{name}"] = Fault(flip=(folder / name).stat().st_size // 2)
    m = machine()
    _old_install(m, node_image)
    error = m.refused(_params(server, folder, format=fmt), keys_dir=baked)
    _nothing_bootable(m, error, Reason.digest_mismatch)
    assert error.exit_code == 4


@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
def test_a_truncated_image_is_refused(
    fmt: str, build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine],
    node_image: NodeImage, baked: Path,
) -> None:  # fmt: skip
    folder = build_folder()
    name = RAW if fmt == "raw" else QCOW2
    server.faults[f"/{folder.name}/{name}"] = Fault(truncate=(folder / name).stat().st_size - 4096)
    m = machine()
    _old_install(m, node_image)
    _nothing_bootable(m, m.refused(_params(server, folder, format=fmt), keys_dir=baked), Reason.truncated)


@pytest.mark.parametrize(
    "fault", [Fault(extra=4096, no_length=True), Fault(length=10**12)], ids=["sends-more", "announces-more"]
)
def test_a_body_larger_than_the_signed_size_is_refused(
    fault: Fault, build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine],
    baked: Path,
) -> None:  # fmt: skip
    folder = build_folder()
    server.faults[f"/{folder.name}/{RAW}"] = fault
    m = machine()
    _nothing_bootable(
        m, m.refused(_params(server, folder, format="raw"), keys_dir=baked), Reason.body_too_large
    )


# -- the signature and the manifest ------------------------------------------------------------------


def test_a_release_signed_by_another_key_is_refused(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    folder = build_folder(key="other")
    m = machine()
    error = m.refused(_params(server, folder), keys_dir=baked)
    _nothing_bootable(m, error, Reason.signature_untrusted)
    assert [r[1] for r in server.recorder.requests] == [
        f"/{folder.name}/signature.dsse.json"
    ]  # nothing else read


def test_a_pinned_key_that_the_release_key_does_not_match_is_refused(
    build_folder: Callable[..., Path],
    server: ReleaseServer,
    machine: Callable[..., Machine],
    keys: dict[str, Keys],
) -> None:
    folder = build_folder(key="other")
    shutil.copyfile(keys["other"].pub, folder / "signing-key.pub")  # the attacker publishes their key too
    m = machine()
    error = m.refused(_params(server, folder, key=keys["release"].fingerprint), keys_dir=None)
    _nothing_bootable(m, error, Reason.key_pin_mismatch)


def test_an_edited_manifest_digest_is_refused(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    """The attacker swaps the image and rewrites manifest.json and SHA256SUMS, but cannot re-sign."""
    folder = build_folder()
    image = folder / RAW
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    image.write_bytes(bytes(data))
    manifest = json.loads((folder / "manifest.json").read_text())
    for output in manifest["outputs"]:
        if output["name"] == RAW:
            output["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    m = machine()
    error = m.refused(_params(server, folder, format="raw"), keys_dir=baked)
    _nothing_bootable(m, error, Reason.digest_mismatch)
    assert error.message.startswith("manifest.json: sha256 mismatch")


def test_a_boot_parameter_pointing_at_another_image_is_refused(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    folder = build_folder()
    m = machine()
    error = m.refused(_params(server, folder, image="sha256:" + "ab" * 32), keys_dir=baked)
    _nothing_bootable(m, error, Reason.image_pin_mismatch)


# -- the QCOW2 header (signed by the trusted key: the check stands even if the key is stolen) ------------


@pytest.mark.parametrize(
    ("create", "reason"),
    [
        (["-u", "-F", "raw", "-b", "/etc/shadow"], Reason.qcow2_backing_file),
        (["-o", "data_file={tmp}/leak.raw,data_file_raw=on"], Reason.qcow2_data_file),
    ],
    ids=["backing-file", "external-data-file"],
)
def test_a_signed_qcow2_that_reads_another_file_is_refused_before_qemu_img_opens_it(
    create: list[str], reason: Reason, tmp_path: Path, build_folder: Callable[..., Path],
    server: ReleaseServer, machine: Callable[..., Machine], node_image: NodeImage, baked: Path,
) -> None:  # fmt: skip
    evil = tmp_path / "evil.qcow2"
    args = [a.format(tmp=tmp_path) for a in create]
    sh("qemu-img", "create", "-q", "-f", "qcow2", *args, str(evil), "64M")
    folder = build_folder(raw=False, qcow2=evil)
    m = machine()
    _old_install(m, node_image)
    _nothing_bootable(m, m.refused(_params(server, folder), keys_dir=baked), reason)


# -- the source ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["file:///srv/release/", "/dev/sdb", "ftp://127.0.0.1/release/"])
def test_a_file_device_or_other_scheme_source_is_refused_before_any_read(
    url: str, machine: Callable[..., Machine], baked: Path
) -> None:
    m = machine()
    error = m.refused(Params(release=url, hints={"serial": TARGET_SERIAL}, reboot="no"), keys_dir=baked)
    _nothing_bootable(m, error, Reason.scheme_refused)


@pytest.mark.parametrize("location", ["file:///etc/shadow", "ftp://127.0.0.1/x"])
def test_a_redirect_to_another_scheme_is_refused(
    location: str, build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine],
    baked: Path,
) -> None:  # fmt: skip
    folder = build_folder()
    server.faults[f"/{folder.name}/signature.dsse.json"] = Fault(redirect=location)
    m = machine()
    _nothing_bootable(m, m.refused(_params(server, folder), keys_dir=baked), Reason.redirect_refused)


# -- the disk --------------------------------------------------------------------------------------------


def test_no_hint_is_refused_listing_every_candidate(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    folder = build_folder()
    m = machine()
    error = m.refused(_params(server, folder, hints={}), keys_dir=baked)
    _nothing_bootable(m, error, Reason.no_hint)
    assert error.exit_code == 6
    candidates = {c["name"]: c for c in error.details["candidates"]}
    assert candidates["nvme0n1"]["serial"] == TARGET_SERIAL and not candidates["nvme0n1"]["excluded"]
    assert [x["reason"] for x in candidates["sda"]["excluded"]] == ["removable"]
    assert TARGET_SERIAL in error.message and "S-OTHER-02" in error.message


def test_an_ambiguous_hint_is_refused(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    folder = build_folder()
    m = machine()
    error = m.refused(_params(server, folder, hints={"model": "fixture_nvme*"}), keys_dir=baked)
    _nothing_bootable(m, error, Reason.ambiguous)
    assert "2 disks match" in error.message


def test_a_target_with_a_mounted_file_system_is_refused(
    build_folder: Callable[..., Path], server: ReleaseServer, machine: Callable[..., Machine], baked: Path
) -> None:
    folder = build_folder()
    m = machine([
        FakeDisk("nvme0n1", 128 << 20, serial=TARGET_SERIAL, partitions=[FakePart(1, "ext4", mounted_on="/mnt/data")]),
        FakeDisk("nvme1n1", 256 << 20, serial="S-OTHER-02"),
    ])  # fmt: skip
    error = m.refused(_params(server, folder), keys_dir=baked)
    _nothing_bootable(m, error, Reason.no_match)
    (target,) = [c for c in error.details["candidates"] if c["name"] == "nvme0n1"]
    assert [x["reason"] for x in target["excluded"]] == ["mounted"]


def test_disk_state_is_checked_by_an_independent_tool(tmp_path: Path) -> None:
    """has_partition_table() is blkid's verdict: it sees a GPT when there is one, and none after a wipe."""
    from imager import blockdev

    disk = tmp_path / "d.img"
    with disk.open("wb") as fh:
        fh.truncate(8 << 20)
    subprocess.run(["sfdisk", "-q", str(disk)], input=b"label: gpt\ntype=linux\n", check=True)
    assert has_partition_table(disk)
    blockdev.wipe(disk)
    assert not has_partition_table(disk)
