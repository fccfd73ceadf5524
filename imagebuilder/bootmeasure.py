"""Boot reference values from the build: what an image's boot chain extends into PCRs 4, 8 and 9.

The builder knows every byte the image boots, so it predicts the events the TPM's event log of a
booted node must hold for the PCRs that do not depend on the machine's firmware, and publishes
them as ``boot-measurements.json`` (:mod:`protocol.measurements`' schema), covered by SHA256SUMS,
the manifest and the signature. A pool that lists the file admits only nodes whose quoted,
replayed log matches it (docs/attestation.md, "Measured boot").

The boot chain the builder makes predictable (:class:`GrubBoot`): the firmware starts the ESP's
removable path ``EFI/BOOT/BOOTX64.EFI``, a GRUB image the build makes with ``grub-mkimage`` from
the image's own GRUB modules, with the ``tpm`` module and a project-owned configuration *embedded*
in it (no grub.cfg, grubenv or module file is read from disk, no menu, no state that changes
between boots). Under OVMF with an swtpm TPM, GRUB 2.06 (Debian 12) measures that chain as
(observed, vm-tests/test_boot_measurements.py):

========  =============================================================================
PCR 4     the firmware's ``EV_EFI_ACTION`` "Calling EFI Application from Boot Option" and
          ``EV_SEPARATOR`` (allowed, self-checking), then ``EV_EFI_BOOT_SERVICES_APPLICATION``:
          the Authenticode SHA-256 of BOOTX64.EFI (:mod:`imagebuilder.pehash`), which covers
          GRUB, its modules and the embedded configuration
PCR 8     ``EV_IPL`` ``kernel_cmdline: (hdN,gptM)<kernel> <command line>``: the embedded
          configuration runs in GRUB's rescue parser, which measures no ``grub_cmd:`` events;
          ``linuxefi`` measures the command line it hands the kernel (without ``BOOT_IMAGE=``)
PCR 9     ``EV_IPL`` SHA-256 of the kernel file, then of the initrd file, as GRUB read them
========  =============================================================================

``linuxefi`` (not ``linux``) boots the kernel through its EFI stub (the EFI handover protocol),
which is what hands the firmware's TCG event log to the kernel (securityfs
``binary_bios_measurements``); GRUB's plain ``linux`` loader skips the stub and the booted
system has no event log at all. The kernel itself is not loaded with LoadImage, so PCR 4 has no
entry for it. Secure Boot (PCR 7) is not part of this chain: the fixture image has no shim.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.errors import OutputError
from imagebuilder.pehash import authenticode
from protocol import eventlog, measurements

FILE_NAME = "boot-measurements.json"
#: What the provisioning boot's ``bootloader`` step (cloud-init/stage.sh) wrote into the image: what GRUB boots.
BOOT_INFO = "/etc/nodetrust/boot.json"
MEDIA_TYPE = "application/vnd.nodetrust.boot-measurements+json"
LOADER_PATH = "EFI/BOOT/BOOTX64.EFI"
#: The modules embedded in the GRUB image: the TPM verifier first, then what the configuration needs.
GRUB_MODULES = ("tpm", "part_gpt", "fat", "ext2", "search", "search_fs_uuid", "linuxefi")
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PATH_RE = re.compile(r"/[A-Za-z0-9._/+-]{1,255}")
# What the kernel command line may hold: no quotes, no GRUB expansion ($), no ;, no newline.
_CMDLINE_RE = re.compile(r"[A-Za-z0-9._,:=/+@-]+(?: [A-Za-z0-9._,:=/+@-]+)*")
#: The device GRUB names the root file system by in its measurements (the wildcard matches any).
DEVICE = "(hd0,gpt2)"


@dataclass(frozen=True)
class GrubBoot:
    """The project-owned GRUB boot of an image: root file system, kernel, initrd, command line."""

    root_uuid: str
    kernel: str  # path on the root file system, e.g. /boot/vmlinuz-6.1.0-50-amd64
    initrd: str
    cmdline: str  # the kernel command line (GRUB measures it without BOOT_IMAGE=)

    def __post_init__(self) -> None:
        problems = []
        if not _UUID_RE.fullmatch(self.root_uuid):
            problems.append(f"root file system UUID {self.root_uuid!r} is not a UUID")
        for what, path in (("kernel", self.kernel), ("initrd", self.initrd)):
            if not _PATH_RE.fullmatch(path) or "/../" in path + "/":
                problems.append(f"{what} path {path!r} is not an absolute plain path")
        if not _CMDLINE_RE.fullmatch(self.cmdline) or len(self.cmdline) > 1024:
            problems.append(
                f"kernel command line {self.cmdline[:80]!r} has characters GRUB would expand or quote"
            )
        if problems:
            raise OutputError(
                "the boot chain cannot be made predictable: " + "; ".join(problems),
                hint="use plain paths and a command line of letters, digits and ._,:=/+@- separated by spaces",
            )

    def embedded_config(self) -> str:
        """The configuration embedded in BOOTX64.EFI (``grub-mkimage -c``): literal, no branch, no state."""
        return (
            f"search --no-floppy --fs-uuid --set=root {self.root_uuid}\n"
            f"linuxefi ($root){self.kernel} {self.cmdline}\n"
            f"initrdefi ($root){self.initrd}\n"
            "boot\n"
        )

    def mkimage_argv(self, grub_dir: str, config: str, out: str) -> list[str]:
        """``grub-mkimage`` for the image's own GRUB (``grub_dir``: its x86_64-efi module folder)."""
        return ["grub-mkimage", "-d", grub_dir, "-O", "x86_64-efi", "-p", "/EFI/BOOT", "-c", config,
                "-o", out, *GRUB_MODULES]  # fmt: skip

    def kernel_cmdline_event(self) -> str:
        return f"kernel_cmdline: {DEVICE}{self.kernel} {self.cmdline}"


def reference(
    image: str, boot: GrubBoot, *, loader: bytes, kernel: bytes, initrd: bytes
) -> measurements.BootReference:
    """The reference values of ``boot``, from the bytes of the loader, kernel and initrd the image holds."""
    sha = hashlib.sha256
    pcr4 = measurements.PcrReference(
        (measurements.ExpectedEvent(eventlog.EV_EFI_BOOT_SERVICES_APPLICATION, authenticode(loader), None, LOADER_PATH),),
        frozenset({eventlog.EV_EFI_ACTION, eventlog.EV_SEPARATOR}),
    )  # fmt: skip
    pcr8 = measurements.PcrReference(
        (
            measurements.ExpectedEvent(
                eventlog.EV_IPL, None, boot.kernel_cmdline_event(), "the kernel command line"
            ),
        )
    )
    pcr9 = measurements.PcrReference(
        (
            measurements.ExpectedEvent(eventlog.EV_IPL, sha(kernel).digest(), None, boot.kernel),
            measurements.ExpectedEvent(eventlog.EV_IPL, sha(initrd).digest(), None, boot.initrd),
        )
    )
    return measurements.BootReference(bank="sha256", image=image, pcrs={4: pcr4, 8: pcr8, 9: pcr9})


def render(ref: measurements.BootReference) -> bytes:
    """The file's bytes (sorted keys, a trailing newline), checked by the reader the server uses."""
    raw = json.dumps(ref.to_json(), indent=1, sort_keys=True).encode() + b"\n"
    measurements.load(raw)  # what the server will load must load
    return raw


def write(folder: Path, ref: measurements.BootReference) -> Path:
    path = folder / FILE_NAME
    path.write_bytes(render(ref))
    path.chmod(0o644)
    return path


def measure_image(qcow2: Path, work: Path, *, image: str) -> measurements.BootReference:
    """The reference values of a built image, from its own files: ``BOOT_INFO``, the ESP's loader, kernel, initrd."""
    from imagebuilder.imagefiles import ImageFiles

    with ImageFiles(qcow2, work) as files:
        try:
            info = json.loads(files.root(BOOT_INFO))
            boot = GrubBoot(**{k: str(info[k]) for k in ("root_uuid", "kernel", "initrd", "cmdline")})
        except (ValueError, KeyError, TypeError) as exc:
            raise OutputError(
                f"{BOOT_INFO} in the image does not say what GRUB boots: {exc}",
                hint="the staging plan's bootloader step writes it; rebuild with this imagebuilder",
            ) from exc
        return reference(image, boot, loader=files.esp(LOADER_PATH), kernel=files.root(boot.kernel),
                         initrd=files.root(boot.initrd))  # fmt: skip


def corroborate(ref: measurements.BootReference, raw_log: bytes) -> list[str]:
    """What the booted image's event log says against the prediction: [] when they agree, else one
    line per PCR naming the event that differs (the build then fails)."""
    try:
        log = eventlog.parse(raw_log)
    except eventlog.EventLogError as exc:
        return [f"the booted image's event log cannot be read: {exc}"]
    if ref.bank not in log.algorithms:
        return [f"the booted image's event log has no {ref.bank} bank (it has {', '.join(log.algorithms)})"]
    return [m.message for m in measurements.check(ref, log)]
