"""``imagebuilder keygen``: file modes, refusal to overwrite, the passphrase."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from imagebuilder.cli import main
from imagebuilder.sign import PASSPHRASE_ENV, key_id, load_private_key, load_public_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_a_private_and_a_public_key(
    tmp_path: Path, key_kind: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    prefix = tmp_path / "release"
    assert main(["keygen", "--kind", key_kind, "--out", str(prefix)]) == 0
    key, pub = tmp_path / "release.key", tmp_path / "release.pub"
    assert _mode(key) == 0o600
    assert _mode(pub) == 0o644
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----\n")
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----\n")
    private = load_private_key(key)
    assert key_id(private.public_key()) == key_id(load_public_key(pub))
    out = capsys.readouterr().out
    assert f"keyid:       {key_id(load_public_key(pub))}" in out


def test_the_private_key_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        assert main(["keygen", "--kind", "ed25519", "--out", str(tmp_path / "k")]) == 0
    finally:
        os.umask(old)
    assert _mode(tmp_path / "k.key") == 0o600


@pytest.mark.parametrize("existing", [".key", ".pub"])
def test_keygen_refuses_to_overwrite(
    tmp_path: Path, existing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "ci"
    (tmp_path / f"ci{existing}").write_text("precious\n")
    assert main(["keygen", "--kind", "ed25519", "--out", str(prefix)]) == 9
    assert (tmp_path / f"ci{existing}").read_text() == "precious\n"
    other = ".pub" if existing == ".key" else ".key"
    assert not (tmp_path / f"ci{other}").exists()
    err = capsys.readouterr().err
    assert (
        f"imagebuilder: error: {tmp_path / f'ci{existing}'}: already exists; refusing to overwrite a key"
        in err
    )


def test_keygen_refuses_to_overwrite_its_own_output(tmp_path: Path) -> None:
    prefix = tmp_path / "twice"
    assert main(["keygen", "--out", str(prefix)]) == 0
    before = (tmp_path / "twice.key").read_bytes()
    assert main(["keygen", "--out", str(prefix)]) == 9
    assert (tmp_path / "twice.key").read_bytes() == before


def test_keygen_encrypts_with_the_passphrase_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(PASSPHRASE_ENV, "s3cret passphrase")
    assert main(["keygen", "--kind", "ecdsa-p256", "--out", str(tmp_path / "enc")]) == 0
    assert b"ENCRYPTED PRIVATE KEY" in (tmp_path / "enc.key").read_bytes()
    assert "encrypted" in capsys.readouterr().out
    load_private_key(tmp_path / "enc.key")
    monkeypatch.delenv(PASSPHRASE_ENV)
    with pytest.raises(Exception, match="encrypted and no passphrase"):
        load_private_key(tmp_path / "enc.key")


def test_keygen_needs_a_known_kind(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["keygen", "--kind", "rsa", "--out", str(tmp_path / "x")])
