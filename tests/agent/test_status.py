"""``nodeagent status --json``: stable keys, the last error's reason, permanence and exit class; docs match."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent.errors import EXIT_STATUSES
from agent.state import LastError, State, StateStore, Step
from agent.status import status_doc, status_lines

ROOT = Path(__file__).resolve().parents[2]
JOIN_DOC = ROOT / "docs" / "join.md"
TOP_KEYS = {
    "schema", "state_dir", "step", "joined", "joined_at", "identity", "svid_expires_at", "svid_expires",
    "svid_expired", "last_verification", "kubernetes_version", "updated_at", "last_error", "state_error",
    "after_join", "devid",
}  # fmt: skip
AFTER_JOIN_KEYS = {
    "step", "done", "done_at", "attempts", "last_error", "spire_agent_unit", "spire_agent_started",
}  # fmt: skip
DEVID_KEYS = {"spiffe_id", "expires_at", "expires", "expired", "enrolled"}
ERROR_KEYS = {
    "step", "message", "hint", "reason", "code", "permanent", "exit_status", "exit_class", "action",
    "attempts", "at",
}  # fmt: skip


def failing_state(tmp_path: Path) -> Path:
    state = State(step=Step.JOIN_REQUEST, attempts=2, spiffe_id="spiffe://example.org/spire/agent/tpm/ab",
                  svid_expires_at=2_000_000_000, verdict="pass")  # fmt: skip
    state.last_error = LastError(
        "join_request", "refused", "fix the checks", True, 1_900_000_000.0,
        reason="policy", code="PERMISSION_DENIED", exit_status=8,
    )  # fmt: skip
    StateStore(tmp_path).save(state)
    return tmp_path


def test_keys_are_stable(tmp_path: Path) -> None:
    doc = status_doc(failing_state(tmp_path), now=1_950_000_000)
    assert set(doc) == TOP_KEYS
    assert set(doc["last_error"]) == ERROR_KEYS
    err = doc["last_error"]
    assert (err["reason"], err["permanent"], err["exit_status"], err["exit_class"]) == (
        "policy",
        True,
        8,
        "join_refused",
    )
    assert doc["step"] == "join_request" and doc["joined"] is False and doc["svid_expired"] is False
    assert json.loads(json.dumps(doc)) == doc


def test_joined_and_empty(tmp_path: Path) -> None:
    empty = status_doc(tmp_path / "none")
    assert set(empty) == TOP_KEYS and empty["step"] == "preflight" and empty["last_error"] is None
    store = StateStore(failing_state(tmp_path))
    store.mark_joined()
    joined = status_doc(tmp_path)
    assert joined["joined"] is True and joined["step"] == "joined" and joined["last_error"] is None


def test_an_unreadable_state_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"step": "nowhere", "version": 1}')
    doc = status_doc(tmp_path)
    assert doc["step"] is None and doc["state_error"]["exit_class"] == "state_corrupt"
    assert status_lines(tmp_path)[0].startswith("state: unreadable")


def test_the_text_names_the_exit_status(tmp_path: Path) -> None:
    lines = status_lines(failing_state(tmp_path))
    assert "exit status: 8 (join_refused), server's reason: policy" in lines
    assert any(line.startswith("last error (join_request, permanent") for line in lines)


def _documented_example() -> dict[str, Any]:
    text = JOIN_DOC.read_text()
    section = text.split("`nodeagent status --json` prints", 1)[1]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block, "docs/join.md has no JSON example of nodeagent status --json"
    doc: dict[str, Any] = json.loads(block.group(1))
    return doc


def test_the_documented_example_has_every_key() -> None:
    example = _documented_example()
    assert set(example) == TOP_KEYS
    assert set(example["last_error"]) == ERROR_KEYS
    row = next(e for e in EXIT_STATUSES if e.code == example["last_error"]["exit_status"])
    assert (
        row.name == example["last_error"]["exit_class"]
        and row.permanent == example["last_error"]["permanent"]
    )


def test_the_documented_keys_table_lists_every_key() -> None:
    text = JOIN_DOC.read_text().split("`nodeagent status --json` prints", 1)[1]
    table = text.split("| key | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\|\s*((?:`[a-z_]+`(?:,\s*)?)+)\s*\|", table, re.M))
    keys = {k for cell in documented for k in re.findall(r"`([a-z_]+)`", cell)}
    assert keys == TOP_KEYS
