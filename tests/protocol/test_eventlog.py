"""protocol.eventlog: parse and replay a TCG crypto-agile log; tpm2-tools' tpm2_eventlog as a second opinion."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import eventlog, measurements
from protocol.errors import ProtocolError


def _log(banks: tuple[str, ...] = ("sha1", "sha256"), *, locality: bool = True) -> bytes:
    events = []
    rows = [
        (0, eventlog.EV_S_CRTM_VERSION, b"1.0\x00"),
        (0, eventlog.EV_NO_ACTION, b"StartupLocality\x00\x03"),
        (4, eventlog.EV_EFI_ACTION, b"Calling EFI Application from Boot Option"),
        (4, eventlog.EV_SEPARATOR, b"\x00\x00\x00\x00"),
        (8, eventlog.EV_IPL, b"grub_cmd: linux /vmlinuz ro\x00"),
        (9, eventlog.EV_IPL, b"/vmlinuz\x00"),
    ]
    for pcr, etype, data in rows if locality else [r for r in rows if r[1] != eventlog.EV_NO_ACTION]:
        payload = data[len("grub_cmd: ") : -1] if data.startswith(b"grub_cmd: ") else data
        events.append((pcr, etype, {b: hashlib.new(b, payload).digest() for b in banks}, data))
    return eventlog.encode(banks, events)


def test_replay_follows_the_extend_rule() -> None:
    log = eventlog.parse(_log())
    assert log.banks() == ("sha1", "sha256") and log.startup_locality == 3
    values = log.replay("sha256")
    # PCR 0 starts at the start-up locality; EV_NO_ACTION is never extended.
    start = bytes(31) + b"\x03"
    expected0 = hashlib.sha256(start + hashlib.sha256(b"1.0\x00").digest()).digest()
    assert values[0] == expected0
    pcr4 = bytes(32)
    for data in (b"Calling EFI Application from Boot Option", b"\x00\x00\x00\x00"):
        pcr4 = hashlib.sha256(pcr4 + hashlib.sha256(data).digest()).digest()
    assert values[4] == pcr4
    assert set(values) == {0, 4, 8, 9}


def test_self_checking_events() -> None:
    log = eventlog.parse(_log())
    by_pcr = {e.pcr: e for e in log.events if e.type != eventlog.EV_NO_ACTION}
    assert eventlog.self_checking(by_pcr[8], "sha256") is True  # GRUB command: hash of its text
    assert eventlog.self_checking(by_pcr[9], "sha256") is None  # a file GRUB read: the data is a label
    action = next(e for e in log.events if e.type == eventlog.EV_EFI_ACTION)
    assert eventlog.self_checking(action, "sha256") is True


@pytest.mark.subprocess
def test_tpm2_eventlog_reads_our_log_and_replays_it_the_same(tmp_path: Path) -> None:
    """tpm2-tools' own parser as the oracle for the format and the replay.

    (A log without a StartupLocality event: tpm2-tools 5.4 neither starts PCR 0 at the locality nor
    skips EV_NO_ACTION, both of which the TCG PC Client spec and go-attestation do; those two rules are
    checked against the spec's arithmetic in test_replay_follows_the_extend_rule.)
    """
    tool = shutil.which("tpm2_eventlog")
    if tool is None:
        pytest.fail("tpm2_eventlog (Debian package tpm2-tools) is required; run scripts/ensure-deps.sh")
    path = tmp_path / "binary_bios_measurements"
    path.write_bytes(_log(locality=False))
    out = subprocess.run([tool, str(path)], capture_output=True, text=True, check=True, timeout=60).stdout
    doc = yaml.safe_load(out)
    ours = eventlog.parse(path.read_bytes())
    assert len(doc["events"]) == len(ours.events) + 1  # tpm2_eventlog counts the Spec ID header too
    for bank in ("sha1", "sha256"):
        theirs = {int(k): int(v) for k, v in doc["pcrs"][bank].items()}
        for pcr, value in ours.replay(bank).items():
            assert theirs[pcr] == int.from_bytes(value, "big"), (bank, pcr)


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b"", "empty"),
        (b"\x00" * 40, "truncated"),
        (struct.pack("<II", 0, 3) + bytes(20) + struct.pack("<I", 4) + b"nope", "not crypto-agile"),
        (_log()[:-3], "truncated event"),
        (_log() + struct.pack("<III", 99, 1, 0) + struct.pack("<I", 0), "PCR out of range"),
        (_log() + struct.pack("<III", 1, 1, 1) + struct.pack("<H", 0x0012), "unknown algorithm"),
        (_log() + struct.pack("<III", 1, 1, 0) + struct.pack("<I", 2**31), "huge event"),
        (b"\x00" * (eventlog.MAX_LOG_BYTES + 1), "over the size limit"),
    ],
)
def test_malformed_logs_are_protocol_errors(raw: bytes, what: str) -> None:
    with pytest.raises(eventlog.EventLogError):
        eventlog.parse(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_fuzz_only_event_log_errors_escape(data: bytes) -> None:
    header = _log()[:80]
    for raw in (data, header + data, _log() + data):
        try:
            log = eventlog.parse(raw)
            for bank in log.banks():
                log.replay(bank)
        except eventlog.EventLogError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_reference_files_only_reference_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        measurements.load(data)


@pytest.mark.parametrize(
    "doc",
    [
        {"schema": 2, "bank": "sha256", "pcrs": {"4": {"events": []}}},
        {"schema": 1, "bank": "md5", "pcrs": {"4": {"events": []}}},
        {"schema": 1, "bank": "sha256", "pcrs": {}},
        {"schema": 1, "bank": "sha256", "pcrs": {"4\n": {"events": []}}},
        {"schema": 1, "bank": "sha256", "pcrs": {"24": {"events": []}}},
        {
            "schema": 1,
            "bank": "sha256",
            "pcrs": {"4": {"events": [{"type": "EV_NOPE", "digest": "00" * 32}]}},
        },
        {
            "schema": 1,
            "bank": "sha256",
            "pcrs": {"4": {"events": [{"type": "EV_IPL", "digest": "00" * 20}]}},
        },
        {"schema": 1, "bank": "sha256", "pcrs": {"4": {"events": [{"type": "EV_IPL"}]}}},
        {"schema": 1, "bank": "sha256", "pcrs": {"4": {"events": [], "firmware": ["EV_IPL"]}}},
        {"schema": 1, "bank": "sha256", "pcrs": {"4": {"events": []}}, "extra": 1},
    ],
)
def test_malformed_references_are_refused(doc: dict[str, object]) -> None:
    import json

    with pytest.raises(measurements.ReferenceError):
        measurements.load(json.dumps(doc).encode())
