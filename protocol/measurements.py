"""Boot reference values: what an image's boot chain measures, and the check of a node's log against them.

The image builder knows every byte the image boots (the boot loader and kernel EFI applications,
the GRUB configuration and commands, the kernel, the initrd, the command line), so it publishes,
per image, the events it expects in the PCRs that do not depend on the machine's firmware, as a
``boot-measurements.json`` (covered by the build's SHA256SUMS and signature)::

    {"schema": 1, "bank": "sha256", "image": "<build id>",
     "pcrs": {"4": {"events": [{"type": "EV_EFI_BOOT_SERVICES_APPLICATION", "digest": "<hex>",
                                "what": "EFI/BOOT/BOOTX64.EFI"}, ...],
                    "firmware": ["EV_EFI_ACTION", "EV_SEPARATOR"]},
              "8": {"events": [{"type": "EV_IPL", "text": "grub_cmd: linux /vmlinuz root=UUID=..."}, ...]},
              "9": {"events": [{"type": "EV_IPL", "digest": "<hex>", "what": "/boot/vmlinuz"}, ...]}}}

:func:`check` takes a node's event log (already replayed and matched to a verified quote) and,
for each PCR of the reference: drops the firmware-inserted events it allows (only if their data
proves itself: an ``EV_EFI_ACTION`` text whose digest is its own hash, a separator), and requires
the rest to be exactly the expected events, in order: same type, same digest (for events whose
digest covers a file or an application) or, for GRUB's self-checking command events, a digest
that is the hash of its own text and a text equal to the expected one, where ``(hdN,gptM)`` device
names may differ (they follow firmware disk enumeration). The first difference is reported with
the PCR, the event's position and what was expected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from protocol import eventlog
from protocol.errors import ProtocolError

SCHEMA = 1
MAX_REFERENCE_BYTES = 1024 * 1024
MAX_EVENTS_PER_PCR = 4096
_HEX_RE = re.compile(r"[0-9a-f]{40,128}")
_DEVICE_RE = re.compile(r"\(hd[0-9]+,(?:gpt|msdos)[0-9]+\)")
_FIRMWARE_TYPES = {"EV_EFI_ACTION", "EV_SEPARATOR", "EV_EVENT_TAG", "EV_EFI_GPT_EVENT"}


class ReferenceError(ProtocolError):
    """A boot-measurements file that does not follow the schema."""


@dataclass(frozen=True)
class ExpectedEvent:
    type: int
    digest: bytes | None = None
    text: str | None = None
    what: str = ""

    def describe(self) -> str:
        name = eventlog.event_name(self.type)
        if self.text is not None:
            return f"{name} {self.text[:100]!r}"
        return f"{name} {self.what or ''} {self.digest.hex()[:16] if self.digest else ''}".strip()


@dataclass(frozen=True)
class PcrReference:
    events: tuple[ExpectedEvent, ...]
    firmware: frozenset[int] = frozenset()


@dataclass(frozen=True)
class BootReference:
    bank: str
    image: str
    pcrs: dict[int, PcrReference] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        def ev(e: ExpectedEvent) -> dict[str, Any]:
            out: dict[str, Any] = {"type": eventlog.event_name(e.type)}
            if e.digest is not None:
                out["digest"] = e.digest.hex()
            if e.text is not None:
                out["text"] = e.text
            if e.what:
                out["what"] = e.what
            return out

        return {
            "schema": SCHEMA,
            "bank": self.bank,
            "image": self.image,
            "pcrs": {
                str(i): {
                    "events": [ev(e) for e in ref.events],
                    "firmware": sorted(eventlog.event_name(t) for t in ref.firmware),
                }
                for i, ref in sorted(self.pcrs.items())
            },
        }


def _event_type(value: Any, where: str) -> int:
    if not isinstance(value, str) or value not in eventlog.NAME_TO_TYPE:
        raise ReferenceError(f"{where}: unknown event type {value!r}")
    return eventlog.NAME_TO_TYPE[value]


def load(raw: bytes) -> BootReference:
    """Parse and validate a boot-measurements.json (bounded; unknown keys refused)."""
    if len(raw) > MAX_REFERENCE_BYTES:
        raise ReferenceError(f"boot measurements of {len(raw)} bytes exceed {MAX_REFERENCE_BYTES}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ReferenceError(f"boot measurements: not JSON ({str(exc)[:80]})") from exc
    if not isinstance(doc, dict) or set(doc) - {"schema", "bank", "image", "pcrs", "source"}:
        raise ReferenceError("boot measurements: expected keys schema, bank, image, pcrs (and source)")
    if doc.get("schema") != SCHEMA:
        raise ReferenceError(f"boot measurements: schema {doc.get('schema')!r} is not {SCHEMA}")
    bank = doc.get("bank")
    if bank not in eventlog.ALG_BY_NAME:
        raise ReferenceError(
            f"boot measurements: bank {bank!r} is not one of {', '.join(eventlog.ALG_BY_NAME)}"
        )
    image = doc.get("image", "")
    if not isinstance(image, str) or len(image) > 256:
        raise ReferenceError("boot measurements: image must be a short string")
    size = {"sha1": 20, "sha256": 32, "sha384": 48, "sha512": 64}[bank]
    pcrs_doc = doc.get("pcrs")
    if not isinstance(pcrs_doc, dict) or not pcrs_doc:
        raise ReferenceError("boot measurements: pcrs must be a non-empty mapping")
    pcrs: dict[int, PcrReference] = {}
    for key, spec in pcrs_doc.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or int(key) > eventlog.MAX_PCR:
            raise ReferenceError(f"boot measurements: PCR key {key!r} is not 0..{eventlog.MAX_PCR}")
        where = f"pcrs.{key}"
        if not isinstance(spec, dict) or set(spec) - {"events", "firmware"}:
            raise ReferenceError(f"{where}: expected keys events and firmware")
        events_doc = spec.get("events", [])
        if not isinstance(events_doc, list) or len(events_doc) > MAX_EVENTS_PER_PCR:
            raise ReferenceError(f"{where}.events: expected a list of at most {MAX_EVENTS_PER_PCR} events")
        events = []
        for n, e in enumerate(events_doc):
            ew = f"{where}.events[{n}]"
            if not isinstance(e, dict) or set(e) - {"type", "digest", "text", "what"}:
                raise ReferenceError(f"{ew}: expected keys type, digest, text, what")
            etype = _event_type(e.get("type"), ew)
            digest = e.get("digest")
            text = e.get("text")
            if (digest is None) == (text is None):
                raise ReferenceError(f"{ew}: give exactly one of digest and text")
            if digest is not None and (not isinstance(digest, str) or not _HEX_RE.fullmatch(digest)
                                       or len(digest) != 2 * size):  # fmt: skip
                raise ReferenceError(f"{ew}.digest: expected {2 * size} lowercase hex characters")
            if text is not None and (not isinstance(text, str) or len(text) > 8192):
                raise ReferenceError(f"{ew}.text: expected a string of at most 8192 characters")
            what = e.get("what", "")
            if not isinstance(what, str) or len(what) > 512:
                raise ReferenceError(f"{ew}.what: expected a short string")
            events.append(
                ExpectedEvent(etype, bytes.fromhex(digest) if digest is not None else None, text, what)
            )
        firmware_doc = spec.get("firmware", [])
        if not isinstance(firmware_doc, list) or not all(t in _FIRMWARE_TYPES for t in firmware_doc):
            raise ReferenceError(
                f"{where}.firmware: allowed firmware events are {', '.join(sorted(_FIRMWARE_TYPES))}"
            )
        pcrs[int(key)] = PcrReference(
            tuple(events), frozenset(eventlog.NAME_TO_TYPE[t] for t in firmware_doc)
        )
    return BootReference(bank=bank, image=image, pcrs=pcrs)


@dataclass(frozen=True)
class Mismatch:
    pcr: int
    position: int  # the event's index in the node's log (0 when an expected event is missing)
    message: str


def _normalise_devices(text: str) -> str:
    return _DEVICE_RE.sub("(hd*,gpt*)", text)


def _matches(expected: ExpectedEvent, actual: eventlog.Event, bank: str) -> bool:
    if actual.type != expected.type:
        return False
    digest = actual.digests.get(bank)
    if expected.digest is not None:
        return digest == expected.digest
    # A text event: its digest must be the hash of its own text, and the text the expected one.
    if eventlog.self_checking(actual, bank) is not True:
        return False
    text = actual.data.rstrip(b"\x00").decode("utf-8", "replace")
    return _normalise_devices(text) == _normalise_devices(expected.text or "")


def check(reference: BootReference, log: eventlog.EventLog) -> list[Mismatch]:
    """Every PCR of ``reference`` against the node's log; [] when the boot is the image's."""
    problems: list[Mismatch] = []
    bank = reference.bank
    for pcr, ref in sorted(reference.pcrs.items()):
        actual = []
        for event in log.for_pcr(pcr):
            if event.type in ref.firmware:
                if event.type in (
                    eventlog.EV_EFI_ACTION,
                    eventlog.EV_SEPARATOR,
                    eventlog.EV_EFI_GPT_EVENT,
                ) and (eventlog.self_checking(event, bank) is not True):
                    problems.append(
                        Mismatch(
                            pcr,
                            event.index,
                            f"PCR {pcr}: event {event.index} ({event.type_name} "
                            f"{event.label(60)!r}) does not hash to its own digest",
                        )
                    )
                    break
                continue
            actual.append(event)
        else:
            for n, expected in enumerate(ref.events):
                if n >= len(actual):
                    problems.append(
                        Mismatch(
                            pcr,
                            0,
                            f"PCR {pcr}: the boot measured {len(actual)} event(s); the image "
                            f"expects {len(ref.events)}: missing {expected.describe()}",
                        )
                    )
                    break
                got = actual[n]
                if not _matches(expected, got, bank):
                    digest = got.digests.get(bank, b"").hex()[:16]
                    problems.append(
                        Mismatch(
                            pcr,
                            got.index,
                            f"PCR {pcr}: event {got.index} ({got.type_name} {got.label(80)!r}, digest {digest}...) "
                            f"is not the image's: expected {expected.describe()}",
                        )
                    )
                    break
            else:
                if len(actual) > len(ref.events):
                    extra = actual[len(ref.events)]
                    problems.append(
                        Mismatch(
                            pcr,
                            extra.index,
                            f"PCR {pcr}: event {extra.index} ({extra.type_name} "
                            f"{extra.label(80)!r}) is not in the image's boot chain",
                        )
                    )
    return problems
