"""What ``nodeagent status`` shows: lines for people, and a JSON document for fleet tooling.

The JSON document (``nodeagent status --json``) has stable keys; a key is never renamed
or removed within one ``schema`` version, and new keys may be added. See docs/join.md
(``nodeagent status``) for every key and an example::

    {"schema": 1, "step": "join_request", "joined": false, "identity": "spiffe://...",
     "svid_expires_at": 1764494523, "last_verification": "pass",
     "last_error": {"step": "join_request", "reason": "banned", "permanent": true,
                    "exit_status": 11, "exit_class": "banned", "hint": "...", ...}, ...}

The stage after the join (agent.after_join) has keys of its own, so that its failures show next to a
join that stands: ``after_join`` (``step``, ``done``, ``attempts``, ``last_error`` with the same keys
as the join's, ``spire_agent_unit``, ``spire_agent_started``) and ``devid`` (``spiffe_id``, the
``tpm_devid`` identity, and the certificate's expiry); both null until the stage has begun.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.errors import StateError, exit_status
from agent.state import AfterJoin, AfterJoinStep, LastError, State, StateStore

STATUS_SCHEMA = 1


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _error_doc(e: LastError, attempts: int) -> dict[str, Any]:
    row = exit_status(e.exit_status)
    return {
        "step": e.step,
        "message": e.message,
        "hint": e.hint,
        "reason": e.reason or row.name,
        "code": e.code or None,
        "permanent": e.permanent,
        "exit_status": e.exit_status,
        "exit_class": row.name,
        "action": e.action,
        "attempts": attempts,
        "at": _iso(e.at) if e.at else None,
    }


def status_doc(state_dir: Path, *, now: float | None = None) -> dict[str, Any]:
    """The ``nodeagent status --json`` document for the state in ``state_dir``."""
    now = time.time() if now is None else now
    store = StateStore(state_dir)
    doc: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "state_dir": str(state_dir),
        "step": None,
        "joined": store.joined(),
        "joined_at": None,
        "identity": None,
        "svid_expires_at": None,
        "svid_expires": None,
        "svid_expired": None,
        "last_verification": None,
        "kubernetes_version": None,
        "updated_at": None,
        "last_error": None,
        "after_join": None,
        "devid": None,
        "state_error": None,
    }
    try:
        state = store.load()
    except StateError as exc:
        row = exit_status(exc.exit_code)
        doc["state_error"] = {
            "message": exc.message,
            "hint": exc.hint,
            "exit_status": row.code,
            "exit_class": row.name,
        }
        return doc
    doc["step"] = "joined" if doc["joined"] else str(state.step)
    doc["joined_at"] = _iso(state.joined_at) if state.joined_at else None
    doc["identity"] = state.spiffe_id or None
    if state.svid_expires_at:
        doc["svid_expires_at"] = state.svid_expires_at
        doc["svid_expires"] = _iso(state.svid_expires_at)
        doc["svid_expired"] = state.svid_expires_at <= now
    doc["last_verification"] = state.verdict or None
    doc["kubernetes_version"] = state.kubernetes_version or None
    doc["updated_at"] = _iso(state.updated_at) if state.updated_at else None
    if state.last_error is not None and not doc["joined"]:
        doc["last_error"] = _error_doc(state.last_error, state.attempts)
    if state.after_join is not None:
        doc["after_join"], doc["devid"] = _after_join_doc(state.after_join, now)
    return doc


def _after_join_doc(a: AfterJoin, now: float) -> tuple[dict[str, Any], dict[str, Any] | None]:
    stage = {
        "step": str(a.step),
        "done": a.step is AfterJoinStep.DONE,
        "done_at": _iso(a.done_at) if a.done_at else None,
        "attempts": a.attempts,
        "last_error": _error_doc(a.last_error, a.attempts) if a.last_error is not None else None,
        "spire_agent_unit": a.spire_agent_unit or None,
        "spire_agent_started": _iso(a.spire_agent_started_at) if a.spire_agent_started_at else None,
    }
    devid = None
    if a.devid_id:
        devid = {
            "spiffe_id": a.devid_id,
            "expires_at": a.devid_expires_at,
            "expires": _iso(a.devid_expires_at),
            "expired": a.devid_expires_at <= now,
            "enrolled": _iso(a.devid_enrolled_at) if a.devid_enrolled_at else None,
        }
    return stage, devid


def status_lines(state_dir: Path) -> list[str]:
    """What ``nodeagent status`` prints."""
    store = StateStore(state_dir)
    try:
        state = store.load()
    except StateError as exc:
        return [f"state: unreadable ({exc.message})", f"what to do: {exc.hint}"]
    return _lines(state, store.joined())


def _lines(state: State, joined: bool) -> list[str]:
    lines = [f"step: {'joined' if joined else state.step}"]
    if state.spiffe_id:
        lines.append(f"identity: {state.spiffe_id}")
    if state.svid_expires_at:
        left = state.svid_expires_at - time.time()
        lines.append(f"SVID expires: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(state.svid_expires_at))}"
                     + (" (expired)" if left <= 0 else f" (in {left / 60:.0f} min)"))  # fmt: skip
    if state.verdict:
        lines.append(f"last verification: {state.verdict}")
    if state.kubernetes_version:
        lines.append(f"kubernetes: {state.kubernetes_version} (the join answer's, installed and held)")
    if state.updated_at:
        lines.append(f"updated: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(state.updated_at))}")
    if state.last_error is not None and not joined:
        lines += _error_lines(state.last_error, state.attempts, "")
    if state.after_join is not None:
        lines += _after_join_lines(state.after_join)
    return lines


def _error_lines(e: LastError, attempts: int, where: str) -> list[str]:
    row = exit_status(e.exit_status)
    kind = "permanent: fix it, then restart the agent" if e.permanent else f"transient, attempt {attempts}"
    lines = [f"last error ({where}{e.step}, {kind}): {e.message}"]
    reason = e.reason or row.name
    lines.append(
        f"exit status: {e.exit_status} ({row.name})"
        + (f", server's reason: {reason}" if reason != row.name else "")
    )
    if e.hint:
        lines.append(f"what to do: {e.hint}")
    return lines


def _after_join_lines(a: AfterJoin) -> list[str]:
    done = a.step is AfterJoinStep.DONE
    lines = [f"after the join: {'done' if done else a.step}" + ("" if done else " (the join stands)")]
    if a.devid_id:
        left = a.devid_expires_at - time.time()
        lines.append(f"DevID (SPIRE tpm_devid): {a.devid_id}")
        lines.append(f"DevID expires: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(a.devid_expires_at))}"
                     + (" (expired)" if left <= 0 else f" (in {left / 86400:.0f} days)"))  # fmt: skip
    if a.spire_agent_started_at:
        lines.append(f"SPIRE agent: {a.spire_agent_unit} started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(a.spire_agent_started_at))}")  # fmt: skip
    if a.last_error is not None:
        lines += _error_lines(a.last_error, a.attempts, "after the join: ")
    return lines
