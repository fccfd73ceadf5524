"""Choosing the target disk: exactly one match, or a refusal that lists every disk and why.

Never a target, whatever the hints say (each with its token in the refusal):

* ``loop``, ``ram``, ``zram``, ``device-mapper``, ``md``, ``optical``, ``nbd``: not a physical disk;
* ``removable`` (USB sticks, SD cards, virtual media), ``read-only``, ``empty`` (size 0),
  ``sector-size`` (logical sectors other than 512 bytes: the images' GPT is laid out in 512-byte LBAs);
* ``boot-medium``: an ISO 9660 or UDF file system on the disk (the virtual medium the imager may have
  booted from);
* ``multipath-member``, ``raid-member`` (``linux_raid_member``, ``isw_raid_member``,
  ``ddf_raid_member``, ...), ``in-use`` (held by a device-mapper or md device: LVM, dm-crypt,
  multipath, RAID);
* ``mounted``: a file system of the disk or of one of its partitions is mounted, or it is swap;
* ``too-small``: smaller than the image's virtual disk.

Then the hints decide (:mod:`imager.hints`). Without hints the release's policy decides:
``refuse`` (the default: the refusal lists the eligible disks with their serials and WWNs, to copy
into a hint) or ``smallest`` (Ironic's rule: the smallest eligible disk of at least 4 GiB; two
disks of that same size are ambiguous and refused, because kernel names are not stable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from imager.errors import ImagerError, Reason
from imager.hints import Hints, mismatches
from imager.inventory import Disk

SMALLEST_MIN = 4 << 30
RAID_MEMBER_TYPES = frozenset(
    {
        "linux_raid_member",
        "isw_raid_member",
        "ddf_raid_member",
        "adaptec_raid_member",
        "hpt37x_raid_member",
        "hpt45x_raid_member",
        "jmicron_raid_member",
        "lsi_mega_raid_member",
        "nvidia_raid_member",
        "promise_fasttrack_raid_member",
        "silicon_medley_raid_member",
        "via_raid_member",
    }
)
MEDIUM_TYPES = frozenset({"iso9660", "udf"})


@dataclass(frozen=True)
class Verdict:
    disk: Disk
    excluded: tuple[tuple[str, str], ...]  # (token, sentence): never a target
    unmatched: tuple[str, ...]  # why the hints do not match

    @property
    def eligible(self) -> bool:
        return not self.excluded

    def as_json(self) -> dict[str, Any]:
        return {
            **self.disk.identity(),
            "excluded": [{"reason": token, "detail": text} for token, text in self.excluded],
            "unmatched": list(self.unmatched),
        }

    def line(self) -> str:
        if self.excluded:
            why = "; ".join(text for _, text in self.excluded)
            return f"  {self.disk.describe()}: excluded: {why}"
        if self.unmatched:
            return f"  {self.disk.describe()}: does not match: {'; '.join(self.unmatched)}"
        return f"  {self.disk.describe()}: matches"


def exclusions(disk: Disk, *, min_size: int = 0) -> list[tuple[str, str]]:
    """Why ``disk`` may never be written (empty: it may be)."""
    out: list[tuple[str, str]] = []
    if disk.kind != "disk":
        out.append((disk.kind, f"a {disk.kind} device, not a physical disk"))
    if disk.removable:
        out.append(("removable", "removable media"))
    if disk.read_only:
        out.append(("read-only", "read-only"))
    if disk.size == 0:
        out.append(("empty", "size 0 (no medium)"))
    if disk.logical_block_size != 512:
        out.append(
            ("sector-size", f"{disk.logical_block_size}-byte logical sectors (the image's GPT uses 512)")
        )
    types = {disk.fs_type, *(p.fs_type for p in disk.partitions)} - {""}
    if types & MEDIUM_TYPES:
        out.append(
            ("boot-medium", f"holds an {'/'.join(sorted(types & MEDIUM_TYPES))} file system (a boot medium)")
        )
    if disk.multipath_member:
        out.append(("multipath-member", "a multipath member"))
    if types & RAID_MEMBER_TYPES:
        out.append(("raid-member", f"a RAID member ({', '.join(sorted(types & RAID_MEMBER_TYPES))})"))
    if disk.holders:
        out.append(("in-use", f"held by {', '.join(disk.holders)} (LVM, dm-crypt, multipath or RAID)"))
    if disk.mounts:
        out.append(("mounted", f"mounted on {', '.join(disk.mounts)}"))
    if min_size and 0 < disk.size < min_size:
        out.append(("too-small", f"smaller than the image's {min_size}-byte disk"))
    return out


def judge(disks: Sequence[Disk], hints: Hints, *, min_size: int = 0) -> list[Verdict]:
    return [
        Verdict(
            disk, tuple(exclusions(disk, min_size=min_size)), tuple(mismatches(hints, disk) if hints else ())
        )
        for disk in disks
    ]


def _refusal(reason: Reason, headline: str, verdicts: Sequence[Verdict], hint: str) -> ImagerError:
    lines = "\n".join(v.line() for v in verdicts) or "  (no block devices at all)"
    return ImagerError(
        reason,
        f"{headline}:\n{lines}",
        hint=hint,
        details={"candidates": [v.as_json() for v in verdicts]},
    )


def choose(
    disks: Sequence[Disk], hints: Hints, *, policy: str = "refuse", min_size: int = 0
) -> tuple[Disk, list[Verdict]]:
    """The one disk to write, and the verdict on every disk; ImagerError (``no-hint``, ``no-match``,
    ``ambiguous``) listing every disk and why otherwise."""
    verdicts = judge(disks, hints, min_size=min_size)
    eligible = [v for v in verdicts if v.eligible]
    if hints:
        matching = [v for v in eligible if not v.unmatched]
        if len(matching) == 1:
            return matching[0].disk, verdicts
        if not matching:
            raise _refusal(
                Reason.no_match,
                f"no eligible disk matches the hints {hints.describe()}",
                verdicts,
                "fix the hints (nodeimager.serial=, wwn=, ...) to name the disk; the list shows what each disk is",
            )
        raise _refusal(
            Reason.ambiguous,
            f"{len(matching)} disks match the hints {hints.describe()}; exactly one must",
            verdicts,
            "add a hint that tells them apart (serial or wwn)",
        )
    if policy == "smallest":
        sized = [v for v in eligible if v.disk.size >= SMALLEST_MIN]
        if sized:
            smallest = min(v.disk.size for v in sized)
            tied = [v for v in sized if v.disk.size == smallest]
            if len(tied) == 1:
                return tied[0].disk, verdicts
            raise _refusal(
                Reason.ambiguous,
                f"no disk hint, and {len(tied)} eligible disks share the smallest size ({smallest} bytes)",
                verdicts,
                "give a hint (nodeimager.serial= or wwn=): kernel names cannot tell identical disks apart",
            )
        raise _refusal(
            Reason.no_match,
            "no disk hint, and no eligible disk of at least 4 GiB",
            verdicts,
            "attach a disk, or free one (unmount it, stop the RAID or LVM that holds it)",
        )
    raise _refusal(
        Reason.no_hint,
        "no disk hint, and the release's policy is to refuse rather than guess",
        verdicts,
        "boot with a hint that names the disk, e.g. nodeimager.serial=<serial> (copy it from the list)",
    )
