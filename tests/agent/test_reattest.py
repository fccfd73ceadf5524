"""nodeagent reattest before the node joined, and when its settings are missing (no TPM, no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import AgentConfig
from agent.errors import ConfigError
from agent.reattest import reattest
from agent.state import StateStore


def test_a_node_that_has_not_joined_is_left_to_nodeagent_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert reattest(AgentConfig(state_dir=str(tmp_path / "state"))).action == "not_joined"
    (tmp_path / "etc").mkdir()
    rc = main(["reattest", "--json", "--config-dir", str(tmp_path / "etc"), "--cmdline", "",
               "--state-dir", str(tmp_path / "state")])  # fmt: skip
    assert rc == 0 and json.loads(capsys.readouterr().out)["action"] == "not_joined"


def test_a_joined_node_without_its_settings_is_a_configuration_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    StateStore(state).mark_joined()
    with pytest.raises(ConfigError) as refused:
        reattest(AgentConfig(state_dir=str(state)))
    assert "server" in refused.value.message and refused.value.hint
