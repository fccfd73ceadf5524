"""Building blocks of the check rules: typed access to observations, outcomes, the rule record.

A rule is a pure function of the observations in a report and a pool policy. It
never trusts a status, a summary or a derived value the agent wrote: it reads
the raw values (``observations``) and decides. Observations that do not have
the documented shape raise :class:`Malformed`, which the evaluator turns into a
failure of that check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from protocol.report import JsonValue, Observation, Status

if TYPE_CHECKING:
    from protocol.policy import PoolPolicy


class Severity(StrEnum):
    """What a problem found by a check does to the verdict: ``fatal`` fails the node, ``warn`` does not."""

    FATAL = "fatal"
    WARN = "warn"


class Malformed(Exception):
    """Observations that do not have the shape the rule documents."""


class Obs:
    """Read-only, typed access to one observations mapping. Every accessor raises :class:`Malformed`."""

    def __init__(self, data: Mapping[str, JsonValue], where: str) -> None:
        self._data = data
        self.where = where

    def has(self, key: str) -> bool:
        return key in self._data

    def _get(self, key: str) -> JsonValue:
        if key not in self._data:
            raise Malformed(f"{self.where}: missing {key!r}")
        return self._data[key]

    def num(self, key: str) -> int:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise Malformed(f"{self.where}.{key}: expected an integer")
        return v

    def opt_num(self, key: str) -> int | None:
        return None if self._get(key) is None else self.num(key)

    def text(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str):
            raise Malformed(f"{self.where}.{key}: expected a string")
        return v

    def opt_text(self, key: str) -> str | None:
        return None if self._get(key) is None else self.text(key)

    def flag(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise Malformed(f"{self.where}.{key}: expected a boolean")
        return v

    def opt_flag(self, key: str) -> bool | None:
        return None if self._get(key) is None else self.flag(key)

    def obj(self, key: str) -> Obs:
        v = self._get(key)
        if not isinstance(v, dict):
            raise Malformed(f"{self.where}.{key}: expected an object")
        return Obs(v, f"{self.where}.{key}")

    def opt_obj(self, key: str) -> Obs | None:
        return None if self._get(key) is None else self.obj(key)

    def objs(self, key: str) -> list[Obs]:
        v = self._get(key)
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise Malformed(f"{self.where}.{key}: expected a list of objects")
        return [Obs(x, f"{self.where}.{key}[{i}]") for i, x in enumerate(v) if isinstance(x, dict)]

    def texts(self, key: str) -> list[str]:
        v = self._get(key)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise Malformed(f"{self.where}.{key}: expected a list of strings")
        return [x for x in v if isinstance(x, str)]

    def nums(self, key: str) -> list[int]:
        v = self._get(key)
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise Malformed(f"{self.where}.{key}: expected a list of integers")
        return [x for x in v if isinstance(x, int)]

    def keys(self) -> list[str]:
        return sorted(self._data)


@dataclass(frozen=True)
class Outcome:
    """What a rule decided. ``reason`` says why for anything but a pass."""

    status: Status
    observed: str
    expected: str
    reason: str = ""


def passed(observed: str, expected: str) -> Outcome:
    return Outcome(Status.PASS, observed, expected)


def failed(observed: str, expected: str, reason: str) -> Outcome:
    return Outcome(Status.FAIL, observed, expected, reason)


def warned(observed: str, expected: str, reason: str) -> Outcome:
    return Outcome(Status.WARN, observed, expected, reason)


def skipped(reason: str, expected: str = "") -> Outcome:
    return Outcome(Status.SKIP, "not evaluated", expected, reason)


class Context:
    """The policy and every observation in one report, by check name."""

    def __init__(self, policy: PoolPolicy, observations: Mapping[str, Observation]) -> None:
        self.policy = policy
        self._by_name = observations

    def obs(self, name: str) -> Obs:
        o = self._by_name.get(name)
        if o is None:
            raise Malformed(f"check {name} is missing from the report, and this check depends on it")
        return Obs(o.observations, name)


RuleFn = Callable[[Context], Outcome]


@dataclass(frozen=True)
class Rule:
    """One check: its name, default severity, where its values come from, and what passes."""

    name: str
    severity: Severity
    source: str
    passes_when: str
    fn: RuleFn


def version_tuple(text: str) -> tuple[int, ...] | None:
    """``"570.124.06"`` -> ``(570, 124, 6)``; ``"v1.31.2"`` -> ``(1, 31, 2)``; None if not dotted numbers."""
    t = text.strip()
    if t.startswith("v"):
        t = t[1:]
    parts = t.split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("ch", "sh", "s", "x")) else f"{n} {word}s"
