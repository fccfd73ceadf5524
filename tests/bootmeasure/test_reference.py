"""imagebuilder.bootmeasure: the reference values of the builder's boot chain, and their corroboration.

The log a booted image would hand the OS is synthesised here with protocol.eventlog.encode from
what GRUB 2.06 and OVMF measure for this chain (vm-tests/test_boot_measurements.py checks the
same against a real boot); the reference must accept it and name the PCR and event of any change.
"""

from __future__ import annotations

import hashlib

import pytest

from imagebuilder import bootmeasure
from imagebuilder.errors import OutputError
from imagebuilder.pehash import authenticode
from protocol import eventlog, measurements
from tests.fixture_installer.conftest import BootFiles

UUID = "6e0c1c5a-3b7d-4c1e-9a55-2f7d0b1e8c42"
BOOT = bootmeasure.GrubBoot(
    UUID, "/boot/vmlinuz", "/boot/initrd.img", f"root=UUID={UUID} ro console=ttyS0,115200"
)
CALLING = b"Calling EFI Application from Boot Option"
SEP = b"\x00" * 4


def _ev(pcr: int, etype: int, data: bytes, digest: bytes) -> tuple[int, int, dict[str, bytes], bytes]:
    return (pcr, etype, {"sha256": digest}, data)


def _log(
    loader: bytes,
    kernel: bytes,
    initrd: bytes,
    *,
    cmdline: str = BOOT.cmdline,
    extra: bool = False,
    disk: str = "hd0",
) -> bytes:
    """What OVMF and GRUB log for BOOT (firmware events of PCRs 0-7 included)."""
    sha = hashlib.sha256
    text = f"({disk},gpt2){BOOT.kernel} {cmdline}"
    events = [
        _ev(0, eventlog.EV_S_CRTM_VERSION, b"OVMF\x00", sha(b"OVMF\x00").digest()),
        _ev(4, eventlog.EV_EFI_ACTION, CALLING, sha(CALLING).digest()),
        *[_ev(p, eventlog.EV_SEPARATOR, SEP, sha(SEP).digest()) for p in range(8)],
        _ev(4, eventlog.EV_EFI_BOOT_SERVICES_APPLICATION, b"\x00" * 40, authenticode(loader)),
        _ev(9, eventlog.EV_IPL, f"({disk},gpt2)/boot/vmlinuz\x00".encode(), sha(kernel).digest()),
        _ev(8, eventlog.EV_IPL, f"kernel_cmdline: {text}\x00".encode(), sha(text.encode()).digest()),
        _ev(9, eventlog.EV_IPL, b"(hd0,gpt2)/boot/initrd.img\x00", sha(initrd).digest()),
    ]
    if extra:
        events.append(_ev(8, eventlog.EV_IPL, b"grub_cmd: insmod evil\x00", sha(b"insmod evil").digest()))
    return eventlog.encode(["sha256"], events)


@pytest.fixture
def files(boot_files: BootFiles) -> dict[str, bytes]:
    return {
        "loader": boot_files.kernel.read_bytes(),
        "kernel": boot_files.kernel.read_bytes(),
        "initrd": b"initrd",
    }


def test_the_reference_loads_as_the_server_loads_it_and_admits_the_predicted_log(
    files: dict[str, bytes],
) -> None:
    ref = bootmeasure.reference("node-1", BOOT, **files)
    loaded = measurements.load(bootmeasure.render(ref))
    assert loaded == ref
    assert sorted(loaded.pcrs) == [4, 8, 9]
    assert bootmeasure.corroborate(ref, _log(files["loader"], files["kernel"], files["initrd"])) == []
    # GRUB names the disk by firmware enumeration: another (hdN,gptM) is the same boot.
    other_disk = _log(files["loader"], files["kernel"], files["initrd"], disk="hd3")
    assert bootmeasure.corroborate(ref, other_disk) == []


@pytest.mark.parametrize(
    ("change", "pcr"),
    [
        ({"kernel": b"another kernel"}, 9),
        ({"initrd": b"another initrd"}, 9),
        ({"loader": b"MZ"}, 4),  # another boot loader (or embedded configuration): not even a PE image here
        ({"cmdline": BOOT.cmdline + " init=/bin/sh"}, 8),
        ({"extra": True}, 8),
    ],
    ids=["kernel", "initrd", "loader", "command-line", "extra-command"],
)
def test_any_change_is_named_by_its_pcr(
    files: dict[str, bytes], change: dict[str, object], pcr: int
) -> None:
    ref = bootmeasure.reference("node-1", BOOT, **files)
    booted: dict[str, bytes] = {**files, **{k: v for k, v in change.items() if isinstance(v, bytes)}}
    if booted["loader"] == b"MZ":
        patched = bytearray(files["kernel"])
        patched[len(patched) // 2] ^= 0xFF  # the same PE layout, one byte of a section changed
        booted["loader"] = bytes(patched)
    log = _log(booted["loader"], booted["kernel"], booted["initrd"],
               cmdline=str(change.get("cmdline", BOOT.cmdline)), extra=bool(change.get("extra")))  # fmt: skip
    problems = bootmeasure.corroborate(ref, log)
    assert problems and all(p.startswith(f"PCR {pcr}:") for p in problems), problems


def test_a_log_that_is_not_one_or_lacks_the_bank(files: dict[str, bytes]) -> None:
    ref = bootmeasure.reference("node-1", BOOT, **files)
    assert "cannot be read" in bootmeasure.corroborate(ref, b"garbage")[0]
    sha1 = eventlog.encode(["sha1"], [(4, eventlog.EV_SEPARATOR, {"sha1": hashlib.sha1(SEP).digest()}, SEP)])  # noqa: S324
    assert "no sha256 bank" in bootmeasure.corroborate(ref, sha1)[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"root_uuid": "not-a-uuid"},
        {"kernel": "boot/vmlinuz"},
        {"kernel": "/boot/../etc/shadow"},
        {"initrd": "/boot/initrd img"},
        {"cmdline": "root=/dev/sda1 $evil"},
        {"cmdline": 'root=/dev/sda1 "quoted"'},
        {"cmdline": "root=/dev/sda1; reboot"},
        {"cmdline": "a\nb"},
    ],
)
def test_what_grub_would_expand_or_quote_is_refused(kwargs: dict[str, str]) -> None:
    values = {
        "root_uuid": UUID,
        "kernel": "/boot/vmlinuz",
        "initrd": "/boot/initrd.img",
        "cmdline": "ro",
        **kwargs,
    }
    with pytest.raises(OutputError) as refused:
        bootmeasure.GrubBoot(**values)
    assert refused.value.hint


def test_the_embedded_configuration_is_literal() -> None:
    cfg = BOOT.embedded_config()
    assert cfg.splitlines() == [
        f"search --no-floppy --fs-uuid --set=root {UUID}",
        f"linuxefi ($root)/boot/vmlinuz {BOOT.cmdline}",
        "initrdefi ($root)/boot/initrd.img",
        "boot",
    ]
    argv = BOOT.mkimage_argv("/usr/lib/grub/x86_64-efi", "/tmp/c.cfg", "/tmp/BOOTX64.EFI")
    assert argv[argv.index("-O") + 1] == "x86_64-efi" and "tpm" in argv and "linuxefi" in argv
