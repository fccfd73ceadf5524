"""agent.files: the agent never chmods a folder it did not create, and refuses one others can change."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import StateError
from agent.files import FileTooLargeError, ensure_private_dir, read_bounded
from agent.state import State, StateStore
from agent.svid import SvidStore


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_folder_is_created_private(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "state"
    ensure_private_dir(target)
    assert target.is_dir() and mode(target) == 0o700


def test_an_existing_readable_folder_keeps_its_mode_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "var-lib"
    shared.mkdir()
    shared.chmod(0o755)
    caplog.set_level(logging.WARNING, "agent.files")
    StateStore(shared).save(State())
    SvidStore(shared).write_key(ec.generate_private_key(ec.SECP256R1()))
    assert mode(shared) == 0o755, "the agent must not change the mode of a folder it did not create"
    assert any("0755" in r.getMessage() for r in caplog.records)
    assert mode(shared / "state.json") == 0o600 and mode(shared / "svid.key.new") == 0o600


@pytest.mark.parametrize("bits", [0o777, 0o1777, 0o775, 0o757])
def test_a_folder_others_can_write_is_refused_untouched(tmp_path: Path, bits: int) -> None:
    tmp_like = tmp_path / "tmp"
    tmp_like.mkdir()
    tmp_like.chmod(bits)
    with pytest.raises(StateError, match="writable by other users") as err:
        StateStore(tmp_like).save(State())
    assert "install -d -m 0700" in err.value.hint
    assert mode(tmp_like) == bits
    assert not (tmp_like / "state.json").exists()
    with pytest.raises(StateError):
        SvidStore(tmp_like).write_key(ec.generate_private_key(ec.SECP256R1()))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(StateError, match="another user"):
        ensure_private_dir(theirs)
    assert theirs.stat().st_uid == 65534


def test_a_file_where_the_folder_should_be(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("x")
    with pytest.raises(StateError, match="not a folder"):
        ensure_private_dir(tmp_path / "state")


def test_read_bounded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    assert read_bounded(f, 10) == b"x" * 10
    with pytest.raises(FileTooLargeError):
        read_bounded(f, 9)
    with pytest.raises(FileTooLargeError, match="not a regular file"):
        read_bounded(tmp_path, 10)
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 10)
