"""Value kinds for the settings tables: what a setting's value may be, parsed, bounded and described.

Each factory (:func:`text`, :func:`boolean`, :func:`integer`, :func:`number`, :func:`duration`,
:func:`size`, :func:`choice`, :func:`address`, :func:`path`, :func:`optional`, :func:`list_of`,
:func:`raw`, :func:`section`, :func:`mapping_of`) returns a :class:`Kind`: its parser (which
raises :class:`SettingError` naming the key path, what is expected and what was found), its
JSON Schema, and how to write a value back. Text is matched whole (``re.fullmatch``; in JSON
Schema an anchored pattern that refuses a trailing newline) and bounded before it is parsed.
:mod:`protocol.settings` builds tables from these and re-exports them.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from protocol.errors import ProtocolError
from protocol.units import UnitError, format_duration, format_size, parse_duration_ns, parse_size


class SectionTable(Protocol):
    """What :func:`section` needs of a table (:class:`protocol.settings.Table`)."""

    @property
    def expected(self) -> str: ...

    def parse(self, doc: Any, ctx: Ctx | None = None, *, partial: bool = False) -> dict[str, Any]: ...

    def json_schema(self, *, lenient: bool | None = None, title: str = "") -> dict[str, Any]: ...


MAX_TEXT = 4096  # the longest scalar text any setting takes; longer input is refused before parsing
_REPR = 80  # how much of a bad value an error message quotes

KeyPath = tuple[str | int, ...]


class Problem(StrEnum):
    """What was wrong with a setting (structured: callers decide on this, never on the message)."""

    UNKNOWN_KEY = "unknown_key"
    MISSING = "missing"
    TYPE = "type"
    VALUE = "value"


def dotted(path: KeyPath) -> str:
    """``pools.cpu.extra_groups[0]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def quote_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR else text[: _REPR - 3] + "..."


_ABSENT = object()


class SettingError(ProtocolError):
    """A setting that cannot be used: ``path`` (key path), ``problem``, ``expected``, ``got``.

    ``allowed`` lists the known keys for :attr:`Problem.UNKNOWN_KEY`; ``detail`` is the sentence for
    :attr:`Problem.VALUE` and :attr:`Problem.MISSING`. The message is for people; callers that
    reword it (to keep an older wording) read the fields.
    """

    def __init__(
        self,
        path: KeyPath,
        problem: Problem,
        *,
        expected: str = "",
        got: Any = _ABSENT,
        allowed: Sequence[str] = (),
        detail: str = "",
        hint: str = "",
    ) -> None:
        self.path = tuple(path)
        self.problem = problem
        self.expected = expected
        self.got = got
        self.allowed = tuple(allowed)
        self.detail = detail
        self.hint = hint
        super().__init__(self._render())

    @property
    def where(self) -> str:
        return dotted(self.path)

    @property
    def got_text(self) -> str:
        if self.got is _ABSENT:
            return ""
        if isinstance(self.got, Mapping | list | tuple) and not self.got:
            return f"an empty {type(self.got).__name__}"
        return f"{type(self.got).__name__} {quote_value(self.got)}"

    def _render(self) -> str:
        where = self.where
        if self.problem is Problem.UNKNOWN_KEY:
            allowed = ", ".join(self.allowed)
            if len(self.path) == 1:
                return f"unknown key {quote_value(self.path[0])}; allowed: {allowed}"
            return f"unknown key {where}; allowed in {dotted(self.path[:-1])}: {allowed}"
        if self.problem is Problem.MISSING:
            return f"{where} is required" + (f": {self.detail}" if self.detail else "")
        if self.problem is Problem.VALUE:
            return f"{where}: {self.detail}" if where else self.detail
        got = f", got {self.got_text}" if self.got_text else ""
        hint = f" ({self.hint})" if self.hint else ""
        return (
            f"{where}: expected {self.expected}{got}{hint}"
            if where
            else f"expected {self.expected}{got}{hint}"
        )


@dataclass(frozen=True)
class Ctx:
    """Where a value is being parsed: its key path, whether text may stand for other types, the
    folder relative paths start from (None: as given)."""

    path: KeyPath = ()
    lenient: bool = False
    base_dir: Path | None = None

    def at(self, part: str | int) -> Ctx:
        return replace(self, path=(*self.path, part))

    def type_error(self, expected: str, got: Any) -> SettingError:
        return SettingError(self.path, Problem.TYPE, expected=expected, got=got)

    def value_error(self, detail: str) -> SettingError:
        return SettingError(self.path, Problem.VALUE, detail=detail)


def _show(value: Any) -> str:
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Kind:
    """A value type: ``parse(value, ctx)`` checks and converts, ``show(value)`` writes it back.

    ``expected`` says what is accepted, in words ("a duration like 30s"); ``schema`` is the JSON
    Schema of the value as a file holds it (strict); ``text_schema`` is the schema that text-typed
    sources (lenient files) may also use.
    """

    name: str
    expected: str
    metavar: str
    schema: Mapping[str, Any]
    parse: Callable[[Any, Ctx], Any]
    show: Callable[[Any], str] = _show
    text_schema: Mapping[str, Any] | None = None
    choices: tuple[str, ...] = ()


def bounded_text(value: str, ctx: Ctx) -> str:
    if len(value) > MAX_TEXT:
        raise ctx.value_error(f"longer than {MAX_TEXT} characters ({len(value)})")
    return value


def _safe_pattern(body: str) -> str:
    """A JSON Schema pattern for ``body`` matched whole: ``^(?:body)(?!\\n)$``.

    JSON Schema patterns are searched, not matched, and Python's ``$`` also matches before a
    final newline (the defect that let ``node-b\\n`` through): the lookahead refuses it, and means
    nothing to an ECMA-262 engine (an editor), for which ``$`` is already the very end.
    """
    return f"^(?:{body})(?!\\n)$"


def text(
    expected: str = "a string",
    *,
    pattern: str | None = None,
    metavar: str = "TEXT",
    non_empty: bool = False,
    max_len: int = MAX_TEXT,
    number_hint: str = "",
    name: str = "string",
) -> Kind:
    """A string; ``pattern`` must match all of it (``re.fullmatch``: a trailing newline is refused)."""
    compiled = re.compile(pattern) if pattern is not None else None

    def parse(value: Any, ctx: Ctx) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool) and ctx.lenient:
            value = str(value)
        if not isinstance(value, str):
            hint = number_hint if isinstance(value, float) else ""
            raise SettingError(ctx.path, Problem.TYPE, expected=expected, got=value, hint=hint)
        if len(value) > max_len:
            raise ctx.value_error(f"longer than {max_len} characters ({len(value)})")
        if non_empty and not value.strip():
            raise ctx.value_error(f"expected {expected}, got an empty string")
        if compiled is not None and not compiled.fullmatch(value):
            raise ctx.type_error(expected, value)
        return value

    schema: dict[str, Any] = {"type": "string", "maxLength": max_len}
    if pattern is not None:
        schema["pattern"] = _safe_pattern(pattern)
    elif non_empty:
        schema["pattern"] = r"\S"
    return Kind(name, expected, metavar, schema, parse)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def boolean() -> Kind:
    """``true``/``false``; from text also ``yes``/``no``, ``on``/``off``, ``1``/``0``."""

    def parse(value: Any, ctx: Ctx) -> bool:
        if isinstance(value, bool):
            return value
        if ctx.lenient and isinstance(value, str | int):
            word = str(value).strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
        raise ctx.type_error("true or false", value)

    text_schema = {"anyOf": [{"type": "boolean"}, {"enum": [*_TRUE, *_FALSE]}]}
    return Kind(
        "boolean",
        "true or false",
        "BOOL",
        {"type": "boolean"},
        parse,
        show=lambda v: "" if v is None else "true" if v else "false",
        text_schema=text_schema,
    )


def _range(schema: dict[str, Any], low: float | None, high: float | None) -> dict[str, Any]:
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


def _range_error(ctx: Ctx, value: Any, low: Any, high: Any, show: Callable[[Any], str]) -> SettingError:
    if low is not None and high is not None:
        bound = f"between {show(low)} and {show(high)}"
    elif low is not None:
        bound = f"at least {show(low)}"
    else:
        bound = f"at most {show(high)}"
    return ctx.value_error(f"must be {bound}, got {show(value)}")


def integer(low: int | None = None, high: int | None = None, *, metavar: str = "N") -> Kind:
    expected = "an integer"

    def parse(value: Any, ctx: Ctx) -> int:
        if ctx.lenient and isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ctx.type_error(expected, value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _range_error(ctx, value, low, high, str)
        return value

    schema = _range({"type": "integer"}, low, high)
    return Kind("integer", expected, metavar, schema, parse, text_schema={"pattern": r"^[0-9]{1,18}$"})


def number(low: float | None = None, high: float | None = None, *, metavar: str = "X") -> Kind:
    expected = "a number"

    def parse(value: Any, ctx: Ctx) -> float:
        if ctx.lenient and isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}(\.[0-9]{1,18})?", value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ctx.type_error(expected, value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _range_error(ctx, value, low, high, lambda v: f"{v:g}")
        return float(value)

    return Kind(
        "number", expected, metavar, _range({"type": "number"}, low, high), parse, show=lambda v: f"{v:g}"
    )


# The same grammar as protocol.units, for JSON Schema (a test checks the two agree).
_TERMS = r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h|d))+"
_DURATION_BODY = r"[0-9]{1,18}|" + _TERMS
_SECONDS_BODY = r"[0-9]{1,18}(?:\.[0-9]{0,18})?|\.[0-9]{1,18}|" + _TERMS


def duration(
    low: str | None = None,
    high: str | None = None,
    *,
    seconds: bool = False,
    positive: bool = False,
) -> Kind:
    """A Go-syntax duration (``1h30m``; a bare whole number is seconds).

    The value is a :class:`datetime.timedelta`, or with ``seconds`` a float number of seconds and
    bare decimal numbers are accepted too (for keys named ``..._s``). ``low`` and ``high`` are
    durations written the same way; ``positive`` refuses zero.
    """
    low_ns = parse_duration_ns(low) if low is not None else None
    high_ns = parse_duration_ns(high) if high is not None else None
    expected = "a duration like 300ms, 30s, 1h30m or 2h45m10s" + (" (or seconds)" if seconds else "")

    def to_ns(value: Any, ctx: Ctx) -> int:
        if isinstance(value, bool):
            raise ctx.type_error(expected, value)
        if isinstance(value, int):
            if value < 0:
                raise ctx.value_error(f"must not be negative, got {value}")
            return value * 10**9
        if isinstance(value, float):
            if value < 0:
                raise ctx.value_error(f"must not be negative, got {value:g}")
            if not (seconds or value.is_integer()):
                raise ctx.value_error(
                    f"{value:g} has no unit: write it with one, e.g. {value:g}s "
                    "(only a whole number of seconds may go without)"
                )
            return int(value * 10**9)
        if not isinstance(value, str):
            raise ctx.type_error(expected, value)
        try:
            return parse_duration_ns(value, fractional_seconds=seconds)
        except UnitError as exc:
            raise ctx.value_error(str(exc)) from None

    def show_ns(ns: int | None) -> str:
        return "" if ns is None else format_duration(ns)

    def parse(value: Any, ctx: Ctx) -> Any:
        ns = to_ns(value, ctx)
        if positive and ns == 0:
            raise ctx.value_error("must be positive, got 0s")
        if (low_ns is not None and ns < low_ns) or (high_ns is not None and ns > high_ns):
            raise _range_error(ctx, ns, low_ns, high_ns, show_ns)
        return ns / 10**9 if seconds else dt.timedelta(microseconds=ns // 1000)

    def show(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, dt.timedelta):
            return format_duration((value // dt.timedelta(microseconds=1)) * 1000)
        return format_duration(round(float(value) * 10**9))

    body = _SECONDS_BODY if seconds else _DURATION_BODY
    schema: dict[str, Any] = {
        "anyOf": [
            {"type": "string", "maxLength": 64, "pattern": _safe_pattern(body)},
            {"type": "number" if seconds else "integer", "minimum": 0},
        ]
    }
    return Kind("duration", expected, "DURATION", schema, parse, show=show)


def size(low: int | None = None, high: int | None = None) -> Kind:
    """Bytes: a whole number, or one with a unit (``64KiB``, ``256MiB``, ``1GB``)."""
    expected = "an integer number of bytes or a size like 64KiB or 256MiB"

    def parse(value: Any, ctx: Ctx) -> int:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except UnitError as exc:
                raise ctx.value_error(str(exc)) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ctx.type_error(expected, value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _range_error(ctx, value, low, high, format_size)
        return value

    schema = {
        "anyOf": [
            _range({"type": "integer"}, low, high),
            {
                "type": "string",
                "maxLength": 64,
                "pattern": _safe_pattern(r"[0-9]{1,18}(?:B|kB|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?"),
            },
        ]
    }
    return Kind("size", expected, "SIZE", schema, parse, show=lambda v: "" if v is None else format_size(v))


def choice(*options: str) -> Kind:
    expected = "one of " + ", ".join(options)

    def parse(value: Any, ctx: Ctx) -> str:
        if not isinstance(value, str):
            raise ctx.type_error(expected, value)
        if value not in options:
            raise ctx.value_error(f"{quote_value(value)} is not one of {', '.join(options)}")
        return value

    return Kind(
        "choice", expected, "{" + ",".join(options) + "}", {"enum": list(options)}, parse, choices=options
    )


_ADDRESS = r"[A-Za-z0-9._\-]*|\[[0-9A-Fa-f:.]+\]"


def address(*, as_tuple: bool = True, default_host: str = "0.0.0.0") -> Kind:  # noqa: S104 - documented
    """``HOST:PORT``; with ``as_tuple`` the value is ``(host, port)`` (an empty host: ``default_host``,
    IPv6 brackets removed), else the text itself."""
    expected = "HOST:PORT (e.g. 10.0.0.5:8081)"

    def parse(value: Any, ctx: Ctx) -> Any:
        if not isinstance(value, str):
            raise ctx.type_error(expected, value)
        bounded_text(value, ctx)
        host, sep, port = value.rpartition(":")
        if not sep or not re.fullmatch(_ADDRESS, host):
            raise ctx.type_error(expected, value)
        if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
            raise ctx.value_error(f"port must be 0..65535, got {quote_value(port)}")
        if not as_tuple:
            return value
        return (host.strip("[]") or default_host, int(port))

    def show(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, tuple):
            host, port = value
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return str(value)

    schema = {"type": "string", "pattern": _safe_pattern(f"(?:{_ADDRESS}):[0-9]{{1,5}}")}
    return Kind("address", expected, "HOST:PORT", schema, parse, show=show)


def path(*, as_str: bool = False) -> Kind:
    """A file or folder; relative paths start at the configuration file's folder when there is one."""
    expected = "a path"

    def parse(value: Any, ctx: Ctx) -> Any:
        if not isinstance(value, str) or not value:
            raise ctx.type_error(expected, value)
        bounded_text(value, ctx)
        if "\0" in value:
            raise ctx.value_error("a path must not contain NUL")
        result = Path(value)
        if not result.is_absolute() and ctx.base_dir is not None:
            result = ctx.base_dir / result
        return str(result) if as_str else result

    return Kind("path", expected, "PATH", {"type": "string", "minLength": 1, "maxLength": MAX_TEXT}, parse)


def optional(kind: Kind, *, off: Sequence[str] = ()) -> Kind:
    """``kind``, or ``null`` (and any of the words in ``off``) for "none"."""
    words = tuple(off)

    def parse(value: Any, ctx: Ctx) -> Any:
        if value is None or (isinstance(value, str) and value in words):
            return None
        return kind.parse(value, ctx)

    expected = kind.expected + " or null" + "".join(f" or {w!r}" for w in words)
    schema = {"anyOf": [dict(kind.schema), {"type": "null"}, *([{"enum": list(words)}] if words else [])]}
    return Kind(kind.name, expected, kind.metavar, schema, parse, show=kind.show, choices=kind.choices)


def list_of(item: Kind, expected: str = "", *, max_items: int = 1024) -> Kind:
    """A list whose every item is ``item`` (the value is a tuple)."""
    what = expected or f"a list of {item.name}s"

    def parse(value: Any, ctx: Ctx) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise ctx.type_error(what, value)
        if len(value) > max_items:
            raise ctx.value_error(f"at most {max_items} items, got {len(value)}")
        return tuple(item.parse(v, ctx.at(i)) for i, v in enumerate(value))

    schema = {"type": "array", "items": dict(item.schema), "maxItems": max_items}
    return Kind(
        "list",
        what,
        item.metavar,
        schema,
        parse,
        show=lambda v: "" if v is None else ", ".join(item.show(x) for x in v) or "[]",
    )


def raw(
    expected: str, schema: Mapping[str, Any], types: type | tuple[type, ...] = dict, *, name: str = "mapping"
) -> Kind:
    """A value checked only for its Python type here (its owner validates it further)."""

    def parse(value: Any, ctx: Ctx) -> Any:
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise ctx.type_error(expected, value)
        if not isinstance(value, types):
            raise ctx.type_error(expected, value)
        return value

    return Kind(name, expected, "VALUE", schema, parse, show=lambda v: "")


def section(table: SectionTable, build: Callable[[dict[str, Any], Ctx], Any] | None = None) -> Kind:
    """A nested mapping validated by ``table``; ``build`` turns the values into an object."""

    def parse(value: Any, ctx: Ctx) -> Any:
        values = table.parse(value, ctx)
        return build(values, ctx) if build is not None else values

    return Kind("section", table.expected, "MAPPING", table.json_schema(), parse, show=lambda v: "")


def mapping_of(
    key_pattern: str, key_expected: str, value: Kind, *, min_items: int = 0, item: str = "entry"
) -> Kind:
    """A mapping from names (matching ``key_pattern`` whole) to ``value``s; ``item`` names one."""
    compiled = re.compile(key_pattern)
    expected = f"a mapping of {key_expected}s"

    def parse(doc: Any, ctx: Ctx) -> dict[str, Any]:
        if not isinstance(doc, Mapping):
            raise ctx.type_error(expected, doc)
        out: dict[str, Any] = {}
        for key, entry in doc.items():
            if not isinstance(key, str) or not compiled.fullmatch(key):
                raise ctx.value_error(f"{quote_value(key)} is not {key_expected}")
            out[key] = value.parse(entry, ctx.at(key))
        if len(out) < min_items:
            raise ctx.value_error(f"define at least {'one' if min_items == 1 else min_items} {item}")
        return out

    schema = {
        "type": "object",
        "propertyNames": {"pattern": _safe_pattern(key_pattern)},
        "additionalProperties": dict(value.schema),
        **({"minProperties": min_items} if min_items else {}),
    }
    return Kind("mapping", expected, "MAPPING", schema, parse, show=lambda v: "")
