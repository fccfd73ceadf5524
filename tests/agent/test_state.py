"""agent.state: a state file of the wrong shape is a clear StateError (exit 10), never a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.errors import StateError
from agent.state import MAX_STATE_BYTES, AfterJoin, AfterJoinStep, LastError, State, StateStore, Step

ROOT = Path(__file__).resolve().parents[2]


def good() -> dict[str, Any]:
    state = State(step=Step.VERIFY, attempts=2, spiffe_id="spiffe://example.org/spire/agent/tpm/ab")
    state.last_error = LastError("verify", "GPUs not ready", "wait", False, 1.0, reason="checks_failing")
    state.history = [{"at": 1.0, "step": "attest", "ok": True}]
    state.after_join = AfterJoin(AfterJoinStep.SPIRE_AGENT, attempts=1, devid_id="spiffe://example.org/x")
    state.after_join.last_error = LastError("spire_agent", "no bus", "retry", False, 2.0, exit_status=16)
    doc: dict[str, Any] = json.loads(state.to_json())
    return doc


def after_with(**changes: Any) -> dict[str, Any]:
    doc = good()
    doc["after_join"] = {**doc["after_join"], **changes}
    return doc


def with_(**changes: Any) -> dict[str, Any]:
    doc = good()
    doc.update(changes)
    return doc


def error_with(**changes: Any) -> dict[str, Any]:
    doc = good()
    doc["last_error"] = {**doc["last_error"], **changes}
    return doc


WRONG_SHAPES: list[tuple[str, Any, str]] = [
    ("a list", [1, 2, 3], "must be a JSON object"),
    ("a string", "preflight", "must be a JSON object"),
    ("null", None, "must be a JSON object"),
    ("unknown step", with_(step="dancing"), "unknown step"),
    ("step not a string", with_(step=3), "step must be"),
    ("no step", {k: v for k, v in good().items() if k != "step"}, "no step"),
    ("attempts a string", with_(attempts="2"), "attempts must be"),
    ("attempts negative", with_(attempts=-1), "attempts must be"),
    ("attempts a bool", with_(attempts=True), "attempts must be"),
    ("history not a list", with_(history={"a": 1}), "history must be"),
    ("history of lists", with_(history=[[1]]), "history must be"),
    ("history nested", with_(history=[{"a": {"b": 1}}]), "history must be"),
    ("last_error a list", with_(last_error=[]), "last_error must be"),
    ("last_error without message", error_with(message=None), "message must be"),
    ("last_error permanent a string", error_with(permanent="yes"), "permanent must be"),
    ("last_error unknown key", error_with(extra=1), "unknown key"),
    ("last_error missing keys", with_(last_error={"step": "verify"}), "lacks"),
    ("unknown key", with_(surprise=1), "unknown key"),
    ("wrong version", with_(version=2), "state version"),
    ("no version", {k: v for k, v in good().items() if k != "version"}, "state version"),
    ("svid_expires_at a float", with_(svid_expires_at=1.5), "svid_expires_at must be"),
    ("spiffe_id a number", with_(spiffe_id=7), "spiffe_id must be"),
    ("after_join a list", with_(after_join=[]), "after_join must be"),
    ("after_join unknown step", after_with(step="dancing"), "after_join.step is unknown"),
    ("after_join unknown key", after_with(surprise=1), "unknown key"),
    ("after_join attempts negative", after_with(attempts=-1), "attempts must be"),
    ("after_join devid_replaced a string", after_with(devid_replaced="yes"), "devid_replaced must be"),
    ("after_join last_error bad", after_with(last_error={"step": "x"}), "after_join.last_error lacks"),
]


@pytest.mark.parametrize(("name", "doc", "says"), WRONG_SHAPES, ids=[w[0] for w in WRONG_SHAPES])
def test_wrong_shapes_are_state_errors(tmp_path: Path, name: str, doc: Any, says: str) -> None:
    store = StateStore(tmp_path)
    store.path.write_text(json.dumps(doc))
    with pytest.raises(StateError) as err:
        store.load()
    assert says in err.value.message, err.value.message
    assert str(store.path) in err.value.message and "mv " in err.value.hint
    assert err.value.exit_code == 10 and err.value.permanent


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"updated_at": NaN}',
        b'{"updated_at": Infinity}',
        b'{"attempts": ' + b"9" * 5000 + b"}",  # past Python's integer-digit limit
        b"[" * 100_000 + b"]" * 100_000,  # deep nesting
        b"\xff\xfe",
    ],
    ids=["syntax", "nan", "infinity", "huge-int", "deep", "binary"],
)
def test_unparsable_files_are_state_errors(tmp_path: Path, raw: bytes) -> None:
    store = StateStore(tmp_path)
    store.path.write_bytes(raw)
    with pytest.raises(StateError):
        store.load()


def test_a_huge_file_is_refused_before_parsing(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    with store.path.open("wb") as fh:
        fh.write(b'{"history": [' + b'{"a": 1},' * (MAX_STATE_BYTES // 8) + b'{"a": 1}]}')
    with pytest.raises(StateError, match="larger than"):
        store.load()


def test_a_fifo_does_not_hang(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    os.mkfifo(store.path)
    with pytest.raises(StateError, match="not a regular file"):
        store.load()


def test_round_trip_and_older_last_errors(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    state = State(step=Step.JOIN_REQUEST, attempts=1)
    state.last_error = LastError("join_request", "m", "h", True, 5.0, reason="banned", code="PERMISSION_DENIED",
                                 exit_status=11)  # fmt: skip
    store.save(state)
    loaded = store.load()
    assert loaded.step is Step.JOIN_REQUEST and loaded.last_error == state.last_error
    # A state file written before last_error carried reason and exit status still loads.
    doc = json.loads(store.path.read_text())
    for key in ("reason", "code", "exit_status", "action"):
        del doc["last_error"][key]
    store.path.write_text(json.dumps(doc))
    older = store.load().last_error
    assert older is not None and older.exit_status == 1 and older.reason == ""
    assert store.load().after_join is None  # a state file from before the stage after the join


def test_the_stage_after_the_join_round_trips(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    state = State(step=Step.JOINED)
    state.after_join = AfterJoin(AfterJoinStep.DONE, devid_id="spiffe://e.org/spire/agent/tpm_devid/ab",
                                 devid_expires_at=7, devid_replaced=True, spire_agent_unit="s.service",
                                 spire_agent_started_at=3.5, done_at=4.0)  # fmt: skip
    state.after_join.last_error = LastError("devid_enrol", "m", "h", False, 5.0, exit_status=4)
    store.save(state)
    loaded = store.load()
    assert loaded.after_join == state.after_join and loaded.after_join.step is AfterJoinStep.DONE
    assert not store.after_join_pending()
    store.mark_after_join_pending()
    assert store.after_join_pending() and store.after_join_marker.name == "after-join-pending"
    store.clear_after_join_pending()
    store.clear_after_join_pending()  # idempotent
    assert not store.after_join_pending()


@pytest.mark.subprocess
def test_the_cli_exits_with_the_state_status_not_a_traceback(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "state.json").write_text("[]")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_")}
    env.update(
        NODEAGENT_STATE_DIR=str(state_dir),
        NODEAGENT_SERVER="127.0.0.1:9",
        NODEAGENT_TRUST_DOMAIN="example.org",
        NODEAGENT_POOL="cpu",
        NODEAGENT_JOIN_CONFIG=str(tmp_path / "run" / "join.yaml"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "--config-dir", str(tmp_path / "etc")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 10, result.stderr
    assert "Traceback" not in result.stderr and "must be a JSON object" in result.stderr
    status = subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", "--json", "--config-dir", str(tmp_path / "etc")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    doc = json.loads(status.stdout)
    assert doc["state_error"]["exit_class"] == "state_corrupt" and doc["step"] is None
