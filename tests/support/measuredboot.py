"""A synthesised measured boot for tests: firmware-like events extended into a real TPM, their log, a reference.

:class:`Boot` is a list of events (PCR, type, data, digest) shaped like what OVMF, GRUB and the
kernel measure: the firmware's separators and "Calling EFI Application" action, a boot loader
application digest in PCR 4, GRUB's commands (self-checking text) in PCR 8 and the files it
reads in PCR 9. :meth:`Boot.extend_into` extends each digest into a TPM's PCRs (tpm2-pytss, the
same TCTI the agent uses), :meth:`Boot.log` is the TCG crypto-agile log the firmware would hand
the OS (``protocol.eventlog.encode``), and :meth:`Boot.reference` the boot-measurements.json the
image builder would publish for it. Changing an event (:meth:`Boot.with_event`) gives the same
boot with a different kernel, command line or configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from protocol import eventlog

CALLING = b"Calling EFI Application from Boot Option"
SEPARATOR = b"\x00\x00\x00\x00"


@dataclass(frozen=True)
class Ev:
    pcr: int
    type: int
    data: bytes
    digest: bytes  # SHA-256 of what is measured
    what: str = ""
    checked: bool = True  # part of the reference (False: a firmware event the reference allows)

    @property
    def text(self) -> str | None:
        """GRUB's PCR 8 text (without the NUL), the form the reference names it by."""
        if self.pcr == 8 and self.type == eventlog.EV_IPL:
            return self.data.rstrip(b"\x00").decode()
        return None


def grub_cmd(text: str) -> Ev:
    prefix, _, rest = text.partition(": ")
    assert prefix in ("grub_cmd", "kernel_cmdline"), prefix
    return Ev(8, eventlog.EV_IPL, text.encode() + b"\x00", hashlib.sha256(rest.encode()).digest())


def grub_file(name: str, content: bytes) -> Ev:
    return Ev(9, eventlog.EV_IPL, name.encode() + b"\x00", hashlib.sha256(content).digest(), what=name)


def fixture_boot(cmdline: str = "root=UUID=1234 ro console=ttyS0", kernel: bytes = b"kernel-6.1") -> Boot:
    """A boot like the fixture image's: OVMF, BOOTX64.EFI (GRUB), grub.cfg, kernel, initrd."""
    loader = hashlib.sha256(b"the Authenticode hash of BOOTX64.EFI").digest()
    events = [
        Ev(0, eventlog.EV_S_CRTM_VERSION, b"OVMF\x00", hashlib.sha256(b"OVMF\x00").digest(), checked=False),
        Ev(7, eventlog.EV_EFI_VARIABLE_DRIVER_CONFIG, b"SecureBoot=0", hashlib.sha256(b"SecureBoot=0").digest(),
           checked=False),
        Ev(7, eventlog.EV_SEPARATOR, SEPARATOR, hashlib.sha256(SEPARATOR).digest(), checked=False),
        Ev(4, eventlog.EV_EFI_ACTION, CALLING, hashlib.sha256(CALLING).digest(), checked=False),
        *[Ev(p, eventlog.EV_SEPARATOR, SEPARATOR, hashlib.sha256(SEPARATOR).digest(), checked=False)
          for p in range(7)],
        Ev(4, eventlog.EV_EFI_BOOT_SERVICES_APPLICATION, b"\x00" * 32, loader, what="EFI/BOOT/BOOTX64.EFI"),
        grub_file("(hd0,gpt1)/EFI/debian/grub.cfg", b"configfile (hd0,gpt2)/boot/grub/grub.cfg\n"),
        grub_cmd("grub_cmd: configfile (hd0,gpt2)/boot/grub/grub.cfg"),
        grub_file("(hd0,gpt2)/boot/grub/grub.cfg", b"linux /vmlinuz " + cmdline.encode() + b"\ninitrd /initrd.img\nboot\n"),
        grub_cmd(f"grub_cmd: linux /vmlinuz {cmdline}"),
        grub_file("/vmlinuz", kernel),
        grub_cmd(f"kernel_cmdline: /vmlinuz {cmdline}"),
        grub_cmd("grub_cmd: initrd /initrd.img"),
        grub_file("/initrd.img", b"initrd-6.1"),
        grub_cmd("grub_cmd: boot"),
    ]  # fmt: skip
    return Boot(tuple(events))


@dataclass(frozen=True)
class Boot:
    events: tuple[Ev, ...]

    def with_event(self, index: int, event: Ev) -> Boot:
        events = list(self.events)
        events[index] = event
        return Boot(tuple(events))

    def find(self, pcr: int, contains: str) -> int:
        """The index of the first event of ``pcr`` whose data contains ``contains``."""
        for n, e in enumerate(self.events):
            if e.pcr == pcr and contains.encode() in e.data:
                return n
        raise KeyError(f"no event of PCR {pcr} contains {contains!r}")

    def log(self, *, digest_of: dict[int, bytes] | None = None, bank: str = "sha256") -> bytes:
        """The TCG log of this boot; ``digest_of`` replaces the logged digest of some events (a lying log)."""
        lie = digest_of or {}
        return eventlog.encode(
            [bank], [(e.pcr, e.type, {bank: _in_bank(lie.get(n, e.digest), e, bank)}, e.data)
                     for n, e in enumerate(self.events)]
        )  # fmt: skip

    def extend_into(self, tcti: str, bank: str = "sha256") -> None:
        """Extend every event's digest into the TPM's PCRs of ``bank``, in order (what the firmware does)."""
        from tpm2_pytss import ESAPI
        from tpm2_pytss.constants import ESYS_TR, TPM2_ALG
        from tpm2_pytss.types import TPML_DIGEST_VALUES, TPMT_HA

        os.environ.setdefault("TSS2_LOG", "all+NONE")
        ctx = ESAPI(tcti)
        try:
            for e in self.events:
                ha = TPMT_HA(hashAlg=TPM2_ALG.SHA256 if bank == "sha256" else TPM2_ALG.SHA1)
                if bank == "sha256":
                    ha.digest.sha256 = e.digest
                else:
                    ha.digest.sha1 = _in_bank(e.digest, e, bank)
                ctx.pcr_extend(ESYS_TR.PCR0 + e.pcr, TPML_DIGEST_VALUES([ha]))
        finally:
            ctx.close()

    def reference(self, image: str = "fixture-node-test") -> dict[str, object]:
        """The boot-measurements.json the builder would publish for this boot (PCRs 4, 8, 9)."""
        pcrs: dict[str, dict[str, list[object]]] = {}
        for e in self.events:
            if e.pcr not in (4, 8, 9):
                continue
            spec = pcrs.setdefault(str(e.pcr), {"events": [], "firmware": []})
            if not e.checked:
                name = eventlog.event_name(e.type)
                if name not in spec["firmware"]:
                    spec["firmware"].append(name)
                continue
            entry: dict[str, object] = {"type": eventlog.event_name(e.type)}
            if e.text is not None:
                entry["text"] = e.text
            else:
                entry["digest"] = e.digest.hex()
            if e.what:
                entry["what"] = e.what
            spec["events"].append(entry)
        for spec in pcrs.values():
            spec["firmware"] = sorted(spec["firmware"])  # type: ignore[type-var]
        return {"schema": 1, "bank": "sha256", "image": image, "pcrs": pcrs}

    def write_reference(self, path: Path, image: str = "fixture-node-test") -> str:
        """Write the reference; return its sha256 (what a pool pins)."""
        raw = json.dumps(self.reference(image), indent=1, sort_keys=True).encode() + b"\n"
        path.write_bytes(raw)
        return hashlib.sha256(raw).hexdigest()


def _in_bank(digest: bytes, event: Ev, bank: str) -> bytes:
    """The event's digest in ``bank`` (SHA-1 banks: a SHA-1 of the SHA-256, stable and of the right size)."""
    return digest if bank == "sha256" else hashlib.sha1(digest + event.data).digest()  # noqa: S324 - a test bank


def pool_measured_boot(
    *releases: tuple[str, Path, str], unchecked: tuple[int, ...] = (0, 1, 2, 3, 5, 6, 7)
) -> dict[str, object]:
    """A pool's ``measured_boot`` section admitting ``(name, measurements path, sha256)`` releases."""
    return {
        "releases": [{"name": n, "measurements": str(p), "sha256": d} for n, p, d in releases],
        "unchecked_pcrs": list(unchecked),
        "bank": "sha256",
    }
