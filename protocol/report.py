"""The GPU and node verification report: what the agent observed before asking to join.

The agent runs every check, records for each one what it *observed* in a
machine-readable ``observations`` mapping, and derives a status with the rules
of :mod:`protocol.policy`. The join request carries the report; the server
parses it with :func:`parse_report` and recomputes every status and the verdict
from the observations with :func:`protocol.policy.evaluate`, ignoring the
statuses and the verdict the agent wrote.

Public API (the server depends on these names and signatures):

* ``REPORT_SCHEMA_VERSION`` (int): the only schema version :func:`parse_report` accepts.
* ``Status``: ``pass``, ``fail``, ``warn``, ``skip``.
* ``Observation(name, source, observations)``: what a collector saw.
* ``Check(name, status, observed, expected, source, reason, observations)``: an observation plus
  the outcome of its rule.
* ``Finding(check, reason)`` and ``Verdict(passed, failures, warnings)``.
* ``Report(schema_version, agent_version, hostname, pool, collected_at, duration_ms, checks, verdict)``.
* ``canonical_json(report) -> bytes``: sorted keys, no whitespace, UTF-8, no floats; the same
  report always gives the same bytes.
* ``parse_report(data: bytes) -> Report``: strict; raises :class:`ReportError`, and nothing else,
  for any input that is not a valid report: unknown or missing keys, wrong types, floats, NaN and
  Infinity, duplicate keys, integers outside 64 bits (or of more than 4,300 digits), nesting deeper
  than :data:`MAX_DEPTH`, strings that are not valid Unicode, input that is not UTF-8 or larger than
  :data:`MAX_REPORT_BYTES` (checked before anything is parsed), and an unknown schema version.

Observation values are JSON without floats (``None``, ``bool``, ``int``, ``str``, lists and
string-keyed objects), so the canonical form is the same in every language.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

from protocol.errors import ReportError

REPORT_SCHEMA_VERSION = 1

JsonValue: TypeAlias = "bool | int | str | list[JsonValue] | dict[str, JsonValue] | None"
Observations: TypeAlias = "Mapping[str, JsonValue]"

# The report of a healthy 8-GPU HGX H200 node is about 32 KB (tests/gpu fixtures); a failing one adds
# reasons. The limit is checked on the raw bytes, before any decoding.
MAX_REPORT_BYTES = 256 * 1024
MAX_CHECKS = 256
MAX_STRING = 16 * 1024
MAX_DEPTH = 10
_INT_LIMIT = 2**63

# Used with fullmatch (``$`` would accept a trailing newline, ``\d`` any Unicode digit).
CHECK_NAME_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z0-9_]+)+")
_TIMESTAMP_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z")


class Status(StrEnum):
    PASS = "pass"  # noqa: S105 - a status, not a password
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"


@dataclass(frozen=True)
class Observation:
    """What one collector saw: the check name, where the values came from, and the values."""

    name: str
    source: str
    observations: Observations = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One check in the report. ``reason`` is empty for a pass, and says why otherwise."""

    name: str
    status: Status
    observed: str
    expected: str
    source: str
    reason: str = ""
    observations: Observations = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    check: str
    reason: str


@dataclass(frozen=True)
class Verdict:
    """``passed`` is true when no check failed; warnings never fail a node."""

    passed: bool
    failures: tuple[Finding, ...] = ()
    warnings: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class Report:
    schema_version: int
    agent_version: str
    hostname: str
    pool: str
    collected_at: str  # RFC 3339 UTC, seconds: 2026-01-31T12:00:00Z
    duration_ms: int
    checks: tuple[Check, ...]
    verdict: Verdict

    def check(self, name: str) -> Check | None:
        for c in self.checks:
            if c.name == name:
                return c
        return None


# --------------------------------------------------------------------------- encoding


def _finding_to_json(f: Finding) -> dict[str, JsonValue]:
    return {"check": f.check, "reason": f.reason}


def verdict_to_json(v: Verdict) -> dict[str, JsonValue]:
    return {
        "passed": v.passed,
        "failures": [_finding_to_json(f) for f in v.failures],
        "warnings": [_finding_to_json(f) for f in v.warnings],
    }


def check_to_json(c: Check) -> dict[str, JsonValue]:
    return {
        "name": c.name,
        "status": str(c.status),
        "observed": c.observed,
        "expected": c.expected,
        "source": c.source,
        "reason": c.reason,
        "observations": _plain(c.observations, "observations", 0),
    }


def report_to_json(report: Report) -> dict[str, JsonValue]:
    """The report as plain JSON values (the structure :func:`canonical_json` serialises)."""
    return {
        "schema_version": report.schema_version,
        "agent_version": report.agent_version,
        "hostname": report.hostname,
        "pool": report.pool,
        "collected_at": report.collected_at,
        "duration_ms": report.duration_ms,
        "checks": [check_to_json(c) for c in report.checks],
        "verdict": verdict_to_json(report.verdict),
    }


def canonical_json(report: Report) -> bytes:
    """Deterministic bytes: sorted keys, compact separators, UTF-8 (not ASCII-escaped)."""
    return json.dumps(
        report_to_json(report), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _plain(value: Any, where: str, depth: int) -> JsonValue:
    """Copy ``value`` into plain JSON types, refusing floats and anything else JSON cannot say exactly."""
    if depth > MAX_DEPTH:
        raise ReportError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | str):
        if isinstance(value, str):
            _check_text(value, where)
        return value
    if isinstance(value, int):
        if not -_INT_LIMIT < value < _INT_LIMIT:
            raise ReportError(f"{where}: integer {value} out of the 64-bit range")
        return value
    if isinstance(value, Mapping):
        out: dict[str, JsonValue] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ReportError(f"{where}: object key {k!r} is not a string")
            _check_text(k, f"{where}: object key")
            out[k] = _plain(v, f"{where}.{_shown(k)}", depth + 1)
        return out
    if isinstance(value, Sequence):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise ReportError(
        f"{where}: {type(value).__name__} is not allowed (use int, str, bool, null, list, object)"
    )


# --------------------------------------------------------------------------- decoding


def _no_float(text: str) -> Any:
    raise ReportError(f"floating-point number {text} is not allowed in a report")


def _bounded_int(text: str) -> int:
    """A JSON integer, refused before conversion when it cannot fit in 64 bits (19 digits at most)."""
    if len(text.lstrip("-")) > 19:
        raise ReportError(f"integer of {len(text.lstrip('-'))} digits is out of the 64-bit range")
    return int(text)


def _no_constant(text: str) -> Any:
    raise ReportError(f"{text} is not allowed in a report")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ReportError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _obj(value: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ReportError(f"{where}: expected an object, got {_kind(value)}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ReportError(f"{where}: unknown key(s) {', '.join(unknown)}")
    missing = sorted(keys - set(value))
    if missing:
        raise ReportError(f"{where}: missing key(s) {', '.join(missing)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _check_text(value: str, where: str) -> None:
    """A string a report may carry: bounded, and valid Unicode (a lone surrogate cannot be UTF-8)."""
    if len(value) > MAX_STRING:
        raise ReportError(f"{where}: string longer than {MAX_STRING} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ReportError(f"{where}: string holds a lone surrogate (not valid Unicode)") from None


def _shown(key: str) -> str:
    """An object key as it may appear in an error message: short, printable."""
    return key[:40] + "..." if len(key) > 40 else key


def _str(value: Any, where: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise ReportError(f"{where}: expected a string, got {_kind(value)}")
    _check_text(value, where)
    if nonempty and not value:
        raise ReportError(f"{where}: must not be empty")
    return value


def _int(value: Any, where: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportError(f"{where}: expected an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ReportError(f"{where}: must be at least {minimum}")
    if not -_INT_LIMIT < value < _INT_LIMIT:
        raise ReportError(f"{where}: integer out of the 64-bit range")
    return value


def _list(value: Any, where: str, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise ReportError(f"{where}: expected a list, got {_kind(value)}")
    if len(value) > limit:
        raise ReportError(f"{where}: more than {limit} entries")
    return value


def _findings(value: Any, where: str) -> tuple[Finding, ...]:
    out = []
    for i, item in enumerate(_list(value, where, MAX_CHECKS * 4)):
        w = f"{where}[{i}]"
        obj = _obj(item, w, {"check", "reason"})
        out.append(
            Finding(check=_str(obj["check"], f"{w}.check"), reason=_str(obj["reason"], f"{w}.reason"))
        )
    return tuple(out)


def _check(value: Any, where: str) -> Check:
    obj = _obj(value, where, {"name", "status", "observed", "expected", "source", "reason", "observations"})
    name = _str(obj["name"], f"{where}.name")
    if not CHECK_NAME_RE.fullmatch(name):
        raise ReportError(f"{where}.name: {name!r} is not a check name (dotted lowercase words)")
    status_text = _str(obj["status"], f"{where}.status")
    try:
        status = Status(status_text)
    except ValueError:
        raise ReportError(
            f"{where}.status: {status_text!r} is not one of {', '.join(s.value for s in Status)}"
        ) from None
    observations = obj["observations"]
    if not isinstance(observations, dict):
        raise ReportError(f"{where}.observations: expected an object, got {_kind(observations)}")
    plain = _plain(observations, f"{where}.observations", 0)
    if not isinstance(plain, dict):  # pragma: no cover - _plain keeps a dict a dict
        raise ReportError(f"{where}.observations: expected an object")
    return Check(
        name=name,
        status=status,
        observed=_str(obj["observed"], f"{where}.observed"),
        expected=_str(obj["expected"], f"{where}.expected"),
        source=_str(obj["source"], f"{where}.source"),
        reason=_str(obj["reason"], f"{where}.reason"),
        observations=plain,
    )


def report_from_json(value: Any) -> Report:
    """Build a :class:`Report` from already-decoded JSON values, as strictly as :func:`parse_report`."""
    if isinstance(value, dict) and "schema_version" in value:
        version = value["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise ReportError(f"schema_version: expected an integer, got {_kind(version)}")
        if version != REPORT_SCHEMA_VERSION:
            raise ReportError(
                f"unknown report schema version {version}; this code understands {REPORT_SCHEMA_VERSION}"
            )
    obj = _obj(
        value,
        "report",
        {
            "schema_version",
            "agent_version",
            "hostname",
            "pool",
            "collected_at",
            "duration_ms",
            "checks",
            "verdict",
        },
    )
    collected_at = _str(obj["collected_at"], "collected_at")
    if not _TIMESTAMP_RE.fullmatch(collected_at):
        raise ReportError(
            f"collected_at: {collected_at!r} is not an RFC 3339 UTC time like 2026-01-31T12:00:00Z"
        )
    checks = tuple(
        _check(c, f"checks[{i}]") for i, c in enumerate(_list(obj["checks"], "checks", MAX_CHECKS))
    )
    seen: set[str] = set()
    for c in checks:
        if c.name in seen:
            raise ReportError(f"checks: {c.name!r} appears more than once")
        seen.add(c.name)
    verdict_obj = _obj(obj["verdict"], "verdict", {"passed", "failures", "warnings"})
    passed = verdict_obj["passed"]
    if not isinstance(passed, bool):
        raise ReportError(f"verdict.passed: expected a boolean, got {_kind(passed)}")
    return Report(
        schema_version=_int(obj["schema_version"], "schema_version"),
        agent_version=_str(obj["agent_version"], "agent_version"),
        hostname=_str(obj["hostname"], "hostname"),
        pool=_str(obj["pool"], "pool"),
        collected_at=collected_at,
        duration_ms=_int(obj["duration_ms"], "duration_ms", minimum=0),
        checks=checks,
        verdict=Verdict(
            passed=passed,
            failures=_findings(verdict_obj["failures"], "verdict.failures"),
            warnings=_findings(verdict_obj["warnings"], "verdict.warnings"),
        ),
    )


def parse_report(data: bytes) -> Report:
    """Decode a report the agent sent. Raises :class:`ReportError` for anything malformed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ReportError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_REPORT_BYTES:
        raise ReportError(f"report is {len(data)} bytes; the limit is {MAX_REPORT_BYTES}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(f"report is not UTF-8: {exc}") from exc
    try:
        value = json.loads(
            text,
            parse_float=_no_float,
            parse_int=_bounded_int,
            parse_constant=_no_constant,
            object_pairs_hook=_no_duplicates,
        )
    except ReportError:
        raise
    except RecursionError:
        raise ReportError(f"report is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"report is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # e.g. Python's limit on the digits of an integer
        raise ReportError(f"report is not JSON this parser accepts: {exc}") from None
    try:
        return report_from_json(value)
    except RecursionError:
        raise ReportError(f"report is nested too deeply (at most {MAX_DEPTH} levels)") from None
