"""The report's wire form: canonical, deterministic, and parsed strictly."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ReportError
from protocol.report import (
    MAX_REPORT_BYTES,
    REPORT_SCHEMA_VERSION,
    Check,
    Finding,
    Report,
    Status,
    Verdict,
    canonical_json,
    parse_report,
    report_to_json,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
names = st.from_regex(r"\A(gpu|node)\.[a-z][a-z0-9_]{0,8}\Z")


@st.composite
def reports(draw: st.DrawFn) -> Report:
    check_names = draw(st.lists(names, unique=True, max_size=6))
    checks = tuple(
        Check(
            name=n,
            status=draw(st.sampled_from(list(Status))),
            observed=draw(st.text(max_size=30)),
            expected=draw(st.text(max_size=30)),
            source=draw(st.text(max_size=30)),
            reason=draw(st.text(max_size=30)),
            observations=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        )
        for n in check_names
    )
    failures = tuple(Finding(c.name, c.reason) for c in checks if c.status is Status.FAIL)
    return Report(
        schema_version=REPORT_SCHEMA_VERSION,
        agent_version=draw(st.text(max_size=10)),
        hostname=draw(st.text(max_size=10)),
        pool=draw(st.text(max_size=10)),
        collected_at="2026-03-01T08:09:10Z",
        duration_ms=draw(st.integers(0, 10**6)),
        checks=checks,
        verdict=Verdict(passed=not failures, failures=failures),
    )


@given(reports())
@settings(max_examples=150, deadline=None)
def test_round_trip_is_exact_and_canonical(report: Report) -> None:
    data = canonical_json(report)
    assert parse_report(data) == report
    assert canonical_json(parse_report(data)) == data
    assert (
        data
        == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_only_raise_report_error(data: bytes) -> None:
    with contextlib.suppress(ReportError):
        parse_report(data)


def _sample() -> Report:
    return Report(
        schema_version=REPORT_SCHEMA_VERSION,
        agent_version="0.1.0",
        hostname="gpu-node-01",
        pool="h200",
        collected_at="2026-03-01T08:09:10Z",
        duration_ms=840,
        checks=(
            Check("gpu.pcie", Status.FAIL, "Gen5 x8", "x16", "nvml", "GPU 6: x8", {"gpus": [{"index": 6}]}),
            Check("node.swap", Status.PASS, "swap off", "no swap", "/proc/swaps", "", {"devices": []}),
        ),
        verdict=Verdict(False, (Finding("gpu.pcie", "GPU 6: x8"),)),
    )


def test_canonical_form_is_sorted_compact_utf8() -> None:
    report = replace(_sample(), hostname="nœud-01")
    data = canonical_json(report)
    assert data.startswith(b'{"agent_version":"0.1.0","checks":[{"expected":"x16","name":"gpu.pcie"')
    assert b" " not in data.replace(b"Gen5 x8", b"").replace(b"GPU 6: x8", b"").replace(
        b"swap off", b""
    ).replace(b"no swap", b"")
    assert "nœud-01".encode() in data
    assert canonical_json(report) == data


def _mutated(fn: Any) -> bytes:
    doc = report_to_json(_sample())
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(extra=1), "unknown key(s) extra"),
        (lambda d: d.pop("pool"), "missing key(s) pool"),
        (lambda d: d.update(schema_version=2), "unknown report schema version 2"),
        (lambda d: d.update(schema_version="1"), "schema_version: expected an integer"),
        (lambda d: d.update(duration_ms=True), "duration_ms: expected an integer, got a boolean"),
        (lambda d: d.update(duration_ms=-1), "duration_ms: must be at least 0"),
        (lambda d: d.update(collected_at="2026-03-01 08:09:10"), "is not an RFC 3339 UTC time"),
        (lambda d: d["checks"][0].update(status="ok"), "checks[0].status: 'ok' is not one of"),
        (lambda d: d["checks"][0].update(name="GPU PCIe"), "is not a check name"),
        (lambda d: d["checks"][1].update(name="gpu.pcie"), "'gpu.pcie' appears more than once"),
        (lambda d: d["checks"][0].update(observations=[]), "observations: expected an object"),
        (lambda d: d["checks"][0].pop("source"), "checks[0]: missing key(s) source"),
        (lambda d: d["verdict"].update(passed="no"), "verdict.passed: expected a boolean"),
        (
            lambda d: d["verdict"]["failures"][0].update(check=3),
            "verdict.failures[0].check: expected a string",
        ),
    ],
)
def test_malformed_reports_are_rejected(mutate: Any, message: str) -> None:
    with pytest.raises(ReportError) as err:
        parse_report(_mutated(mutate))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"[]", "expected an object"),
        (b"{", "not JSON"),
        (canonical_json(_sample()).replace(b'"index":6', b'"index":6.0'), "floating-point number 6.0"),
        (canonical_json(_sample()).replace(b'"index":6', b'"index":NaN'), "NaN is not allowed"),
        (
            canonical_json(_sample()).replace(b'{"index":6}', b'{"index":6,"index":7}'),
            "duplicate key 'index'",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b" " * (MAX_REPORT_BYTES + 1), "the limit is"),
    ],
)
def test_malformed_bytes_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(ReportError) as err:
        parse_report(data)
    assert message in str(err.value)


def test_observations_too_deep_are_rejected() -> None:
    deep: Any = 1
    for _ in range(12):
        deep = {"x": deep}
    doc: Any = report_to_json(_sample())
    doc["checks"][0]["observations"] = {"deep": deep}
    with pytest.raises(ReportError, match="nested deeper than"):
        parse_report(json.dumps(doc).encode())


def test_canonical_json_refuses_floats() -> None:
    floats: Any = {"t": 1.5}
    report = replace(_sample(), checks=(replace(_sample().checks[0], observations=floats),))
    with pytest.raises(ReportError, match="float is not allowed"):
        canonical_json(report)
