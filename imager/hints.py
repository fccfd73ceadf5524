"""Root-device hints: which disk the image goes to, by stable identity (after Ironic's root device hints).

=============  ====================================================================================
hint           matches
=============  ====================================================================================
``serial``     the disk's serial number (udev ``ID_SERIAL_SHORT``, sysfs ``serial``), exactly
``wwn``        the World Wide Name (udev ``ID_WWN_WITH_EXTENSION``/``ID_WWN``, sysfs ``wwid``),
               case-insensitive, with or without ``0x``
``model``      the model, case-insensitive, ``_`` and space alike, ``*`` and ``?`` as wildcards
``vendor``     the vendor, like ``model``
``size``       the size: ``MIN-MAX``, ``MIN-`` or ``-MAX`` (``800GB-1TB``, ``100GiB-``), or one
               size (``960GB``), which matches a disk of that size to within 1 %
``by_path``    the ``/dev/disk/by-path/`` name (with or without that prefix), exactly
``rotational`` ``true`` (spinning) or ``false`` (solid state)
=============  ====================================================================================

Every hint given must match (they are ANDed). Kernel names (``nvme0n1``) are not a hint: they
change between boots on multi-disk servers.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from imager.errors import ImagerError, Reason
from imager.inventory import Disk
from protocol.units import UnitError, format_size, parse_size

HINT_KEYS = ("serial", "wwn", "model", "vendor", "size", "by_path", "rotational")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
BY_PATH_PREFIX = "/dev/disk/by-path/"


@dataclass(frozen=True)
class SizeRange:
    low: int
    high: int | None

    def __contains__(self, size: object) -> bool:
        return isinstance(size, int) and size >= self.low and (self.high is None or size <= self.high)

    def __str__(self) -> str:
        high = format_size(self.high) if self.high is not None else ""
        return f"{format_size(self.low)}-{high}"


@dataclass(frozen=True)
class Hints:
    """Parsed hints; an empty one means "no hint" (the release's no-hint policy decides)."""

    values: Mapping[str, str]
    size: SizeRange | None = None
    rotational: bool | None = None

    def __bool__(self) -> bool:
        return bool(self.values)

    def describe(self) -> str:
        return " ".join(f"{key}={value}" for key, value in sorted(self.values.items())) or "(none)"


def _size_range(text: str) -> SizeRange:
    try:
        if "-" in text:
            low, _, high = text.partition("-")
            if not low and not high:
                raise UnitError("a range needs at least one end")
            range_ = SizeRange(parse_size(low) if low else 0, parse_size(high) if high else None)
            if range_.high is not None and range_.high < range_.low:
                raise UnitError(f"{high} is smaller than {low}")
            return range_
        exact = parse_size(text)
    except UnitError as exc:
        raise ImagerError(
            Reason.usage,
            f"disk hint size={text!r}: {exc}",
            hint="write one size (960GB) or a range (800GB-1TB, 100GiB-, -2TiB)",
        ) from None
    return SizeRange(exact - exact // 100, exact + exact // 100)


def parse_hints(values: Mapping[str, str]) -> Hints:
    """Check hint names and values; ImagerError(usage) names a bad one."""
    clean: dict[str, str] = {}
    for key, value in values.items():
        if key not in HINT_KEYS:
            raise ImagerError(
                Reason.usage,
                f"unknown disk hint {key!r}",
                hint=f"known hints: {', '.join(HINT_KEYS)} (docs/bare-metal.md, 'Choosing the disk')",
            )
        if not value.strip():
            raise ImagerError(Reason.usage, f"disk hint {key} is empty", hint=f"give a value: {key}=...")
        clean[key] = value.strip()
    rotational: bool | None = None
    if "rotational" in clean:
        text = clean["rotational"].lower()
        if text not in _TRUE | _FALSE:
            raise ImagerError(
                Reason.usage, f"disk hint rotational={clean['rotational']!r} is not true or false"
            )
        rotational = text in _TRUE
    size = _size_range(clean["size"]) if "size" in clean else None
    return Hints(clean, size, rotational)


def merge(release: Mapping[str, str], machine: Mapping[str, str]) -> dict[str, str]:
    """The release's hints (a class of machine) and the boot parameters' (this machine): a hint in
    both must agree, or the two describe different disks and nothing could match."""
    merged = dict(release)
    for key, value in machine.items():
        if key in merged and merged[key] != value:
            raise ImagerError(
                Reason.no_match,
                f"disk hint {key}: the release says {merged[key]!r}, the boot parameters say {value!r}",
                hint="remove one of the two, or make them agree",
            )
        merged[key] = value
    return merged


def _text_key(value: str) -> str:
    return " ".join(value.replace("_", " ").split()).lower()


def mismatches(hints: Hints, disk: Disk) -> list[str]:
    """Why ``disk`` does not match ``hints``: one sentence per hint that fails (empty: it matches)."""
    why: list[str] = []
    for key, wanted in sorted(hints.values.items()):
        if key == "serial":
            if disk.serial != wanted:
                why.append(f"serial is {disk.serial or 'unknown'}, not {wanted}")
        elif key == "wwn":
            have = disk.wwn.lower().removeprefix("0x")
            if not have or have != wanted.lower().removeprefix("0x"):
                why.append(f"wwn is {disk.wwn or 'unknown'}, not {wanted}")
        elif key in ("model", "vendor"):
            have = getattr(disk, key)
            if not have or not fnmatch.fnmatchcase(_text_key(have), _text_key(wanted)):
                why.append(f"{key} is {have or 'unknown'!r}, not {wanted!r}")
        elif key == "size":
            if hints.size is not None and disk.size not in hints.size:
                why.append(f"size is {format_size(disk.size)}, outside {hints.size}")
        elif key == "by_path":
            want = wanted.removeprefix(BY_PATH_PREFIX)
            if disk.by_path != want:
                why.append(f"by-path is {disk.by_path or 'unknown'}, not {want}")
        elif key == "rotational" and disk.rotational != hints.rotational:
            why.append(f"rotational is {str(disk.rotational).lower()}, not {str(hints.rotational).lower()}")
    return why
