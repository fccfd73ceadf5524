"""Agent configuration: file < config.d < kernel command line < environment < flags, and strict keys."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from agent.config import (
    COMMAND_SETTINGS,
    DEFAULT_POOL_FILE,
    MAX_CMDLINE_BYTES,
    SETTINGS,
    AgentConfig,
    config_for,
    describe,
    load_config,
    parse_cmdline,
    table_matches_config,
)
from agent.errors import ConfigError
from protocol.cmdline import kernel_params


def _layout(
    tmp_path: Path, main: str = "", drop_ins: dict[str, str] | None = None, cmdline: str = ""
) -> tuple[Path, Path]:
    conf = tmp_path / "etc"
    conf.mkdir()
    if main:
        (conf / "config.yaml").write_text(main)
    if drop_ins:
        (conf / "config.d").mkdir()
        for name, text in drop_ins.items():
            (conf / "config.d" / name).write_text(text)
    cmd = tmp_path / "cmdline"
    cmd.write_text(cmdline)
    return conf, cmd


def test_settings_table_matches_the_dataclass() -> None:
    assert [s.key for s in SETTINGS] == [f.name for f in fields(AgentConfig)]


def test_precedence(tmp_path: Path) -> None:
    conf, cmd = _layout(
        tmp_path,
        main=(
            "server: file.example:8081\npool: from-file\ntrust_domain: file.example\n"
            "node_name: file-node\ntcti: 'swtpm:port=1'\n"
        ),
        drop_ins={
            "10-a.yaml": "pool: from-dropin-a\n",
            "20-b.yaml": "pool: from-dropin-b\ntrust_domain: dropin.example\n",
        },
        cmdline=(
            "BOOT_IMAGE=/vmlinuz ro nodeagent.pool=from-cmdline nodeagent.server=10.0.0.5:8081 "
            "nodeagent.node-name=cmd-node quiet"
        ),
    )
    env = {"NODEAGENT_NODE_NAME": "env-node", "NODEAGENT_TCTI": "swtpm:port=2", "OTHER": "x"}
    cfg, origin = load_config(config_dir=conf, cmdline_path=cmd, env=env, overrides={"tcti": "swtpm:port=3"})
    assert cfg.trust_domain == "dropin.example" and origin["trust_domain"].endswith("20-b.yaml")
    assert cfg.pool == "from-cmdline" and origin["pool"] == "kernel command line"
    assert cfg.server == "10.0.0.5:8081"
    assert cfg.node_name == "env-node" and origin["node_name"] == "environment"
    assert cfg.tcti == "swtpm:port=3" and origin["tcti"] == "command line"
    assert cfg.state_dir == "/var/lib/nodeagent" and "state_dir" not in origin
    assert cfg.join_address == "10.0.0.5:8082"


def test_types_are_checked(tmp_path: Path) -> None:
    conf, cmd = _layout(tmp_path, main="require_ek_cert: 'yes'\nretry_max_s: 30\n")
    cfg, _ = load_config(config_dir=conf, cmdline_path=cmd, env={})
    assert cfg.require_ek_cert is True and cfg.retry_max_s == 30.0
    for bad_env, message in (
        ({"NODEAGENT_REQUIRE_EK_CERT": "maybe"}, "true or false"),
        ({"NODEAGENT_RETRY_MAX_S": "soon"}, "number of seconds"),
        ({"NODEAGENT_RETRY_MAX_S": "-1"}, "positive"),
        ({"NODEAGENT_SERVR": "x:1"}, "unknown setting 'servr'"),
        ({"NODEAGENT_EK_ALG": "dsa"}, "ek_alg"),
        ({"NODEAGENT_SERVER": "no-port"}, "HOST:PORT"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(config_dir=conf, cmdline_path=cmd, env=bad_env)


def test_bad_files(tmp_path: Path) -> None:
    conf, cmd = _layout(tmp_path, main="- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})
    (conf / "config.yaml").write_text("poool: x\n")
    with pytest.raises(ConfigError, match="unknown setting 'poool'") as err:
        load_config(config_dir=conf, cmdline_path=cmd, env={})
    assert "known settings" in err.value.hint
    (conf / "config.yaml").write_text("pool: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})


def test_cmdline_parsing() -> None:
    assert parse_cmdline('ro nodeagent.pool=a nodeagent.bundle="/etc/x y.pem" console=ttyS0') == {
        "pool": "a",
        "bundle": "/etc/x y.pem",
    }
    with pytest.raises(ConfigError, match="has no value"):
        parse_cmdline("nodeagent.pool")
    with pytest.raises(ConfigError, match="unknown setting"):
        parse_cmdline("nodeagent.colour=blue")


# --------------------------------------------------------------------------- the kernel's rules


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        # an apostrophe is an ordinary character (shell rules stopped at it: issue 11)
        (
            "quiet root=LABEL=Bob's nodeagent.pool=hgx nodeagent.node-name=o'neil",
            {"pool": "hgx", "node_name": "o'neil"},
        ),
        ("console=ttyS0 acpi_osi='Windows 2015' nodeagent.pool=a", {"pool": "a"}),
        # double quotes group and are removed around a value, or around the whole parameter
        ('nodeagent.bundle="/etc/x y.pem"', {"bundle": "/etc/x y.pem"}),
        ('"nodeagent.bundle=/etc/x y.pem" nodeagent.pool=b', {"bundle": "/etc/x y.pem", "pool": "b"}),
        # a quote inside a value stays, as the kernel leaves it
        ('nodeagent.tcti=swtpm:host="h" nodeagent.pool=c', {"tcti": 'swtpm:host="h"', "pool": "c"}),
        ("nodeagent.tcti=a=b", {"tcti": "a=b"}),  # the first = splits
        # tabs and newlines separate like spaces (/proc/cmdline ends in a newline)
        ("ro\tnodeagent.pool=d\nnodeagent.node_name=n1\n", {"pool": "d", "node_name": "n1"}),
        # everything after a bare -- is for init
        ("nodeagent.pool=e -- nodeagent.pool=ignored nodeagent.colour=x", {"pool": "e"}),
        # a bare boolean parameter is true, as for the kernel's own
        ("nodeagent.require_ek_cert", {"require_ek_cert": True}),
        ("nodeagent.require-ek-cert=0", {"require_ek_cert": False}),
        # Go durations, or seconds
        (
            "nodeagent.deadline_s=1h30m nodeagent.retry_initial_s=0.5",
            {"deadline_s": 5400.0, "retry_initial_s": 0.5},
        ),
        ("", {}),
    ],
)
def test_cmdline_is_split_by_the_kernels_rules(cmdline: str, expected: dict[str, object]) -> None:
    assert parse_cmdline(cmdline) == expected


def test_kernel_params_match_next_arg() -> None:
    """Pairs as lib/cmdline.c's next_arg gives them (param, value or None)."""
    assert kernel_params(b'  a b=1 "c=2 3" d="4 5" e="6"7 f="" -- g') == [
        (b"a", None),
        (b"b", b"1"),
        (b"c", b"2 3"),
        (b"d", b"4 5"),
        (b"e", b'6"7'),
        (b"f", b""),
    ]
    assert kernel_params(b"x\xa0nodeagent.pool=p") == [
        (b"x", None),
        (b"nodeagent.pool", b"p"),
    ]  # 0xA0 is space


def test_cmdline_errors() -> None:
    with pytest.raises(ConfigError, match="has no value"):
        parse_cmdline("nodeagent.pool")
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        parse_cmdline("nodeagent.colour=blue")
    with pytest.raises(ConfigError, match=r"nodeagent\.server: server: expected HOST:PORT"):
        parse_cmdline("nodeagent.server=nowhere")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_cmdline(b"nodeagent.pool=\xff")
    assert parse_cmdline(b"other=\xff nodeagent.pool=p") == {"pool": "p"}  # others' bytes are theirs


def test_cmdline_is_bounded_before_parsing(tmp_path: Path) -> None:
    long_line = "nodeagent.pool=p " + "x" * MAX_CMDLINE_BYTES
    with pytest.raises(ConfigError, match="more than a kernel keeps"):
        parse_cmdline(long_line)
    conf, cmd = _layout(tmp_path, cmdline=long_line)
    with pytest.raises(ConfigError, match="larger than 4096 bytes"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})


# --------------------------------------------------------------------------- values


def test_durations_are_go_syntax_or_seconds(tmp_path: Path) -> None:
    conf, cmd = _layout(
        tmp_path,
        main="retry_initial_s: 500ms\nretry_max_s: 5m\ndeadline_s: 1500\nreattest_before_s: 0.5\n",
    )
    cfg, _ = load_config(config_dir=conf, cmdline_path=cmd, env={"NODEAGENT_TIMEOUT_S": "1m30s"})
    assert (cfg.retry_initial_s, cfg.retry_max_s, cfg.deadline_s) == (0.5, 300.0, 1500.0)
    assert (cfg.reattest_before_s, cfg.timeout_s) == (0.5, 90.0)
    rows = {key: value for key, value, _ in describe(cfg, {})}
    assert rows["retry_initial_s"] == "500ms" and rows["deadline_s"] == "25m"
    for bad in ("0", "0s", "1h 30m", "-5s", ""):
        with pytest.raises(ConfigError, match="timeout_s"):
            load_config(config_dir=conf, cmdline_path=cmd, env={"NODEAGENT_TIMEOUT_S": bad})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NODEAGENT_SERVER": "10.0.0.5:8081\n"}, "server: port must be 0..65535"),
        ({"NODEAGENT_JOIN_SERVER": "10.0.0.5:8082\n"}, "join_server"),
        ({"NODEAGENT_EK_ALG": "rsa\n"}, "is not one of rsa, ecc"),
        ({"NODEAGENT_TRUST_DOMAIN": "example.org\n"}, "trust_domain: expected a trust domain"),
        ({"NODEAGENT_DEADLINE_S": "25m\n"}, "deadline_s"),
    ],
)
def test_a_trailing_newline_is_refused(tmp_path: Path, env: dict[str, str], message: str) -> None:
    conf, cmd = _layout(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_config(config_dir=conf, cmdline_path=cmd, env=env)


def test_files_are_bounded_and_bad_yaml_is_a_config_error(tmp_path: Path) -> None:
    conf, cmd = _layout(tmp_path, main="pool: x\n" + "#" * (1024 * 1024))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})
    (conf / "config.yaml").write_text("timeout_s: " + "9" * 5000 + "\n")  # int() refuses > 4300 digits
    with pytest.raises(ConfigError, match="cannot be read as YAML"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})
    (conf / "config.yaml").write_text("pool: a\nPool: b\n")
    with pytest.raises(ConfigError, match="given twice"):
        load_config(config_dir=conf, cmdline_path=cmd, env={})


def test_the_table_and_the_dataclass_agree() -> None:
    assert table_matches_config() == []
    assert set(COMMAND_SETTINGS["run"]) == {f.name for f in fields(AgentConfig)}


# --------------------------------------------------------------------------- the commands read every layer


def _args(command: str, *argv: str) -> Any:
    from agent.cli import build_parser

    return build_parser().parse_args([command, *argv])


def test_attest_reads_the_file_the_cmdline_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `nodeagent attest` read only its flags and a few variables: it ignored config.yaml and
    the kernel command line although the config module said otherwise (issue 12)."""
    conf, cmd = _layout(
        tmp_path,
        main="server: file.example:8081\ntrust_domain: example.org\ntimeout_s: 30\n",
        drop_ins={"50-tpm.yaml": "tcti: 'swtpm:port=1'\n"},
        cmdline="ro nodeagent.bundle=/run/b.pem nodeagent.ek_alg=ecc",
    )
    monkeypatch.setenv("NODEAGENT_STATE_DIR", str(tmp_path / "state"))
    args = _args("attest", "--config-dir", str(conf), "--cmdline", str(cmd), "--timeout", "1m")
    cfg, origin = config_for(args, "attest")
    assert (cfg.server, cfg.trust_domain, cfg.tcti) == ("file.example:8081", "example.org", "swtpm:port=1")
    assert (cfg.bundle, cfg.ek_alg, origin["ek_alg"]) == ("/run/b.pem", "ecc", "kernel command line")
    assert cfg.state_dir == str(tmp_path / "state") and origin["state_dir"] == "environment"
    assert cfg.timeout_s == 60.0 and origin["timeout_s"] == "command line"


def test_check_reads_the_same_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODEAGENT_POOL_PROFILE", raising=False)
    conf, cmd = _layout(tmp_path, main="pool: cpu\n", cmdline="nodeagent.pool_profile=nvke")
    cfg, origin = config_for(_args("check", "--config-dir", str(conf), "--cmdline", str(cmd)), "check")
    assert cfg.pool_profile_spec() == "nvke" and origin["pool_profile"] == "kernel command line"
    cfg, _ = config_for(_args("check", "--config-dir", str(conf), "--cmdline", ""), "check")
    if not Path(DEFAULT_POOL_FILE).exists():
        assert cfg.pool_profile_spec() == "cpu"  # the pool name as a preset, as `run` does
    cfg, _ = config_for(_args("check", "--config-dir", str(conf), "--pool", "domino"), "check")
    assert cfg.pool_profile == "domino"  # --pool is the older spelling of --pool-profile


def test_run_takes_every_setting_as_a_flag(tmp_path: Path) -> None:
    conf, cmd = _layout(tmp_path)
    argv = ["--config-dir", str(conf), "--cmdline", str(cmd)]
    expected: dict[str, Any] = {}
    for setting in SETTINGS:
        assert setting.flag == "--" + setting.key.replace("_", "-")
        if setting.kind.name == "boolean":
            argv.append(setting.flag)
            expected[setting.name] = True
        elif setting.kind.name == "duration":
            argv += [setting.flag, "2m"]
            expected[setting.name] = 120.0
        elif setting.kind.choices:
            argv += [setting.flag, setting.kind.choices[-1]]
            expected[setting.name] = setting.kind.choices[-1]
        elif setting.kind.name == "address":
            argv += [setting.flag, "h.example:1"]
            expected[setting.name] = "h.example:1"
        elif setting.name == "spire_agent_unit":  # a systemd service name
            argv += [setting.flag, "value-of-spire-agent.service"]
            expected[setting.name] = "value-of-spire-agent.service"
        else:
            argv += [setting.flag, f"value-of-{setting.key}"]
            expected[setting.name] = f"value-of-{setting.key}"
    cfg, origin = config_for(_args("run", *argv), "run")
    assert {f.name: getattr(cfg, f.name) for f in fields(AgentConfig)} == expected
    assert set(origin.values()) == {"command line"}


def test_a_bad_flag_value_names_the_flag(tmp_path: Path) -> None:
    conf, cmd = _layout(tmp_path)
    args = _args("run", "--config-dir", str(conf), "--cmdline", str(cmd), "--retry-max-s", "soon")
    with pytest.raises(ConfigError, match="command line --retry-max-s: retry_max_s: expected a duration"):
        config_for(args, "run")


def test_an_explicit_command_line_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--cmdline .*: no such file"):
        config_for(_args("check", "--cmdline", str(tmp_path / "nope")), "check")
    _, origin = config_for(
        _args("check", "--config-dir", str(tmp_path / "absent"), "--cmdline", ""), "check"
    )
    assert "pool" not in origin  # an absent folder is no file layer, as on an unconfigured node
