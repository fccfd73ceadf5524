"""The installed base cache: which changes move the key, store and lookup, damage, eviction, locking,
and the boot files the installer exports."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from imagebuilder import autoinstall
from imagebuilder.base import BaseCache, base_key, base_material, check_disk_size, read_export
from imagebuilder.definition import Definition, load_definition
from imagebuilder.errors import BuildError, DefinitionError
from imagebuilder.run import run

REPO = Path(__file__).resolve().parents[2]
ISO = "a" * 64
MEDIUM = "b" * 64


def _defn() -> Definition:
    return load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )


def _key(defn: Definition, *, iso: str = ISO, medium: str = MEDIUM) -> str:
    user_data = autoinstall.user_data(defn, webhook=None)
    return base_key(base_material(defn, iso_sha256=iso, user_data=user_data, medium_digest=medium))


def test_what_keeps_the_key() -> None:
    defn = _defn()
    key = _key(defn)
    assert key == _key(_defn())  # stable
    assert defn.kubernetes is not None and defn.user is not None
    kept = [
        dataclasses.replace(defn, kubernetes=dataclasses.replace(defn.kubernetes, staged=("1.34.2",))),
        dataclasses.replace(defn, artifacts=defn.artifacts[:1]),
        dataclasses.replace(defn, agent=dataclasses.replace(defn.agent, venv="/opt/other/venv")),
        dataclasses.replace(defn, user=dataclasses.replace(defn.user, name="someone")),
        dataclasses.replace(defn, name="another-image", memory_mib=4096, cpus=4, compress=not defn.compress),
    ]
    for changed in kept:
        assert _key(changed) == key
    # the per-build webhook is not part of the key
    with_webhook = autoinstall.user_data(defn, webhook=autoinstall.webhook_url("t0ken"))
    assert base_key(base_material(defn, iso_sha256=ISO, user_data=with_webhook, medium_digest=MEDIUM)) != key
    # (the builder renders the key's user-data without it: see imagebuilder.build.Build.media)


def test_what_moves_the_key() -> None:
    defn = _defn()
    key = _key(defn)
    moved = {
        "the installer ISO": _key(defn, iso="c" * 64),
        "the base medium (OS packages, stage.sh, provision-init)": _key(defn, medium="d" * 64),
        "the disk size": _key(dataclasses.replace(defn, disk_size="8G")),
        "the firmware": _key(dataclasses.replace(defn, firmware="bios")),
        "the installer's kernel arguments": _key(
            dataclasses.replace(defn, installer=dataclasses.replace(defn.installer, kernel_args=("quiet",)))
        ),
        "the SSH server choice": _key(
            dataclasses.replace(defn, ssh=dataclasses.replace(defn.ssh, install_server=False))
        ),
    }
    assert len(set(moved.values())) == len(moved)
    for what, other in moved.items():
        assert other != key, what


def test_a_target_disk_too_small_for_the_export_disk_is_refused() -> None:
    check_disk_size(_defn())
    with pytest.raises(DefinitionError, match="too small"):
        check_disk_size(dataclasses.replace(_defn(), disk_size="512M"))


# -- the cache ----------------------------------------------------------------------------------


def _inputs(tmp: Path) -> dict[str, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    disk = tmp / "disk.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "16M"])
    for name, data in (("vmlinuz", b"kernel"), ("initrd.img", b"initrd"), ("console.log", b"installer\n")):
        (tmp / name).write_bytes(data)
    return {
        "disk": disk,
        "kernel": tmp / "vmlinuz",
        "initrd": tmp / "initrd.img",
        "console": tmp / "console.log",
    }


def _store(cache: BaseCache, key: str, tmp: Path) -> Any:
    return cache.store(
        key, **_inputs(tmp), record={"root": "UUID=1234", "material": {"k": key}, "installer": INSTALLER}
    )


#: what build.store_base records of the installer run: its phases, the first one's start is the run's
INSTALLER = {"phases": [{"name": "boot", "started_at": "2026-12-07T06:08:21Z", "duration_s": 75.7},
                        {"name": "install", "started_at": "2026-12-07T06:09:36Z", "duration_s": 320.7}]}  # fmt: skip


@pytest.mark.subprocess
def test_store_then_lookup(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases")
    assert cache.lookup("k1") is None
    stored = _store(cache, "k1", tmp_path / "in")
    found = cache.lookup("k1")
    assert found is not None
    assert found.folder == tmp_path / "bases" / "k1" == stored.folder
    assert found.root == "UUID=1234"
    assert found.sha256 == hashlib.sha256(found.disk.read_bytes()).hexdigest()
    assert found.kernel.read_bytes() == b"kernel" and found.initrd.read_bytes() == b"initrd"
    assert found.record["key"] == "k1" and found.record["material"] == {"k": "k1"}
    assert found.installer_started == 1796623701  # 2026-12-07T06:08:21Z: the time clamp's since (seal)
    info = json.loads(run(["qemu-img", "info", "--output=json", str(found.disk)]).text)
    assert info["format"] == "qcow2"
    for name in ("base.qcow2", "vmlinuz", "initrd.img", "console.log"):
        assert (found.folder / name).stat().st_mode & 0o777 == 0o644  # QEMU reads it as another user
    assert not [p for p in (tmp_path / "bases").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "record", "no-start", "bad-start"])
def test_a_damaged_base_is_removed_and_never_used(tmp_path: Path, damage: str) -> None:
    cache = BaseCache(tmp_path / "bases")
    stored = _store(cache, "k1", tmp_path / "in")
    if damage == "truncate":
        with stored.disk.open("r+b") as fh:
            fh.truncate(stored.disk.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(stored.kernel.read_bytes())
        data[0] ^= 0xFF
        stored.kernel.write_bytes(bytes(data))
    elif damage == "delete":
        stored.initrd.unlink()
    elif damage == "record":
        (stored.folder / "base.json").write_text("{not json")
    else:  # without its installer's start the seal cannot tell that run's time stamps from a package's
        record = json.loads((stored.folder / "base.json").read_text())
        if damage == "no-start":
            del record["installer"]
        else:
            record["installer"]["phases"][1]["started_at"] = "yesterday"
        (stored.folder / "base.json").write_text(json.dumps(record))
    assert cache.lookup("k1") is None
    assert not stored.folder.exists()


@pytest.mark.subprocess
def test_base_json_never_names_the_files_that_are_checked(tmp_path: Path) -> None:
    """base.json's ``files`` is a record, not a list of paths: a record that names a host file instead of the
    base's own (whose digest it knows) must not pass a damaged base off as intact."""
    cache = BaseCache(tmp_path / "bases")
    stored = _store(cache, "k1", tmp_path / "in")
    host = tmp_path / "host-file"
    host.write_bytes(b"any host file")
    record = json.loads((stored.folder / "base.json").read_text())
    record["files"] = {os.path.relpath(host, stored.folder): {"sha256": hashlib.sha256(b"any host file").hexdigest(),
                                                              "size": 13}}  # fmt: skip
    (stored.folder / "base.json").write_text(json.dumps(record))
    with stored.disk.open("r+b") as fh:
        fh.truncate(1024)  # the base itself is damaged
    assert cache.lookup("k1") is None  # before: only the named host file was hashed, and the base was used
    assert not stored.folder.exists() and host.read_bytes() == b"any host file"


@pytest.mark.subprocess
def test_only_the_most_recently_used_bases_are_kept(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases")
    for index, key in enumerate(("k1", "k2", "k3")):
        _store(cache, key, tmp_path / f"in{index}")
        os.utime(tmp_path / "bases" / key / "last-used", (1000 + index, 1000 + index))
    os.utime(tmp_path / "bases" / "k1" / "last-used", (5000, 5000))  # k1 used again: k2 is now the oldest
    _store(cache, "k4", tmp_path / "in4")
    assert sorted(p.name for p in (tmp_path / "bases").iterdir() if (p / "base.json").exists()) == [
        "k1",
        "k3",
        "k4",
    ]
    # the base a build is using is never evicted, however old
    assert cache.evict(keep=1, protect="k3") == ["k1"]
    assert sorted(p.name for p in (tmp_path / "bases").iterdir() if (p / "base.json").exists()) == [
        "k3",
        "k4",
    ]


def test_one_build_installs_a_base_at_a_time(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases")
    lock_file = tmp_path / "bases" / "locks" / "k1.lock"

    def try_lock() -> bool:
        with lock_file.open("a") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return True

    with cache.locked("k1"):
        assert not try_lock()  # a second builder would wait here
        with cache.locked("k2"):  # another key is independent
            pass
    assert try_lock()


# -- the boot files on the export disk ------------------------------------------------------------


def _export(tmp: Path, files: dict[str, bytes], *, pad: int = 1 << 20) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    raw = tmp / "export.raw"
    raw.write_bytes(buffer.getvalue() + b"\0" * pad)  # the rest of the raw disk is zeros
    return raw


def _reported(files: dict[str, bytes]) -> dict[str, str]:
    return {name: f"{hashlib.sha256(data).hexdigest()}:{len(data)}" for name, data in files.items()}


BOOT = {"vmlinuz": b"\x7fkernel" * 100, "initrd.img": b"initramfs" * 100}


def test_read_export(tmp_path: Path) -> None:
    raw = _export(tmp_path, BOOT)
    kernel, initrd = read_export(raw, {"root": "UUID=1", **_reported(BOOT)}, tmp_path / "boot")
    assert kernel.read_bytes() == BOOT["vmlinuz"] and initrd.read_bytes() == BOOT["initrd.img"]
    assert kernel.stat().st_mode & 0o777 == 0o644


def test_read_export_checks_what_the_installer_reported(tmp_path: Path) -> None:
    raw = _export(tmp_path, BOOT)
    wrong = {**_reported(BOOT), "initrd.img": "0" * 64 + ":900"}
    with pytest.raises(BuildError, match=r"initrd\.img from the export disk does not match"):
        read_export(raw, wrong, tmp_path / "boot")
    with pytest.raises(BuildError, match="did not report the installed system's boot files"):
        read_export(raw, None, tmp_path / "boot")


def test_read_export_refuses_a_disk_without_the_boot_files(tmp_path: Path) -> None:
    raw = _export(tmp_path, {"vmlinuz": BOOT["vmlinuz"]})
    with pytest.raises(BuildError, match=r"initrd\.img"):
        read_export(raw, _reported(BOOT), tmp_path / "boot")
    garbage = tmp_path / "garbage.raw"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(BuildError, match="cannot read the boot files"):
        read_export(garbage, _reported(BOOT), tmp_path / "boot")
