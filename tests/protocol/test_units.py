"""Go-syntax durations and byte sizes: what is accepted, what is refused, and the round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.units import (
    MAX_DURATION_NS,
    UnitError,
    format_duration,
    format_size,
    parse_duration_ns,
    parse_size,
)

S = 10**9


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        # what Go's time.ParseDuration returns for each
        ("300ms", 300 * 10**6),
        ("1.5h", 5400 * S),
        ("1h30m", 5400 * S),
        ("2h45m10s", 9910 * S),
        ("0", 0),
        ("0s", 0),
        (".5s", S // 2),
        ("1.s", S),
        ("1us", 1000),
        ("1\u00b5s", 1000),
        ("1\u03bcs", 1000),
        ("10ns", 10),
        ("1m0.5s", 60 * S + S // 2),
        ("100h", 360000 * S),
        ("2562047h", 2562047 * 3600 * S),  # the longest whole hours Go accepts
        # our two documented extensions
        ("90", 90 * S),  # a bare whole number is seconds
        ("7d", 7 * 86400 * S),  # d is 24 hours
    ],
)
def test_accepted(text: str, ns: int) -> None:
    assert parse_duration_ns(text) == ns


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("-5s", "no sign"),
        ("+5s", "no sign"),
        ("1.5", "has no unit"),  # seconds or minutes?
        ("1h 30m", "no spaces"),
        ("30s\n", "no spaces"),
        (" 30s", "no spaces"),
        ("5x", "units ns, us"),
        ("h", "units ns, us"),
        (".s", "units ns, us"),
        ("1H", "units ns, us"),
        ("9" * 65 + "s", "characters"),
        ("2562048h", "longest duration"),  # Go: 2562047h47m16.854775807s at most
    ],
)
def test_refused(text: str, why: str) -> None:
    with pytest.raises(UnitError, match=why) as err:
        parse_duration_ns(text)
    assert str(err.value).startswith("expected a duration like 300ms, 30s, 1h30m")


def test_fractional_seconds_only_when_asked() -> None:
    assert parse_duration_ns("0.2", fractional_seconds=True) == S // 5
    assert parse_duration_ns("1500", fractional_seconds=True) == 1500 * S
    with pytest.raises(UnitError, match="or a number of seconds"):
        parse_duration_ns("soon", fractional_seconds=True)


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (300 * 10**6, "300ms"),
        (1500 * 10**6, "1.5s"),
        (5400 * S, "1h30m"),
        (9910 * S, "2h45m10s"),
        (3600 * S, "1h"),
        (43800 * 3600 * S, "43800h"),
        (1000, "1us"),
        (1, "1ns"),
        (1500, "1.5us"),
    ],
)
def test_format_is_the_shortest_go_form(ns: int, text: str) -> None:
    assert format_duration(ns) == text
    assert parse_duration_ns(text) == ns


@given(st.integers(min_value=0, max_value=MAX_DURATION_NS))
def test_format_then_parse_is_the_identity(ns: int) -> None:
    assert parse_duration_ns(format_duration(ns)) == ns


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("65536", 65536),
        ("64KiB", 65536),
        ("256MiB", 256 << 20),
        ("1GB", 10**9),
        ("2TiB", 2 << 40),
        ("7B", 7),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["64k", "1.5GiB", "-1", "", "64 KiB", "64KiB\n", "1" * 70])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(UnitError, match="expected an integer number of bytes or a size like 64KiB"):
        parse_size(text)


@given(st.integers(min_value=0, max_value=2**50))
def test_size_round_trip(size: int) -> None:
    assert parse_size(format_size(size)) == size
