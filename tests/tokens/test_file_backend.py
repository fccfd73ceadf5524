"""The file token backend: private folder, 0600 files written atomically, idempotent delete."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from server.errors import ConfigError, TokenBackendError, TokenConflictError
from server.tokens.backend import open_backend
from server.tokens.filebackend import FileBackend
from server.tokens.token import BootstrapToken, secret_manifest
from tests.tokens.conftest import assert_no_secret


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_check_creates_a_private_folder(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "a" / "tokens")
    old = os.umask(0)
    try:
        backend.check()
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a" / "tokens") == 0o700
    assert list((tmp_path / "a" / "tokens").iterdir()) == []  # the probe is gone


def test_check_refuses_a_shared_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)  # noqa: S103 - the mistake under test
    with pytest.raises(ConfigError, match=r"mode 0755 lets other users read.*chmod 700"):
        FileBackend(folder).check()


def test_check_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("")
    with pytest.raises(ConfigError, match=r"token_backend.directory"):
        FileBackend(tmp_path / "tokens").check()


def test_check_refuses_a_folder_it_cannot_use(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root can write anywhere: make the folder someone else's instead
        os.chown(folder, 65534, 65534)
        expected = "owned by uid 65534"
    else:
        os.chmod(folder, 0o500)
        expected = "not writable"
    try:
        with pytest.raises(ConfigError, match=expected):
            FileBackend(folder).check()
    finally:
        os.chmod(folder, 0o700)


def test_create_writes_the_manifest_0600(
    tmp_path: Path, token: BootstrapToken, logs: pytest.LogCaptureFixture
) -> None:
    backend = open_backend({"type": "file", "directory": str(tmp_path / "tokens")})
    backend.check()
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        ref = backend.create(token)
    finally:
        os.umask(old)
    path = tmp_path / "tokens" / f"bootstrap-token-{token.token_id}.yaml"
    assert ref == str(path)
    assert _mode(path) == 0o600
    text = path.read_text()
    assert text.startswith("# A kubeadm bootstrap token written by nodeserver")
    assert yaml.safe_load(text) == secret_manifest(token)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert_no_secret(token.secret, logs)


def test_create_refuses_to_overwrite(tmp_path: Path, token: BootstrapToken) -> None:
    backend = FileBackend(tmp_path)
    backend.create(token)
    before = (tmp_path / f"bootstrap-token-{token.token_id}.yaml").read_text()
    with pytest.raises(TokenConflictError):
        backend.create(BootstrapToken(token.token_id, "ffffffffffffffff", token.expires_at))
    assert (tmp_path / f"bootstrap-token-{token.token_id}.yaml").read_text() == before


def test_atomic_write_keeps_the_old_state_on_failure(
    tmp_path: Path, token: BootstrapToken, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FileBackend(tmp_path)

    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(TokenBackendError, match=r"No space left"):
        backend.create(token)
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one


def test_delete_is_idempotent_and_confined(tmp_path: Path, token: BootstrapToken) -> None:
    backend = FileBackend(tmp_path / "tokens")
    backend.check()
    victim = tmp_path / "precious.yaml"
    victim.write_text("keep me")
    ref = backend.create(token)
    backend.delete(token.token_id, str(victim))  # a wrong ref: the derived file is deleted, not the ref
    assert not Path(ref).exists()
    assert victim.read_text() == "keep me"
    backend.delete(token.token_id, ref)  # already gone: fine
    with pytest.raises(TokenBackendError, match=r"malformed id"):
        backend.delete("../precious", "")


def test_create_without_the_folder(tmp_path: Path, token: BootstrapToken) -> None:
    with pytest.raises(TokenBackendError, match=r"cannot write"):
        FileBackend(tmp_path / "missing").create(token)
