"""What makes two builds of one lock the same build: its identifiers and its time, derived from the lock.

A build of a definition and its lock gets everything that would otherwise be random or the wall
clock from the lock itself (docs/reproducible.md):

* **time**: ``SOURCE_DATE_EPOCH`` is the lock's ``created_at`` (the moment its inputs were resolved),
  so it is the same for every build of that lock, on any machine, on any day; the sealed image's
  time stamps, the SBOM's creation time and the build id's time part are this instant;
* **identifiers**: the GPT disk and partition GUIDs, the root file system's UUID and directory hash
  seed and the EFI system partition's volume ID are name-based (RFC 4122 version 5) UUIDs of the lock's
  SHA-256 and the identifier's role, under this project's namespace; the SBOM's namespace too;
* **the build id**: ``<name>-<SOURCE_DATE_EPOCH as YYYYMMDDTHHMMSSZ>-<first 6 hex of the lock digest>``:
  a build id names its inputs, so two builds of one lock publish the same folder name.

Nothing here reads a clock, a random source or the environment: the same lock gives the same values
on every machine (tests/imagebuilder/test_reproducible.py pins them).
"""

from __future__ import annotations

import calendar
import hashlib
import re
import time
import uuid
from dataclasses import dataclass

from imagebuilder.errors import LockError

#: The project's UUID namespace for everything derived from a lock (itself a name-based UUID).
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://nodetrust.dev/imagebuilder/reproducible/v1")
_CREATED = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: 1980-01-01: the earliest time a FAT directory entry holds (the ESP's files get no earlier one).
EARLIEST = 315532800


def source_date_epoch(created_at: str) -> int:
    """The lock's ``created_at`` (``YYYY-MM-DDThh:mm:ssZ``) as seconds since the epoch."""
    match = _CREATED.fullmatch(created_at)
    if match is None:
        raise LockError(
            f"the lock's created_at {created_at!r} is not YYYY-MM-DDThh:mm:ssZ: no SOURCE_DATE_EPOCH",
            hint="run `imagebuilder lock` again (the lock's schema requires this form)",
        )
    try:
        seconds = calendar.timegm(time.strptime(created_at, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError as exc:
        raise LockError(f"the lock's created_at {created_at!r} is not a valid time: {exc}") from None
    if seconds < EARLIEST:
        raise LockError(
            f"the lock's created_at {created_at!r} is before 1980: the EFI system partition cannot hold it"
        )
    return seconds


@dataclass(frozen=True)
class TimeClamp:
    """The image's time stamp for a file of the provisioned tree: ``epoch`` (``SOURCE_DATE_EPOCH``) for every
    time at or after ``since``, the file's own time before it.

    ``since`` is the earlier of ``epoch`` and the moment the installed base's installer VM started. A base
    installed after the lock was made (every cold build) gives ``since == epoch``: the usual clamp. A base
    cached by an earlier build may be older than the lock (its key does not hold the lock's time: a new lock
    of the same OS packages reuses it); its installer wrote files with the times of that run, before
    ``epoch``, which a clamp alone keeps and a cold rebuild of the same lock (installed after ``epoch``)
    does not. Everything written since its installer started is a product of that run, so it gets
    ``epoch`` too; what is older came from the installer ISO or a package and is the same in every run.
    """

    epoch: int
    since: int

    def __post_init__(self) -> None:
        if self.since > self.epoch:
            raise ValueError(f"since ({self.since}) is after the epoch ({self.epoch})")

    @classmethod
    def of(cls, epoch: int, installer_started: int | None = None) -> TimeClamp:
        return cls(epoch, epoch if installer_started is None else min(epoch, installer_started))

    def __call__(self, mtime: int) -> int:
        return self.epoch if mtime >= self.since else mtime


def iso_time(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _check_digest(lock_sha256: str) -> str:
    if _SHA256.fullmatch(lock_sha256) is None:
        raise ValueError(f"a lock digest is 64 lower-case hex digits, not {lock_sha256!r}")
    return lock_sha256


def derived_uuid(lock_sha256: str, role: str) -> uuid.UUID:
    """The name-based UUID of ``role`` (``gpt-disk``, ``root-fs``, ...) for the lock ``lock_sha256``."""
    return uuid.uuid5(NAMESPACE, f"{_check_digest(lock_sha256)}/{role}")


@dataclass(frozen=True)
class Identity:
    """Every identifier and the time of one lock's image (docs/reproducible.md lists where each goes)."""

    lock_sha256: str
    source_date_epoch: int
    disk_guid: str  # the GPT's disk GUID (sfdisk label-id)
    esp_partition_uuid: str  # the GPT entry of the EFI system partition
    root_partition_uuid: str  # the GPT entry of the root file system
    root_fs_uuid: str  # the ext4 UUID: /etc/fstab, GRUB's embedded search, root= on the kernel command line
    root_hash_seed: str  # the ext4 directory hash seed
    esp_volume_id: str  # the FAT volume ID: two groups of four hex digits (its "UUID" in /etc/fstab)

    @property
    def esp_volume_hex(self) -> str:
        """The volume ID as mkfs.fat's ``-i`` takes it (8 hex digits)."""
        return self.esp_volume_id.replace("-", "")

    def to_json(self) -> dict[str, object]:
        return {
            "lock_sha256": self.lock_sha256,
            "source_date_epoch": self.source_date_epoch,
            "disk_guid": self.disk_guid,
            "esp_partition_uuid": self.esp_partition_uuid,
            "root_partition_uuid": self.root_partition_uuid,
            "root_fs_uuid": self.root_fs_uuid,
            "root_hash_seed": self.root_hash_seed,
            "esp_volume_id": self.esp_volume_id,
        }


def identity(lock_sha256: str, created_at: str) -> Identity:
    """The identity of the image built from the lock whose file has digest ``lock_sha256``."""
    epoch = source_date_epoch(created_at)

    def role(name: str) -> str:
        return str(derived_uuid(lock_sha256, name))

    volume = hashlib.sha256(f"{lock_sha256}/esp-volume-id".encode()).hexdigest()[:8].upper()
    return Identity(
        lock_sha256=lock_sha256,
        source_date_epoch=epoch,
        disk_guid=role("gpt-disk"),
        esp_partition_uuid=role("gpt-esp"),
        root_partition_uuid=role("gpt-root"),
        root_fs_uuid=role("root-fs"),
        root_hash_seed=role("root-fs-hash-seed"),
        esp_volume_id=f"{volume[:4]}-{volume[4:]}",
    )


def build_id(name: str, lock_sha256: str, epoch: int) -> str:
    """``<name>-<YYYYMMDDTHHMMSSZ of SOURCE_DATE_EPOCH>-<6 hex of the lock digest>``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(epoch))
    return f"{name}-{stamp}-{_check_digest(lock_sha256)[:6]}"


def sbom_namespace_uuid(lock_sha256: str) -> uuid.UUID:
    """The UUID in the SBOM's ``documentNamespace``: unique per lock, the same for every build of it."""
    return derived_uuid(lock_sha256, "spdx-document")
