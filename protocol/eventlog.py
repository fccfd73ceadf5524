"""The TCG PC Client event log (crypto-agile format) and its replay to PCR values.

The log is what ``/sys/kernel/security/tpm0/binary_bios_measurements`` holds: a first
``TCG_PCR_EVENT`` in the SHA-1 format whose data is the ``Spec ID Event03`` structure (it names
the digest algorithms and their sizes), then ``TCG_PCR_EVENT2`` records, little-endian:
``PCRIndex u32, EventType u32, TPML_DIGEST_VALUES {count u32, (alg u16, digest)*}, EventSize u32,
Event[EventSize]`` (TCG EFI Protocol Specification 5.1 and 5.2; go-attestation ``eventlog.go``).

Replay (go-attestation ``replayPCR``): per PCR and bank, skip ``EV_NO_ACTION``, start from zeros
(PCR 0 starts at the locality of a 17-byte ``StartupLocality`` event), ``new = H(old || digest)``.

The log comes from the node, so it is hostile input: :func:`parse` bounds its size, the number of
events and each event's size before it reads anything, and raises :class:`EventLogError` (a
:class:`protocol.errors.ProtocolError`) and nothing else for bad input. The data of an event is
the node's word only; events whose digest covers their own data can be checked
(:func:`self_checking`), every other event's data is a label, never evidence.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.errors import ProtocolError

MAX_LOG_BYTES = 2 * 1024 * 1024
MAX_EVENTS = 20_000
MAX_EVENT_BYTES = 1024 * 1024
MAX_PCR = 23

EV_NO_ACTION = 0x3
EV_SEPARATOR = 0x4
EV_ACTION = 0x5
EV_EVENT_TAG = 0x6
EV_S_CRTM_VERSION = 0x8
EV_POST_CODE = 0x1
EV_IPL = 0xD
EV_EFI_EVENT_BASE = 0x80000000
EV_EFI_VARIABLE_DRIVER_CONFIG = EV_EFI_EVENT_BASE + 0x1
EV_EFI_VARIABLE_BOOT = EV_EFI_EVENT_BASE + 0x2
EV_EFI_BOOT_SERVICES_APPLICATION = EV_EFI_EVENT_BASE + 0x3
EV_EFI_BOOT_SERVICES_DRIVER = EV_EFI_EVENT_BASE + 0x4
EV_EFI_GPT_EVENT = EV_EFI_EVENT_BASE + 0x6
EV_EFI_ACTION = EV_EFI_EVENT_BASE + 0x7
EV_EFI_PLATFORM_FIRMWARE_BLOB = EV_EFI_EVENT_BASE + 0x8
EV_EFI_HANDOFF_TABLES = EV_EFI_EVENT_BASE + 0x9
EV_EFI_VARIABLE_BOOT2 = EV_EFI_EVENT_BASE + 0xC
EV_EFI_VARIABLE_AUTHORITY = EV_EFI_EVENT_BASE + 0xE0

EVENT_NAMES = {
    0x0: "EV_PREBOOT_CERT",
    EV_POST_CODE: "EV_POST_CODE",
    EV_NO_ACTION: "EV_NO_ACTION",
    EV_SEPARATOR: "EV_SEPARATOR",
    EV_ACTION: "EV_ACTION",
    EV_EVENT_TAG: "EV_EVENT_TAG",
    0x7: "EV_S_CRTM_CONTENTS",
    EV_S_CRTM_VERSION: "EV_S_CRTM_VERSION",
    0x9: "EV_CPU_MICROCODE",
    0xA: "EV_PLATFORM_CONFIG_FLAGS",
    0xB: "EV_TABLE_OF_DEVICES",
    0xC: "EV_COMPACT_HASH",
    EV_IPL: "EV_IPL",
    0xE: "EV_IPL_PARTITION_DATA",
    0xF: "EV_NONHOST_CODE",
    0x10: "EV_NONHOST_CONFIG",
    0x11: "EV_NONHOST_INFO",
    0x12: "EV_OMIT_BOOT_DEVICE_EVENTS",
    EV_EFI_VARIABLE_DRIVER_CONFIG: "EV_EFI_VARIABLE_DRIVER_CONFIG",
    EV_EFI_VARIABLE_BOOT: "EV_EFI_VARIABLE_BOOT",
    EV_EFI_BOOT_SERVICES_APPLICATION: "EV_EFI_BOOT_SERVICES_APPLICATION",
    EV_EFI_BOOT_SERVICES_DRIVER: "EV_EFI_BOOT_SERVICES_DRIVER",
    EV_EFI_EVENT_BASE + 0x5: "EV_EFI_RUNTIME_SERVICES_DRIVER",
    EV_EFI_GPT_EVENT: "EV_EFI_GPT_EVENT",
    EV_EFI_ACTION: "EV_EFI_ACTION",
    EV_EFI_PLATFORM_FIRMWARE_BLOB: "EV_EFI_PLATFORM_FIRMWARE_BLOB",
    EV_EFI_HANDOFF_TABLES: "EV_EFI_HANDOFF_TABLES",
    EV_EFI_EVENT_BASE + 0xA: "EV_EFI_PLATFORM_FIRMWARE_BLOB2",
    EV_EFI_EVENT_BASE + 0xB: "EV_EFI_HANDOFF_TABLES2",
    EV_EFI_VARIABLE_BOOT2: "EV_EFI_VARIABLE_BOOT2",
    EV_EFI_EVENT_BASE + 0x10: "EV_EFI_HCRTM_EVENT",
    EV_EFI_VARIABLE_AUTHORITY: "EV_EFI_VARIABLE_AUTHORITY",
    EV_EFI_EVENT_BASE + 0xE1: "EV_EFI_SPDM_FIRMWARE_BLOB",
    EV_EFI_EVENT_BASE + 0xE2: "EV_EFI_SPDM_FIRMWARE_CONFIG",
}
NAME_TO_TYPE = {v: k for k, v in EVENT_NAMES.items()}

# TPM_ALG_ID -> (name, hashlib constructor name, digest size)
ALGORITHMS = {
    0x0004: ("sha1", 20),
    0x000B: ("sha256", 32),
    0x000C: ("sha384", 48),
    0x000D: ("sha512", 64),
}
ALG_BY_NAME = {name: alg for alg, (name, _size) in ALGORITHMS.items()}
_SPEC_ID = b"Spec ID Event03\x00"
_STARTUP_LOCALITY = b"StartupLocality\x00"


class EventLogError(ProtocolError):
    """The event log is malformed, too large, or does not replay to what it must."""


def event_name(event_type: int) -> str:
    return EVENT_NAMES.get(event_type, f"0x{event_type:08x}")


@dataclass(frozen=True)
class Event:
    index: int  # position in the log, 0 = the Spec ID header
    pcr: int
    type: int
    digests: dict[str, bytes]  # bank name -> digest
    data: bytes

    @property
    def type_name(self) -> str:
        return event_name(self.type)

    def label(self, limit: int = 120) -> str:
        """The event's data as text for a message (the node's word, cut to size)."""
        text = self.data.decode("utf-8", "replace").rstrip("\x00")
        if not text.isprintable():
            text = self.data[:32].hex()
        return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class EventLog:
    algorithms: dict[str, int]  # bank name -> digest size, from the Spec ID event
    events: tuple[Event, ...] = field(default=())
    startup_locality: int = 0

    def banks(self) -> tuple[str, ...]:
        return tuple(self.algorithms)

    def replay(self, bank: str) -> dict[int, bytes]:
        """PCR index -> value after every event of ``bank`` (PCRs with no event are absent)."""
        if bank not in self.algorithms:
            raise EventLogError(f"the event log has no {bank} bank (it has {', '.join(self.algorithms)})")
        size = self.algorithms[bank]
        values: dict[int, bytes] = {}
        for event in self.events:
            if event.type == EV_NO_ACTION:
                continue
            digest = event.digests.get(bank)
            if digest is None:
                raise EventLogError(f"event {event.index} has no {bank} digest")
            old = values.get(event.pcr)
            if old is None:
                old = initial_value(event.pcr, size, self.startup_locality)
            values[event.pcr] = hashlib.new(bank, old + digest).digest()
        return values

    def for_pcr(self, pcr: int) -> list[Event]:
        return [e for e in self.events if e.pcr == pcr and e.type != EV_NO_ACTION]


def initial_value(pcr: int, size: int, locality: int = 0) -> bytes:
    """A PCR's value at TPM start-up: zeros (PCR 0 carries the start-up locality in its last byte)."""
    if pcr == 0 and locality:
        return bytes(size - 1) + bytes([locality])
    return bytes(size)


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise EventLogError(f"event log truncated in {what} at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return int(struct.unpack("<H", self.take(2, what))[0])

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.take(4, what))[0])

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def parse(raw: bytes) -> EventLog:
    """Parse a crypto-agile event log; refuses SHA-1-format logs (TPM 1.2 style) and oversized input."""
    if len(raw) > MAX_LOG_BYTES:
        raise EventLogError(f"event log of {len(raw)} bytes exceeds the limit of {MAX_LOG_BYTES}")
    if not raw:
        raise EventLogError("the event log is empty")
    c = _Cursor(raw)
    pcr = c.u32("header.PCRIndex")
    etype = c.u32("header.EventType")
    c.take(20, "header.Digest")
    size = c.u32("header.EventSize")
    if size > MAX_EVENT_BYTES:
        raise EventLogError(f"header event of {size} bytes exceeds {MAX_EVENT_BYTES}")
    spec = c.take(size, "header.Event")
    if pcr != 0 or etype != EV_NO_ACTION or not spec.startswith(_SPEC_ID):
        raise EventLogError(
            "not a crypto-agile event log: the first event is not the 'Spec ID Event03' header "
            "(SHA-1-only TPM 1.2 logs are not supported)"
        )
    algorithms = _spec_algorithms(spec)
    sizes_by_id = {alg: ALGORITHMS[alg][1] for alg in ALGORITHMS if ALGORITHMS[alg][0] in algorithms}
    events: list[Event] = []
    locality = 0
    index = 0
    while c.left:
        index += 1
        if index > MAX_EVENTS:
            raise EventLogError(f"the event log has more than {MAX_EVENTS} events")
        pcr = c.u32(f"event {index} PCRIndex")
        if pcr > MAX_PCR:
            raise EventLogError(f"event {index}: PCR index {pcr} is out of range")
        etype = c.u32(f"event {index} EventType")
        count = c.u32(f"event {index} digest count")
        if count > len(ALGORITHMS):
            raise EventLogError(f"event {index}: {count} digests (at most {len(ALGORITHMS)})")
        digests: dict[str, bytes] = {}
        for _ in range(count):
            alg = c.u16(f"event {index} digest algorithm")
            dsize = sizes_by_id.get(alg)
            if dsize is None:
                raise EventLogError(
                    f"event {index}: digest algorithm 0x{alg:04x} is not in the log's header"
                )
            name = ALGORITHMS[alg][0]
            if name in digests:
                raise EventLogError(f"event {index}: two {name} digests")
            digests[name] = c.take(dsize, f"event {index} {name} digest")
        esize = c.u32(f"event {index} EventSize")
        if esize > MAX_EVENT_BYTES:
            raise EventLogError(f"event {index}: {esize} bytes of event data exceeds {MAX_EVENT_BYTES}")
        data = c.take(esize, f"event {index} data")
        if etype == EV_NO_ACTION and pcr == 0 and len(data) == 17 and data.startswith(_STARTUP_LOCALITY):
            locality = data[16]
        elif etype != EV_NO_ACTION and set(digests) != set(algorithms):
            raise EventLogError(
                f"event {index} carries digests for {sorted(digests)}, the header announces {sorted(algorithms)}"
            )
        events.append(Event(index, pcr, etype, digests, data))
    return EventLog(algorithms, tuple(events), locality)


def _spec_algorithms(spec: bytes) -> dict[str, int]:
    c = _Cursor(spec)
    c.take(16, "SpecID signature")
    c.u32("SpecID platformClass")
    minor, major, _errata = c.u8("SpecID minor"), c.u8("SpecID major"), c.u8("SpecID errata")
    if (major, minor) != (2, 0):
        raise EventLogError(f"Spec ID version {major}.{minor} is not 2.0")
    c.u8("SpecID uintnSize")
    n = c.u32("SpecID numberOfAlgorithms")
    if not 1 <= n <= 16:
        raise EventLogError(f"Spec ID announces {n} algorithms")
    out: dict[str, int] = {}
    for _ in range(n):
        alg, size = c.u16("SpecID algorithmId"), c.u16("SpecID digestSize")
        known = ALGORITHMS.get(alg)
        if known is None:
            # An algorithm we cannot hash (SM3, ...): its digests cannot be replayed; refuse rather
            # than guess its records' sizes wrong.
            raise EventLogError(
                f"Spec ID announces digest algorithm 0x{alg:04x}, which this server cannot replay"
            )
        if known[1] != size:
            raise EventLogError(f"Spec ID gives {known[0]} a digest size of {size}, not {known[1]}")
        out[known[0]] = size
    return out


def self_checking(event: Event, bank: str) -> bool | None:
    """Whether the event's data is what its digest covers: True/False when that can be checked.

    None: the digest covers something else (an application's Authenticode hash, a file GRUB read),
    so the data is only a label (boot-path-and-measured-boot.md, B2.3).
    """
    digest = event.digests.get(bank)
    if digest is None:
        return None
    h = hashlib.new(bank)
    if event.type in (EV_SEPARATOR, EV_EFI_ACTION, EV_EFI_GPT_EVENT, EV_EFI_VARIABLE_DRIVER_CONFIG):
        h.update(event.data)
        return h.digest() == digest
    if event.type == EV_IPL and event.pcr == 8:
        # GRUB: "grub_cmd: <command>\0" or "kernel_cmdline: <line>\0"; the digest covers the text after
        # the prefix, without the NUL.
        text = event.data.rstrip(b"\x00")
        for prefix in (b"grub_cmd: ", b"kernel_cmdline: ", b"module_cmdline: "):
            if text.startswith(prefix):
                h.update(text[len(prefix) :])
                return h.digest() == digest
        return False
    return None


def encode(algorithms: Iterable[str], events: Iterable[tuple[int, int, dict[str, bytes], bytes]]) -> bytes:
    """A crypto-agile log from (pcr, type, digests, data): what firmware writes (for tests and tools)."""
    algs = list(algorithms)
    spec = bytearray(_SPEC_ID)
    spec += struct.pack("<IBBBB", 0, 0, 2, 0, 2)
    spec += struct.pack("<I", len(algs))
    for name in algs:
        spec += struct.pack("<HH", ALG_BY_NAME[name], hashlib.new(name).digest_size)
    spec += b"\x00"
    out = bytearray(struct.pack("<II", 0, EV_NO_ACTION) + bytes(20) + struct.pack("<I", len(spec)) + spec)
    for pcr, etype, digests, data in events:
        out += struct.pack("<III", pcr, etype, len(digests))
        for name, digest in digests.items():
            out += struct.pack("<H", ALG_BY_NAME[name]) + digest
        out += struct.pack("<I", len(data)) + data
    return bytes(out)
