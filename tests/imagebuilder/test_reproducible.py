"""imagebuilder.reproducible: every identifier and time of an image follows from its lock, and nothing else."""

from __future__ import annotations

import re
import uuid

import pytest

from imagebuilder import reproducible
from imagebuilder.errors import LockError

LOCK = "3f" * 32
CREATED = "2026-11-01T12:34:56Z"


def test_the_time_is_the_locks_created_at() -> None:
    assert reproducible.source_date_epoch(CREATED) == 1793536496
    assert reproducible.iso_time(1793536496) == CREATED


@pytest.mark.parametrize(
    "bad", ["2026-11-01 12:34:56", "2026-11-01T12:34:56+00:00", "", "2026-13-01T00:00:00Z"]
)
def test_a_created_at_that_is_no_utc_time_is_refused(bad: str) -> None:
    with pytest.raises(LockError, match="created_at"):
        reproducible.source_date_epoch(bad)


def test_a_time_before_1980_is_refused_fat_cannot_hold_it() -> None:
    with pytest.raises(LockError, match="before 1980"):
        reproducible.source_date_epoch("1979-12-31T23:59:59Z")


def test_the_identity_is_pinned_for_a_lock() -> None:
    """The values are part of the builder's contract: an image rebuilt by a later builder of the same version
    must get the same ones (a change here is a change of every image's bytes)."""
    ident = reproducible.identity(LOCK, CREATED)
    assert ident.to_json() == {
        "lock_sha256": LOCK,
        "source_date_epoch": 1793536496,
        "disk_guid": str(uuid.uuid5(reproducible.NAMESPACE, f"{LOCK}/gpt-disk")),
        "esp_partition_uuid": str(uuid.uuid5(reproducible.NAMESPACE, f"{LOCK}/gpt-esp")),
        "root_partition_uuid": str(uuid.uuid5(reproducible.NAMESPACE, f"{LOCK}/gpt-root")),
        "root_fs_uuid": str(uuid.uuid5(reproducible.NAMESPACE, f"{LOCK}/root-fs")),
        "root_hash_seed": str(uuid.uuid5(reproducible.NAMESPACE, f"{LOCK}/root-fs-hash-seed")),
        "esp_volume_id": ident.esp_volume_id,
    }
    assert str(reproducible.NAMESPACE) == "dacea445-39a1-5a21-9b85-1ea8f4e8cbe7"
    assert ident.root_fs_uuid == "69a0f1bf-9d1f-5eac-8c62-db85565a4f88"
    assert ident.esp_volume_id == "CBE9-29F0"
    assert re.fullmatch(r"[0-9A-F]{4}-[0-9A-F]{4}", ident.esp_volume_id)
    assert ident.esp_volume_hex == ident.esp_volume_id.replace("-", "")


def test_every_identifier_differs_from_the_others_and_from_another_locks() -> None:
    one = reproducible.identity(LOCK, CREATED)
    other = reproducible.identity("40" * 32, CREATED)
    values = [v for k, v in one.to_json().items() if k not in ("lock_sha256", "source_date_epoch")]
    assert len(set(values)) == len(values)
    assert not set(values) & {v for k, v in other.to_json().items() if k != "source_date_epoch"}
    assert reproducible.identity(LOCK, CREATED) == one  # a function of the lock alone


def test_the_build_id_names_the_lock() -> None:
    assert reproducible.build_id("fixture-node", LOCK, 1793536496) == "fixture-node-20261101T123456Z-3f3f3f"


def test_the_sbom_namespace_comes_from_the_lock() -> None:
    assert reproducible.sbom_namespace_uuid(LOCK) == reproducible.sbom_namespace_uuid(LOCK)
    assert reproducible.sbom_namespace_uuid(LOCK) != reproducible.sbom_namespace_uuid("40" * 32)


def test_a_lock_digest_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="64 lower-case hex"):
        reproducible.identity("ABC", CREATED)
