"""``imagebuilder``: the options several commands share come from one table; ``--json`` where tooling reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imagebuilder.cli import build_parser, main
from imagebuilder.commands.options import COMMAND_OPTIONS, TABLE
from imagebuilder.sign import PASSPHRASE_ENV, key_id, load_public_key


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_shared_options_parse_alike_in_every_command(command: str, tmp_path: Path) -> None:
    given = {
        "lock": ["--lock", str(tmp_path / "x.lock.json")],
        "cache_dir": ["--cache-dir", str(tmp_path / "cache")],
        "work_dir": ["--work-dir", str(tmp_path / "work")],
        "libvirt_uri": ["--libvirt-uri", "test:///default"],
        "accel": ["--accel", "tcg"],
        "keep_work": ["--keep-work"],
    }
    names = COMMAND_OPTIONS[command]
    required = {"rebuild": ["--key", str(tmp_path / "publisher.pub")]}.get(
        command, []
    )  # its own, not shared
    argv = [command, str(tmp_path / "x.yaml"), *required, *(arg for name in names for arg in given[name])]
    args = build_parser().parse_args(argv)
    expected = {
        "lock": tmp_path / "x.lock.json",
        "cache_dir": tmp_path / "cache",
        "work_dir": tmp_path / "work",
        "libvirt_uri": "test:///default",
        "accel": "tcg",
        "keep_work": True,
    }
    assert {name: getattr(args, name) for name in names} == {name: expected[name] for name in names}
    defaults = build_parser().parse_args([command, str(tmp_path / "x.yaml"), *required])
    assert {name: getattr(defaults, name) for name in names} == {
        name: TABLE.by_name[name].default for name in names
    }


def test_a_bad_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["test", "image.qcow2", "--accel", "fast"])
    assert done.value.code == 2
    assert "argument --accel: 'fast' is not one of auto, kvm, tcg" in capsys.readouterr().err


def test_keygen_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    assert main(["keygen", "--kind", "ed25519", "--out", str(tmp_path / "k"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {
        "private_key": str(tmp_path / "k.key"),
        "public_key": str(tmp_path / "k.pub"),
        "keyid": key_id(load_public_key(tmp_path / "k.pub")),
        "encrypted": False,
    }
