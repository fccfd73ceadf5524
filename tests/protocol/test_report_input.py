"""parse_report on hostile input: only ReportError escapes, whatever the bytes (issue 11).

The join broker parses the report an attested agent sends; a bad report must be a clear refusal
(INVALID_ARGUMENT with a reason), never an exception that becomes INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ReportError
from protocol.report import (
    MAX_REPORT_BYTES,
    Check,
    Report,
    Status,
    Verdict,
    canonical_json,
    parse_report,
)

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SEED = Report(
    schema_version=1,
    agent_version="0.1.0",
    hostname="gpu-node-01",
    pool="h200",
    collected_at="2026-01-31T12:00:00Z",
    duration_ms=1500,
    checks=(
        Check(
            name="gpu.pci.inventory",
            status=Status.PASS,
            observed="8 x H200",
            expected="8 x H200",
            source="pci",
            observations={"count": 8, "devices": [{"bdf": "0000:18:00.0", "numa": 0}]},
        ),
    ),
    verdict=Verdict(passed=True),
)
SEED_BYTES = canonical_json(SEED)


def _doc() -> dict[str, object]:
    value = json.loads(SEED_BYTES)
    assert isinstance(value, dict)
    return value


def test_the_seed_round_trips() -> None:
    assert parse_report(SEED_BYTES) == SEED


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (SEED_BYTES.replace(b'"duration_ms":1500', b'"duration_ms":' + b"9" * 5000), "digits"),
        (SEED_BYTES.replace(b'"count":8', b'"count":' + b"1" * 4301), "digits"),
        (SEED_BYTES.replace(b'"count":8', b'"count":-' + b"1" * 20), "64-bit"),
        (SEED_BYTES.replace(b'"count":8', b'"count":NaN'), "NaN is not allowed"),
        (SEED_BYTES.replace(b'"count":8', b'"count":-Infinity'), "-Infinity is not allowed"),
        (SEED_BYTES.replace(b'"count":8', b'"count":1e400'), "floating-point"),
        (SEED_BYTES.replace(b'"count":8', b'"count":' + b"[" * 100_000 + b"]" * 100_000), "nested"),
        (b"[" * 200_000, "too large|nested"),
        (SEED_BYTES.replace(b"gpu-node-01", b"gpu-\xff-node"), "not UTF-8"),
        (SEED_BYTES.replace(b"gpu-node-01", b"gpu-\\ud800-node"), "lone surrogate"),
        (SEED_BYTES.replace(b'"count"', b'"\\udfff"'), "lone surrogate"),
        (b" " * (MAX_REPORT_BYTES + 1), "the limit is"),
        (b"\x00\x01garbage protobuf\x08\x96\x01", "not UTF-8"),
        (b"\x00\x01garbage protobuf\x08\x16\x01", "not JSON"),
        (b"", "not JSON"),
    ],
    ids=[
        "int-5000-digits",
        "int-4301-digits-in-observations",
        "int-20-digits",
        "nan",
        "infinity",
        "float-overflow",
        "deep-nesting",
        "only-brackets",
        "not-utf8",
        "lone-surrogate-value",
        "lone-surrogate-key",
        "over-size",
        "protobuf-garbage",
        "protobuf-garbage-ascii",
        "empty",
    ],
)
def test_hostile_reports_raise_report_error(data: bytes, message: str) -> None:
    with pytest.raises(ReportError, match=message):
        parse_report(data)


def test_the_size_limit_holds_a_large_real_report_and_is_checked_first() -> None:
    """An 8-GPU HGX H200 report is about 32 KB; the limit leaves room for eight times that."""
    assert MAX_REPORT_BYTES >= 8 * 32 * 1024
    with pytest.raises(ReportError, match="the limit is"):  # refused before decoding: not even UTF-8
        parse_report(b"\xff" * (MAX_REPORT_BYTES + 1))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("collected_at", "2026-01-31T12:00:00Z\n"),
        ("collected_at", "\uff12" + "026-01-31T12:00:00Z"),  # a full-width digit two
        ("check", "gpu.pci.inventory\n"),
        ("check", "\ngpu.pci.inventory"),
    ],
)
def test_a_trailing_newline_or_a_non_ascii_digit_is_refused(field: str, value: str) -> None:
    doc = _doc()
    if field == "check":
        checks = doc["checks"]
        assert isinstance(checks, list)
        checks[0]["name"] = value
    else:
        doc[field] = value
    with pytest.raises(ReportError, match="is not"):
        parse_report(json.dumps(doc).encode())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)


def _mutated() -> st.SearchStrategy[bytes]:
    def mutate(args: tuple[list[tuple[int, int]], int]) -> bytes:
        flips, cut = args
        data = bytearray(SEED_BYTES)
        for pos, val in flips:
            data[pos % len(data)] = val
        return bytes(data[: cut % (len(data) + 2)])

    return st.tuples(
        st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=6), st.integers(0, 4096)
    ).map(mutate)


def _spliced() -> st.SearchStrategy[bytes]:
    """The seed with one of its values replaced by an arbitrary JSON value."""
    keys = ["schema_version", "agent_version", "hostname", "pool", "collected_at", "duration_ms", "checks"]

    def splice(args: tuple[str, object]) -> bytes:
        key, value = args
        doc = _doc()
        doc[key] = value
        return json.dumps(doc).encode()

    return st.tuples(st.sampled_from(keys), json_values).map(splice)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=600), _mutated(), _spliced(), json_values.map(lambda v: json.dumps(v).encode())
    )
)
def test_fuzz_only_report_error_escapes(data: bytes) -> None:
    try:
        report = parse_report(data)
    except ReportError:
        return
    assert parse_report(canonical_json(report)) == report  # what is accepted can be written back
