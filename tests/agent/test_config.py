"""Agent configuration: file < config.d < kernel command line < environment < flags, and strict keys."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from agent.config import SETTINGS, AgentConfig, load_config, parse_cmdline
from agent.errors import ConfigError


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
