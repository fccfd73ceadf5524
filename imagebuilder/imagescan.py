"""Does an image carry any of the build's credentials? A search of every allocated byte of the disk.

The boot test knows the credentials of the build it tests (it made them: the installer's webhook token)
and the addresses that only a build uses (the builder's webhook URL). :func:`scan_image` converts the
QCOW2 to a sparse raw file (``qemu-img convert -f qcow2``, the format named, never probed), reads only
its allocated extents (``SEEK_DATA``/``SEEK_HOLE``) and looks for each secret as plain bytes (without
regard to ASCII case) and base64-encoded in each of its three alignments. It reads raw blocks, not
files: a secret in a deleted file's blocks or in slack counts too. A hit inside the ext4 root is named by
its file (``debugfs icheck``/``ncheck``); one in the EFI system partition or outside the file systems by
where it is. A secret that was compressed (a ``.gz`` log, a compressed journal entry) is not found:
the seal's scrub list removes the files that hold the build's records (imagebuilder.seal.SCRUB).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.errors import CommandError, OutputError
from imagebuilder.run import run

log = logging.getLogger(__name__)

ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPES = {"0FC63DAF-8483-4772-8E79-3D69D8477DE4", "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"}
CHUNK = 16 << 20
MAX_HITS = 16  # per secret: enough to name the files
BLOCK = 4096


def encodings(secret: bytes) -> list[tuple[bytes, bool]]:
    """``(needle, case-insensitive)``: the secret itself, and the part of its base64 encoding that does not depend
    on the bytes around it, for each of the three positions it can start at within a 3-byte group."""
    out: list[tuple[bytes, bool]] = [(secret.lower(), True)]
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + secret)
        first = -(-shift // 3)  # the first 3-byte group made of the secret's bytes only
        last = (shift + len(secret)) // 3  # one past the last such group
        if last - first >= 4:
            out.append((encoded[4 * first : 4 * last], False))
    return out


@dataclass(frozen=True)
class _Part:
    start: int
    end: int
    kind: str  # esp | root | other


def _partitions(raw: Path) -> list[_Part]:
    try:
        table = json.loads(run(["sfdisk", "-J", str(raw)], timeout=120).stdout)["partitiontable"]
    except (ValueError, KeyError, CommandError):
        return []
    sector = int(table.get("sectorsize", 512))
    parts = []
    for p in table.get("partitions", []):
        ptype = str(p.get("type", "")).upper()
        kind = "esp" if ptype == ESP_TYPE else "root" if ptype in LINUX_TYPES else "other"
        start = int(p["start"]) * sector
        parts.append(_Part(start, start + int(p["size"]) * sector, kind))
    return parts


def _search(raw: Path, needles: Mapping[str, list[tuple[bytes, bool]]]) -> dict[str, list[int]]:
    hits: dict[str, list[int]] = {}
    keep = max((len(n) for variants in needles.values() for n, _ in variants), default=1) - 1
    fd = os.open(raw, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # no data after pos
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            offset = start
            tail = b""
            while offset < end:
                chunk = os.pread(fd, min(CHUNK, end - offset), offset)
                if not chunk:
                    break
                data = tail + chunk
                base = offset - len(tail)
                lowered = data.lower()
                for label, variants in needles.items():
                    found = hits.setdefault(label, [])
                    for needle, nocase in variants:
                        haystack = lowered if nocase else data
                        at = haystack.find(needle)
                        while at >= 0 and len(found) < MAX_HITS:
                            if base + at not in found:
                                found.append(base + at)
                            at = haystack.find(needle, at + 1)
                tail = data[-keep:] if keep else b""
                offset += len(chunk)
            pos = end
    finally:
        os.close(fd)
    return {label: sorted(offsets) for label, offsets in hits.items() if offsets}


def _name(raw: Path, parts: list[_Part], offsets: list[int]) -> list[str]:
    """Where each offset lies: a file of the root file system, the ESP, or a byte of the disk."""
    names: list[str] = []
    by_root: dict[int, list[int]] = {}
    for offset in offsets:
        part = next((p for p in parts if p.start <= offset < p.end), None)
        if part is None or part.kind == "other":
            names.append(f"byte {offset} of the disk (outside the file systems)")
        elif part.kind == "esp":
            names.append("the EFI system partition")
        else:
            by_root.setdefault(part.start, []).append((offset - part.start) // BLOCK)
    for start, blocks in by_root.items():
        device = f"{raw}?offset={start}"
        inodes: dict[int, str] = {}
        icheck = run(
            ["debugfs", "-R", "icheck " + " ".join(map(str, blocks)), device], check=False, timeout=300
        )
        for line in icheck.text.splitlines()[1:]:
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit():
                inodes[int(fields[0])] = fields[1]
        numbers = sorted({i for i in inodes.values() if i.isdigit()})
        paths: dict[str, str] = {}
        if numbers:
            ncheck = run(["debugfs", "-R", "ncheck " + " ".join(numbers), device], check=False, timeout=300)
            for line in ncheck.text.splitlines()[1:]:
                number, _, path = line.strip().partition("\t")
                if number.isdigit() and path:
                    paths.setdefault(number, path)
        for block in blocks:
            inode = inodes.get(block, "")
            names.append(paths.get(inode) or f"a block of the root file system not in any file ({block})")
    return sorted(set(names))


def scan_image(qcow2: Path, work: Path, secrets: Mapping[str, bytes]) -> dict[str, list[str]]:
    """``{label: [where]}`` for each secret ``qcow2`` holds (plain or base64); ``{}`` when none. ``secrets`` maps a
    label (printed) to the secret (never printed)."""
    needles = {label: encodings(secret) for label, secret in secrets.items() if secret}
    if not needles:
        return {}
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "credential-scan.raw"
    try:
        run(["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(qcow2), str(raw)], timeout=1800,
            hint="qemu-img could not read the image")  # fmt: skip
        hits = _search(raw, needles)
        if not hits:
            return {}
        parts = _partitions(raw)
        return {label: _name(raw, parts, offsets) for label, offsets in hits.items()}
    except OSError as exc:
        raise OutputError(f"cannot read {qcow2} for the credential search: {exc}") from exc
    finally:
        raw.unlink(missing_ok=True)
