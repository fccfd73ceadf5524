"""The seal's deterministic disk assembly (imagebuilder.sealtree, .assemble, .seal) with the real host tools.

The same archive gives the same bytes whatever the folder, the wall clock, the umask and the order the
host wrote things in; every identifier and time the pass sets is checked in the result; bad archives
and trees that do not fit are refused with nothing left behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from imagebuilder import assemble, reproducible, seal, sealtree
from tests.imagebuilder import sealkit
from tests.imagebuilder.sealkit import Member, d

pytestmark = pytest.mark.subprocess
LOCK = "5e" * 32
CREATED = "2026-11-01T00:00:00Z"
EPOCH = reproducible.source_date_epoch(CREATED)
IDENT = reproducible.identity(LOCK, CREATED)
CLAMP = reproducible.TimeClamp.of(EPOCH)
TOOLS = ("sfdisk", "mkfs.fat", "mmd", "mcopy", "mke2fs", "debugfs", "e2fsck", "dumpe2fs", "blkid")


@pytest.fixture(autouse=True)
def _tools() -> None:
    missing = [t for t in TOOLS if shutil.which(t, path="/usr/sbin:/sbin:/usr/bin:/bin") is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)} (scripts/ensure-deps.sh installs them)")


def _tar(now: float) -> bytes:
    return sealkit.archive(sealkit.root_members(now) + sealkit.esp_members(now))


def _trees(tar: bytes, where: Path, *, needles: dict[str, bytes] | None = None) -> dict[str, sealtree.Tree]:
    lay = sealkit.layout()
    return sealtree.read_archive(
        io.BytesIO(tar), offset=0, length=len(tar), epoch=EPOCH, needles=needles,
        trees={"root": (where / "root", "root", lay.part(2).bytes), "esp": (where / "esp", "esp", lay.part(1).bytes)},
    )  # fmt: skip


def _assemble(tar: bytes, where: Path) -> Path:
    trees = _trees(tar, where)
    done = assemble.assemble(where / "disk.raw", sealkit.layout(), IDENT, esp=trees["esp"], root=trees["root"],
                             esp_label="UEFI", root_label="cloudimg-rootfs", work=where / "work")  # fmt: skip
    return done.disk


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _out(*argv: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}).stdout  # fmt: skip


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert time.time() > EPOCH  # what the build writes is newer than the lock
    return _assemble(_tar(time.time()), tmp_path_factory.mktemp("sealed"))


# -- the same bytes ----------------------------------------------------------------------------------------


def test_the_same_tree_gives_the_same_disk_whatever_the_host_did(tmp_path: Path) -> None:
    """Two host trees written in opposite orders, under different umasks, a second apart, archived as the guest
    does (sealtree.write_tar), assembled in different folders under different umasks: the same bytes."""
    digests = []
    for run, mask in enumerate((0o022, 0o077)):
        base = tmp_path / f"run{run}" / ("deeper/" * run or ".")
        base.mkdir(parents=True)
        root, esp = base / "src-root", base / "src-esp"
        files = [
            ("etc/hostname", b"node\n"),
            ("etc/os-release", b"ID=debian\n"),
            ("usr/lib/libx.so", b"\x7fELF"),
        ]
        old = os.umask(mask)
        try:
            for rel, data in files if run == 0 else reversed(files):
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(data)  # written now: newer than SOURCE_DATE_EPOCH, clamped
            (root / "boot/efi").mkdir(parents=True)
            (esp / "EFI/BOOT").mkdir(parents=True)
            (esp / "EFI/BOOT/BOOTX64.EFI").write_bytes(b"MZ" * 100)
            for path in [root, *root.rglob("*"), esp, *esp.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            buf = io.BytesIO()
            sealtree.write_tar(buf, {"root": root, "esp": esp})
            digests.append(_sha256(_assemble(buf.getvalue(), base / "work")))
        finally:
            os.umask(old)
        time.sleep(1.1)
    assert digests[0] == digests[1]


def test_the_same_archive_at_another_time_gives_the_same_disk(tmp_path: Path, disk: Path) -> None:
    time.sleep(1.1)
    assert _sha256(_assemble(_tar(time.time()), tmp_path)) == _sha256(disk)


def test_another_lock_gives_another_disk(tmp_path: Path, disk: Path) -> None:
    trees = _trees(_tar(time.time()), tmp_path)
    other = reproducible.identity("5f" * 32, CREATED)
    done = assemble.assemble(tmp_path / "other.raw", sealkit.layout(), other, esp=trees["esp"], root=trees["root"],
                             esp_label="UEFI", root_label="cloudimg-rootfs", work=tmp_path / "work")  # fmt: skip
    assert _sha256(done.disk) != _sha256(disk)


# -- every identifier and time the pass sets ----------------------------------------------------------------


def test_the_gpt_has_the_locks_guids_and_the_provisioned_layout(disk: Path) -> None:
    table = json.loads(_out("sfdisk", "-J", str(disk)))["partitiontable"]
    assert table["label"] == "gpt" and table["id"] == IDENT.disk_guid.upper()
    assert (table["firstlba"], table["lastlba"]) == (2048, sealkit.DISK // 512 - 34)
    esp, root = table["partitions"]
    assert (esp["start"], esp["size"], esp["type"], esp["uuid"], esp["name"]) == (
        sealkit.ESP_START,
        sealkit.ESP_SECTORS,
        assemble.ESP_TYPE,
        IDENT.esp_partition_uuid.upper(),
        "EFI System",
    )
    assert (root["start"], root["size"], root["type"], root["uuid"]) == (
        sealkit.ROOT_START, sealkit.ROOT_SECTORS, sealkit.LINUX, IDENT.root_partition_uuid.upper())  # fmt: skip
    with disk.open("rb") as fh:
        mbr = fh.read(512)
    assert mbr[440:444] == b"\0\0\0\0"  # the protective MBR's disk signature: no random one


def _blkid(disk: Path, sector: int) -> dict[str, str]:
    out = _out("blkid", "-p", "-O", str(sector * 512), "-o", "export", str(disk))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_the_esp_has_the_locks_volume_id_and_the_build_time(disk: Path) -> None:
    probe = _blkid(disk, sealkit.ESP_START)
    assert (probe["TYPE"], probe["UUID"], probe["LABEL"], probe["VERSION"]) == (
        "vfat",
        IDENT.esp_volume_id,
        "UEFI",
        "FAT32",
    )
    env = {"TZ": "UTC", "MTOOLS_SKIP_CHECK": "1"}
    image = f"{disk}@@{sealkit.ESP_START * 512}"
    listing = _out("mdir", "-i", image, "::/EFI/BOOT", env=env) + _out(
        "mdir", "-i", image, "::/EFI/debian", env=env
    )
    sde = time.strftime("%Y-%m-%d %H:%M", time.gmtime(EPOCH))
    stamp = re.compile(r"(\d{4}-\d{2}-\d{2})\s+(\d+):(\d{2})")

    def when(line: str) -> str:
        m = stamp.search(line)
        assert m, line
        return f"{m[1]} {int(m[2]):02d}:{m[3]}"

    lines = {ln.split()[0]: ln for ln in listing.splitlines() if stamp.search(ln)}
    assert when(lines["BOOTX64"]) == sde  # written now, clamped
    assert when(lines["grub"]) == time.strftime("%Y-%m-%d %H:%M", time.gmtime(1_500_000_000))  # older: kept
    assert when(lines["."]) == sde  # directories: SOURCE_DATE_EPOCH


def _dumpe2fs(disk: Path) -> dict[str, str]:
    out = _out("dumpe2fs", "-h", f"{disk}?offset={sealkit.ROOT_START * 512}")
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines() if ":" in ln)}


def test_the_root_file_system_has_the_locks_uuid_seed_and_time(disk: Path) -> None:
    sb = _dumpe2fs(disk)
    when = time.strftime("%a %b %e %H:%M:%S %Y", time.gmtime(EPOCH))
    assert sb["Filesystem UUID"] == IDENT.root_fs_uuid
    assert sb["Directory Hash Seed"] == IDENT.root_hash_seed
    assert sb["Filesystem volume name"] == "cloudimg-rootfs"
    assert sb["Filesystem created"] == sb["Last write time"] == when
    assert sb["Last mount time"] == "n/a"
    # s_kbytes_written (libext2fs's write statistics, printed rounded as "Lifetime writes") is a fixed 0: it
    # varied by kilobytes between two seals of one tree, and only the superblock checksum showed it
    assert "Lifetime writes" not in sb
    with disk.open("rb") as fh:
        fh.seek(sealkit.ROOT_START * 512 + 1024 + 0x178)
        assert fh.read(8) == bytes(8)
    assert set(sb["Filesystem features"].split()) == {
        "has_journal", "ext_attr", "resize_inode", "dir_index", "filetype", "extent", "64bit", "flex_bg",
        "sparse_super", "large_file", "huge_file", "dir_nlink", "extra_isize", "metadata_csum"}  # fmt: skip


def _stat(disk: Path, path: str) -> str:
    q = '"' + path.replace('"', '""') + '"'
    return _out("debugfs", "-R", f"stat {q}", f"{disk}?offset={sealkit.ROOT_START * 512}")


def _inode(text: str) -> int:
    m = re.search(r"Inode: (\d+)", text)
    assert m, text
    return int(m[1])


def _field(text: str, name: str) -> int:
    m = re.search(rf"\b{name}: 0x([0-9a-f]+)", text)
    assert m, f"{name} not in {text}"
    return int(m[1], 16)


@pytest.mark.parametrize("member", sealkit.root_members(EPOCH + 86400.0), ids=lambda m: m.name)
def test_every_inode_has_its_archive_metadata_and_the_build_time(disk: Path, member: Member) -> None:
    path = "/" + member.name.removeprefix("root").lstrip("/")
    text = _stat(disk, path)
    assert _field(text, "ctime") == _field(text, "atime") == _field(text, "crtime") == EPOCH
    if member.kind == "hardlink":
        assert _inode(text) == _inode(_stat(disk, "/usr/bin/ping"))
        assert "Links: 2" in text
        return
    assert _field(text, "mtime") == min(int(member.mtime), EPOCH)
    mode = re.search(r"Mode:\s+(\d+)", text)
    assert mode and int(mode[1], 8) == member.mode, text
    assert re.search(rf"User:\s+{member.uid}\s+Group:\s+{member.gid}\b", text), text
    kind = {"file": "regular", "dir": "directory", "symlink": "symlink", "char": "character special",
            "block": "block special", "fifo": "FIFO"}[member.kind]  # fmt: skip
    assert f"Type: {kind}" in text
    if member.kind in ("char", "block"):
        assert f"Device major/minor number: {member.major:02d}:{member.minor:02d}" in text
    if member.kind == "symlink":
        assert f'Fast link dest: "{member.target}"' in text


def test_file_contents_capabilities_and_holes(disk: Path, tmp_path: Path) -> None:
    device = f"{disk}?offset={sealkit.ROOT_START * 512}"
    attr = subprocess.run(["debugfs", "-R", "ea_get -f /dev/stdout /usr/bin/ping security.capability", device],
                          capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    assert sealkit.CAPABILITY in attr
    for name, member in ((m.name, m) for m in sealkit.root_members(0.0) if m.kind == "file"):
        out = tmp_path / "x"
        path = "/" + name.removeprefix("root/")
        q = '"' + path.replace('"', '""') + '"'
        subprocess.run(
            ["debugfs", "-R", f"dump {q} {out}", device], check=True, capture_output=True, timeout=60
        )
        assert out.read_bytes() == member.data, path
    # zero blocks become holes, whatever the source was: a function of the content
    assert "Blockcount: 8" in _stat(disk, "/usr/bin/zeros")


def test_the_file_systems_are_consistent(disk: Path) -> None:
    subprocess.run(
        ["e2fsck", "-fn", f"{disk}?offset={sealkit.ROOT_START * 512}"], check=True, capture_output=True
    )


# -- bad input -----------------------------------------------------------------------------------------------


def _bad(*members: Member) -> bytes:
    return sealkit.archive([d("root"), d("root/etc"), *members, d("esp"), d("esp/EFI")])


BAD = {
    "dotdot": (_bad(Member("root/etc/../../escape", data=b"x")), "'..' component"),
    "absolute": (_bad(Member("/etc/passwd", data=b"x")), "belongs to none of the archive's trees"),
    "absolute-inside": (sealkit.archive([d("root"), Member("root//etc", data=b"x")]), "absolute name"),
    "control": (_bad(Member("root/etc/a\nb", data=b"x")), "control character"),
    "under-symlink": (_bad(Member("root/lib", "symlink", target="/etc"), Member("root/lib/x", data=b"x")),
                      "under the symbolic link"),
    "hardlink-missing": (_bad(Member("root/etc/h", "hardlink", target="root/etc/nothing")), "not an earlier regular"),
    "hardlink-out": (_bad(Member("root/etc/h", "hardlink", target="../outside")), "belongs to none"),
    "twice": (_bad(Member("root/etc/a", data=b"1"), Member("root/etc/a", data=b"2")), "appears twice"),
    "before-dir": (sealkit.archive([d("root"), Member("root/usr/bin/x", data=b"x")]), "before its directory"),
    "acl": (_bad(Member("root/etc/a", data=b"x", pax={"SCHILY.acl.access": "user::rw-"})), "POSIX ACL"),
    "device-in-esp": (sealkit.archive([d("root"), d("esp"), Member("esp/null", "char", major=1, minor=3)]),
                      "FAT holds directories and files only"),
    "symlink-in-esp": (sealkit.archive([d("root"), d("esp"), Member("esp/l", "symlink", target="x")]),
                       "FAT holds directories and files only"),
    "fat-name": (sealkit.archive([d("root"), d("esp"), Member("esp/a*b", data=b"x")]), "not a name FAT"),
    "no-root-dir": (sealkit.archive([Member("root", data=b"x")]), "not a directory"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_archive_is_refused_and_nothing_is_left(tmp_path: Path, case: str) -> None:
    tar, message = BAD[case]
    with pytest.raises(sealtree.TreeError, match=re.escape(message)):
        _trees(tar, tmp_path)
    assert list(tmp_path.iterdir()) == []  # both trees removed, nothing written outside them


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    tar = _tar(time.time())
    with pytest.raises(sealtree.TreeError, match="not a readable tar stream"):
        _trees(tar[: len(tar) // 2], tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_tree_larger_than_its_partition_is_refused_while_reading(tmp_path: Path) -> None:
    big = Member("root/big", data=bytes(sealkit.layout().part(2).bytes + 4096))
    with pytest.raises(sealtree.TreeError, match="cannot fit its partition") as err:
        _trees(sealkit.archive([d("root"), big, d("esp")]), tmp_path)
    assert "raise disk_size" in err.value.hint
    assert list(tmp_path.iterdir()) == []


def test_a_tree_that_leaves_no_room_for_the_file_system_is_refused_before_mke2fs(tmp_path: Path) -> None:
    size = int(sealkit.layout().part(2).bytes * 0.93)
    trees = _trees(
        sealkit.archive([d("root"), Member("root/big", data=b"\1" * size), d("esp")]), tmp_path / "t"
    )
    with pytest.raises(assemble.AssemblyError, match=r"does not fit|needs about") as err:
        assemble.assemble(tmp_path / "disk.raw", sealkit.layout(), IDENT, esp=trees["esp"], root=trees["root"],
                          esp_label="UEFI", root_label="r", work=tmp_path / "work")  # fmt: skip
    assert "raise disk_size" in err.value.hint
    assert not (tmp_path / "disk.raw").exists() and not (tmp_path / ".disk.raw.partial").exists()


def test_a_layout_the_seal_does_not_rebuild_is_refused() -> None:
    table = sealkit.sfdisk_table()
    parts = table["partitiontable"]["partitions"]
    three = {
        "partitiontable": {
            **table["partitiontable"],
            "partitions": [*parts, {**parts[1], "node": "/dev/vda3"}],
        }
    }
    with pytest.raises(assemble.AssemblyError, match="not one EFI system partition and one Linux root"):
        assemble.layout_from_sfdisk(three, sealkit.DISK)
    with pytest.raises(assemble.AssemblyError, match="no GPT"):
        assemble.layout_from_sfdisk({"partitiontable": {"label": "dos"}}, sealkit.DISK)
    assert assemble.layout_from_sfdisk(table, sealkit.DISK) == sealkit.layout()


# -- the provisioned disk, read offline --------------------------------------------------------------------------

#: stands in for the installer's random identifiers (and its time: later than the lock's, as a build is)
INSTALLER = reproducible.identity("1a" * 32, "2026-12-01T00:00:00Z")


def _provisioned(tmp: Path, members: list[Member]) -> Path:
    """A "provisioned" QCOW2 as a build VM leaves it: the archive's trees on a disk with other identifiers."""
    return sealkit.qcow2_disk(
        members, INSTALLER, tmp, name="provisioned.qcow2", root_label="cloudimg-rootfs"
    )


def test_the_seal_reads_the_provisioned_disk_offline_and_gives_the_archives_disk(
    tmp_path: Path, disk: Path
) -> None:
    """A disk with the same trees (made with other identifiers, at another time), read offline with debugfs and
    mtools and sealed with the lock's identity, is byte for byte the disk assembled straight from the archive:
    the ext4 reader and the archive reader see the same trees."""
    members = [m for m in sealkit.root_members(time.time()) + sealkit.esp_members(time.time())]
    qcow2 = _provisioned(tmp_path / "vm", members)
    source = seal.read_provisioned(qcow2, tmp_path / "seal", clamp=CLAMP)
    assert (source.root_label, source.esp_label) == ("cloudimg-rootfs", "UEFI")
    assert source.old_ids["the installer's root file system UUID"] == INSTALLER.root_fs_uuid.encode()
    assert (
        source.old_ids["the installer's EFI system partition volume ID"] == INSTALLER.esp_volume_id.encode()
    )
    done = seal.seal(source, tmp_path / "image.raw", IDENT, work=tmp_path / "seal")
    assert _sha256(done.disk) == _sha256(disk)
    assert done.entries == len(members) + 1  # and lost+found, which mke2fs made on the provisioned disk
    assert not (tmp_path / "seal" / "root").exists() and not (tmp_path / "seal" / "esp").exists()
    assert not list((tmp_path / "seal").glob("*.raw")) and not (tmp_path / "seal" / "root.ext4").exists()


DAY = 86400


def test_an_installed_base_older_than_the_lock_seals_as_one_installed_after_it(tmp_path: Path) -> None:
    """A base cached before the lock was made holds its installer's time stamps, before SOURCE_DATE_EPOCH; a
    cold build of the same lock installs after it. Every time since the base's installer started becomes the
    epoch, so both seal to the same bytes; a clamp alone keeps the old base's times (the defect the VM tier
    found: every file the installer wrote differed in mtime). What is older than the installer run (a
    package's files) keeps its own time in both."""
    cached_run, cold_run = EPOCH - 2 * DAY, EPOCH + 3 * DAY
    cached = _provisioned(
        tmp_path / "cached", sealkit.root_members(cached_run) + sealkit.esp_members(cached_run)
    )
    cold = _provisioned(tmp_path / "cold", sealkit.root_members(cold_run) + sealkit.esp_members(cold_run))

    def sealed(disk: Path, clamp: reproducible.TimeClamp, name: str) -> str:
        source = seal.read_provisioned(disk, tmp_path / f"seal-{name}", clamp=clamp)
        mtimes = {e.path: e.mtime for t in source.trees.values() for e in t.entries if e.kind != "hardlink"}
        assert mtimes["/usr/bin/ping"] == 1_600_000_000  # a package's file: older than any installer run
        if clamp.since < clamp.epoch or name == "cold":
            assert mtimes["/etc/fstab"] == mtimes["/EFI/BOOT/BOOTX64.EFI"] == EPOCH
        return _sha256(
            seal.seal(source, tmp_path / f"{name}.raw", IDENT, work=tmp_path / f"seal-{name}").disk
        )

    one = sealed(cached, reproducible.TimeClamp.of(EPOCH, installer_started=cached_run - 3600), "cached")
    other = sealed(cold, reproducible.TimeClamp.of(EPOCH, installer_started=cold_run - 3600), "cold")
    assert one == other
    assert sealed(cached, CLAMP, "clamp-only") != one  # the installer's times of the cached run kept


def test_a_time_clamp_keeps_what_is_older_than_the_installer_run() -> None:
    plain = reproducible.TimeClamp.of(EPOCH)
    assert (plain.since, plain(EPOCH - 1), plain(EPOCH), plain(EPOCH + 9)) == (
        EPOCH,
        EPOCH - 1,
        EPOCH,
        EPOCH,
    )
    assert reproducible.TimeClamp.of(EPOCH, installer_started=EPOCH + 60) == plain  # a cold build
    older = reproducible.TimeClamp.of(EPOCH, installer_started=EPOCH - DAY)
    assert (older(EPOCH - DAY - 1), older(EPOCH - DAY), older(EPOCH - 1)) == (EPOCH - DAY - 1, EPOCH, EPOCH)
    with pytest.raises(ValueError, match="after the epoch"):
        reproducible.TimeClamp(EPOCH, EPOCH + 1)


def test_a_file_that_still_names_the_installers_uuid_fails_the_seal(tmp_path: Path) -> None:
    members = sealkit.root_members(0.0) + sealkit.esp_members(0.0)
    members.append(
        Member("root/etc/crypttab", data=f"x UUID={INSTALLER.root_fs_uuid.upper()} none\n".encode())
    )
    members.append(Member("esp/EFI/debian/boot.cfg", data=f"uuid {INSTALLER.esp_volume_id}\n".encode()))
    source = seal.read_provisioned(_provisioned(tmp_path / "vm", members), tmp_path / "seal", clamp=CLAMP)
    with pytest.raises(seal.SealError) as err:
        seal.seal(source, tmp_path / "image.raw", IDENT, work=tmp_path / "seal")
    assert "the installer's root file system UUID in the root tree: /etc/crypttab" in err.value.message
    assert (
        "the installer's EFI system partition volume ID in the esp tree: /EFI/debian/boot.cfg"
        in err.value.message
    )
    assert "identify step" in err.value.hint
    assert not (tmp_path / "image.raw").exists() and not (tmp_path / "seal" / "root").exists()


def test_a_credential_of_the_build_fails_the_seal_and_is_never_printed(tmp_path: Path) -> None:
    token = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    members = sealkit.root_members(0.0)
    members += [d("root/var"), d("root/var/log"), d("root/var/log/installer"),
                Member("root/var/log/installer/autoinstall-user-data", data=f"endpoint: {token}\n".encode())]  # fmt: skip
    credentials = {"this build's webhook token": token.encode()}
    tar = sealkit.archive(members + sealkit.esp_members(0.0))
    source = seal.source_from_archive(io.BytesIO(tar), len(tar), sealkit.layout(), tmp_path / "t", epoch=EPOCH,
                                      needles=credentials)  # fmt: skip
    with pytest.raises(seal.SealError) as err:
        seal.seal(source, tmp_path / "image.raw", IDENT, work=tmp_path / "work", credentials=credentials)
    assert "credential of the build" in err.value.message
    assert (
        "this build's webhook token in the root tree: /var/log/installer/autoinstall-user-data"
        in err.value.message
    )
    assert token not in err.value.message + err.value.hint
    assert not (tmp_path / "image.raw").exists()


def test_a_provisioned_disk_without_ext4_and_fat_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    with raw.open("wb") as fh:
        fh.truncate(sealkit.DISK)
    subprocess.run(
        ["sfdisk", "-q", str(raw)],
        input=b"label: gpt\nsize=40MiB, type=U\nsize=100MiB, type=L\n",
        check=True,
    )
    qcow2 = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)], check=True)
    with pytest.raises(seal.SealError, match="the seal reads an ext4 root and a FAT ESP"):
        seal.read_provisioned(qcow2, tmp_path / "seal", clamp=CLAMP)
    assert not list((tmp_path / "seal").iterdir())
