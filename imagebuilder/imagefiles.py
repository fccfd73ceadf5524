"""Reading files out of a built image offline: its EFI system partition and its root file system.

:class:`ImageFiles` converts the QCOW2 to a sparse raw file (``qemu-img convert -f qcow2``, never
probing the format), finds the partitions in its GPT (``sfdisk -J``): the ESP by its type GUID, the
root file system as the largest Linux one; it reads ESP files with mtools (``mcopy -i raw@@offset``)
and root files with ``debugfs`` (no loop devices, no mounts, nothing written). Every read is
bounded, and every command goes through the builder's chokepoint (:mod:`imagebuilder.run`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from imagebuilder.errors import CommandError, OutputError
from imagebuilder.run import run

log = logging.getLogger(__name__)

ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPES = {"0FC63DAF-8483-4772-8E79-3D69D8477DE4", "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"}
MAX_FILE_BYTES = 512 * 1024 * 1024
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+-]{1,255}")


class ImageFiles:
    """The files of ``qcow2``; ``work`` holds the raw copy (removed by :meth:`close`)."""

    def __init__(self, qcow2: Path, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.raw = work / "image-files.raw"
        run(["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(qcow2), str(self.raw)],
            hint="qemu-img could not read the image", timeout=1800)  # fmt: skip
        try:
            table = json.loads(run(["sfdisk", "-J", str(self.raw)]).stdout)["partitiontable"]
        except (ValueError, KeyError, CommandError) as exc:
            raise OutputError(f"{qcow2.name}: no readable partition table: {exc}") from exc
        sector = int(table.get("sectorsize", 512))
        parts = table.get("partitions", [])
        esp = [p for p in parts if str(p.get("type", "")).upper() == ESP_TYPE]
        linux = [p for p in parts if str(p.get("type", "")).upper() in LINUX_TYPES]
        if len(esp) != 1 or not linux:
            raise OutputError(
                f"{qcow2.name}: expected one EFI system partition and a Linux root partition in its GPT",
                hint="the image must boot with UEFI from a GPT disk (the installer's direct layout)",
            )
        root = max(linux, key=lambda p: int(p["size"]))
        self.esp_offset = int(esp[0]["start"]) * sector
        self.root_device = f"{self.raw}?offset={int(root['start']) * sector}"

    def close(self) -> None:
        self.raw.unlink(missing_ok=True)

    def __enter__(self) -> ImageFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def esp(self, path: str) -> bytes:
        """A file of the ESP, e.g. ``EFI/BOOT/BOOTX64.EFI``."""
        if not _SAFE_PATH.fullmatch("/" + path.lstrip("/")):
            raise OutputError(f"{path!r} is not a plain ESP path")
        result = run(["mcopy", "-n", "-i", f"{self.raw}@@{self.esp_offset}", "::/" + path.lstrip("/"), "-"],
                     check=False, timeout=120)  # fmt: skip
        if result.returncode != 0:
            raise OutputError(
                f"the image's ESP has no {path}: {result.stderr.decode(errors='replace')[:200]}"
            )
        return _bounded(result.stdout, path)

    def root(self, path: str) -> bytes:
        """A regular file of the root file system (symbolic links are not followed: name the file)."""
        if not _SAFE_PATH.fullmatch(path):
            raise OutputError(f"{path!r} is not a plain absolute path")
        stat = run(["debugfs", "-R", f"stat {path}", self.root_device], check=False, timeout=120)
        text = stat.stdout.decode(errors="replace")
        if stat.returncode != 0 or "Type: regular" not in text:
            raise OutputError(f"the image's root file system has no regular file {path}")
        return _bounded(run(["debugfs", "-R", f"cat {path}", self.root_device], timeout=300).stdout, path)


def _bounded(data: bytes, path: str) -> bytes:
    if len(data) > MAX_FILE_BYTES:
        raise OutputError(f"{path} is larger than {MAX_FILE_BYTES} bytes: not a boot file")
    return data
