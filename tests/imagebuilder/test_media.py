"""Reading members out of an ISO: only regular files come out, nothing the ISO names on the host is touched.

Every ISO here is made by xorriso (Rock Ridge), the way an attacker would make one: a member that is a
symbolic link to a host file, a FIFO, a device, a hard link. Before issue 11's fix a symlinked
``casper/vmlinuz`` made the builder chmod the host file it named (0600 -> 0644) and read it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from imagebuilder import media
from imagebuilder.errors import BuildError

pytestmark = pytest.mark.subprocess


def _iso(tmp_path: Path, build: dict[str, object]) -> Path:
    tree = tmp_path / "tree"
    (tree / "casper").mkdir(parents=True)
    for name, what in build.items():
        path = tree / name
        if isinstance(what, bytes):
            path.write_bytes(what)
        elif isinstance(what, tuple) and what[0] == "symlink":
            path.symlink_to(str(what[1]))
        elif isinstance(what, tuple) and what[0] == "hardlink":
            os.link(tree / str(what[1]), path)
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "device":
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    return media.make_iso(tree, tmp_path / "evil.iso", label="EVIL")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "host-secret"
    path.write_text("the host's secret\n")
    path.chmod(0o600)
    return path


def test_a_regular_member_comes_out_as_a_new_file_of_its_own(tmp_path: Path, secret: Path) -> None:
    iso = _iso(tmp_path, {"casper/vmlinuz": b"kernel", "casper/initrd": b"initrd"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "vmlinuz").symlink_to(
        secret
    )  # a link already at the destination is replaced, never written through
    media.extract(iso, {"casper/vmlinuz": out / "vmlinuz", "casper/initrd": out / "initrd"})
    assert (out / "vmlinuz").read_bytes() == b"kernel" and not (out / "vmlinuz").is_symlink()
    assert stat.S_IMODE((out / "initrd").stat().st_mode) == 0o644
    assert secret.read_text() == "the host's secret\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert sorted(p.name for p in out.iterdir()) == ["initrd", "vmlinuz"]  # no temporary folder left


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_a_member_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, secret: Path, target: str
) -> None:
    link = secret if target == "absolute" else os.path.relpath(secret, tmp_path / "tree" / "casper")
    iso = _iso(tmp_path, {"casper/vmlinuz": ("symlink", link), "casper/minimal.manifest": ("symlink", link)})
    out = tmp_path / "out"
    with pytest.raises(
        BuildError, match=r"casper/vmlinuz is a symbolic link to .*, not a regular file: refused"
    ):
        media.extract(iso, {"casper/vmlinuz": out / "vmlinuz"})
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600  # before the fix: 0644
    assert not (out / "vmlinuz").exists() and not (out / "vmlinuz").is_symlink()
    with pytest.raises(BuildError, match="is a symbolic link"):
        media.read_member(iso, "casper/minimal.manifest")  # before the fix: the host file's content
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("kind", "why"), [("fifo", "a FIFO"), ("device", "")])
def test_a_member_that_is_a_fifo_or_a_device_is_refused(tmp_path: Path, kind: str, why: str) -> None:
    if kind == "device" and os.geteuid() != 0:
        pytest.fail("making a device node in the ISO tree needs root (the test machines run as root)")
    iso = _iso(tmp_path, {"casper/initrd": kind})
    out = tmp_path / "out"
    with pytest.raises(BuildError) as caught:
        media.extract(iso, {"casper/initrd": out / "initrd"})
    # xorriso restores a FIFO as a FIFO (refused by name); a device it does not restore at all
    assert (
        f"casper/initrd is {why}" in caught.value.message
        if why
        else "has no casper/initrd" in caught.value.message
    )
    assert not (out / "initrd").exists()


def test_hard_linked_members_come_out_as_separate_files(tmp_path: Path) -> None:
    iso = _iso(tmp_path, {"casper/vmlinuz": b"same", "casper/initrd": ("hardlink", "casper/vmlinuz")})
    out = tmp_path / "out"
    media.extract(iso, {"casper/vmlinuz": out / "k", "casper/initrd": out / "i"})
    assert (out / "k").read_bytes() == (out / "i").read_bytes() == b"same"
    assert (out / "k").stat().st_nlink == 1 and (out / "i").stat().st_nlink == 1


@pytest.mark.parametrize(
    "member", ["../etc/shadow", "casper/../../etc/shadow", "/casper/vmlinuz", "", "a\nb", "./x"]
)
def test_member_names_that_leave_the_iso_root_are_refused_before_xorriso_runs(
    tmp_path: Path, member: str
) -> None:
    with pytest.raises(BuildError, match="is not a plain path inside an ISO"):
        media.extract(tmp_path / "missing.iso", {member: tmp_path / "out"})
