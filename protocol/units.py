"""Durations and byte sizes as people write them in configuration, parsed exactly and bounded.

Durations use Go's syntax (``time.ParseDuration``, what SPIRE and kubeadm write): one or more
terms of a decimal number and a unit, without spaces, largest first by convention::

    300ms   1.5h   1h30m   2h45m10s   90s   0

Units: ``ns``, ``us`` (or ``µs``), ``ms``, ``s``, ``m``, ``h``. Two extensions, both documented
in docs/settings.md: a bare whole number is seconds (``90``: what the older configuration files
wrote), and ``d`` is 24 hours (``7d``; Go and SPIRE refuse it, so write ``168h`` to be portable).
A sign, spaces, an empty string and a bare number with a fraction (``1.5``: seconds or minutes?)
are refused, unless the caller asks for fractional seconds (keys whose name ends in ``_s``).
:func:`format_duration` writes the shortest Go form (``1h30m``, ``300ms``), which
:func:`parse_duration_ns` reads back to the same value.

Byte sizes are a whole number of bytes, or a whole number and a unit: ``KiB``, ``MiB``, ``GiB``,
``TiB`` (powers of 1024) or ``kB``, ``MB``, ``GB``, ``TB`` (powers of 1000): ``256MiB``.

Every parser bounds its input's length before looking at it and raises :class:`UnitError`
(a ``ValueError``) with a sentence that says what was wrong.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = [
    "MAX_DURATION_NS",
    "UnitError",
    "format_duration",
    "format_size",
    "parse_duration_ns",
    "parse_size",
]

MAX_TEXT = 64  # no duration or size is longer; longer input is refused before parsing
MAX_DURATION_NS = 2**63 - 1  # Go's time.Duration limit, about 292 years
_SECOND = 10**9
_DURATION_UNITS = {
    "ns": 1,
    "us": 10**3,
    "\u00b5s": 10**3,  # micro sign
    "\u03bcs": 10**3,  # Greek small letter mu
    "ms": 10**6,
    "s": _SECOND,
    "m": 60 * _SECOND,
    "h": 3600 * _SECOND,
    "d": 86400 * _SECOND,  # extension: not Go syntax
}
_TERM = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h|d)")
_WHOLE = re.compile(r"[0-9]{1,18}")
_DECIMAL = re.compile(r"[0-9]{1,18}(?:\.[0-9]{0,18})?|\.[0-9]{1,18}")
_SIZE_UNITS = {
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
_SIZE = re.compile(r"([0-9]{1,18})(B|kB|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")
_EXAMPLE = "a duration like 300ms, 30s, 1h30m or 2h45m10s"


class UnitError(ValueError):
    """Text that is not a duration or size (the message says why)."""


def parse_duration_ns(text: str, *, fractional_seconds: bool = False) -> int:
    """Nanoseconds of a Go-style duration; a bare whole number is seconds.

    ``fractional_seconds`` also accepts a bare decimal number of seconds (``0.2``), for keys
    whose name says the unit (``retry_initial_s``).
    """
    expected = "expected " + _EXAMPLE + (", or a number of seconds" if fractional_seconds else "")
    if len(text) > MAX_TEXT:
        raise UnitError(f"{expected}, got {len(text)} characters")
    if not text:
        raise UnitError(f"{expected}, got an empty string")
    if text[0] in "+-":
        raise UnitError(f"{expected}, got {text!r}: a duration is positive (or zero) and has no sign")
    if _WHOLE.fullmatch(text):
        return _bounded(Fraction(int(text)) * _SECOND, text)
    if _DECIMAL.fullmatch(text):
        if fractional_seconds:
            return _bounded(Fraction(Decimal(text)) * _SECOND, text)
        raise UnitError(
            f"{expected}, got {text!r}, which has no unit: write {text}s or {text}m "
            "(only a whole number of seconds may go without)"
        )
    total = Fraction(0)
    pos = 0
    while pos < len(text):
        term = _TERM.match(text, pos)
        if term is None:
            raise UnitError(f"{expected} (units ns, us, ms, s, m, h and d; no spaces), got {text!r}")
        total += Fraction(Decimal(term.group(1))) * _DURATION_UNITS[term.group(2)]
        pos = term.end()
    return _bounded(total, text)


def _bounded(total: Fraction, text: str) -> int:
    ns = int(total)  # Go truncates below a nanosecond too
    if ns > MAX_DURATION_NS:
        raise UnitError(
            f"expected {_EXAMPLE}, got {text!r}: longer than the longest duration (about 292 years)"
        )
    return ns


def format_duration(ns: int) -> str:
    """The shortest Go-syntax form: ``1h30m``, ``2h45m10s``, ``1.5s``, ``300ms``, ``0s``."""
    if ns < 0:
        raise UnitError("a duration must not be negative")
    if ns == 0:
        return "0s"
    if ns < _SECOND:
        for unit, size in (("ms", 10**6), ("us", 10**3), ("ns", 1)):
            if ns >= size:
                return _decimal(Fraction(ns, size)) + unit
    hours, rest = divmod(ns, 3600 * _SECOND)
    minutes, rest = divmod(rest, 60 * _SECOND)
    out = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    if rest:
        out += _decimal(Fraction(rest, _SECOND)) + "s"
    return out


def _decimal(value: Fraction) -> str:
    try:
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    except InvalidOperation:  # pragma: no cover - Decimal handles every Fraction of ints
        text = str(float(value))
    return text.rstrip("0").rstrip(".") if "." in text else text


def parse_size(text: str) -> int:
    """Bytes of ``65536``, ``64KiB``, ``256MiB``, ``1GB``."""
    expected = "expected an integer number of bytes or a size like 64KiB or 256MiB"
    if len(text) > MAX_TEXT:
        raise UnitError(f"{expected}, got {len(text)} characters")
    if _WHOLE.fullmatch(text):
        return int(text)
    match = _SIZE.fullmatch(text)
    if match is None:
        raise UnitError(f"{expected} (units KiB, MiB, GiB, TiB, kB, MB, GB, TB), got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def format_size(size: int) -> str:
    """``256MiB`` when a binary unit divides the size exactly, else the number of bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        step = _SIZE_UNITS[unit]
        if size and size % step == 0:
            return f"{size // step}{unit}"
    return str(size)
