"""The agent's lifecycle state on disk: ``<state_dir>/state.json``, replaced atomically.

Written (write, fsync, rename) at every step change and every failure, so a
crash or a reboot resumes at the right step, and ``nodeagent status`` can say
where the agent is, what went wrong last and what to do. The ``joined`` marker
is a separate file so that the systemd unit's ``ConditionPathExists=!`` can
see it; so is the ``after-join-pending`` marker, which exists while the
optional stage after the join (a DevID, then the SPIRE agent: agent.lifecycle)
has not finished, so that the unit runs again on a joined node until it has.

A state file is read with a size bound and its shape checked key by key: a file
this agent cannot understand (a list, a wrong type, an unknown step, too large)
is a :class:`StateError` (exit 10, which systemd does not restart) naming the key
and the fix, never a crash.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from agent.errors import AgentError, RefusalError, StateError
from agent.files import FileTooLargeError, ensure_private_dir, read_bounded, write_atomic

STATE_FILE = "state.json"
JOINED_MARKER = "joined"
AFTER_JOIN_MARKER = "after-join-pending"
STATE_VERSION = 1
MAX_STATE_BYTES = 1024 * 1024
MAX_HISTORY = 50


class Step(StrEnum):
    PREFLIGHT = "preflight"
    ATTEST = "attest"
    VERIFY = "verify"
    JOIN_REQUEST = "join_request"
    KUBEADM_JOIN = "kubeadm_join"
    JOINED = "joined"


ORDER = list(Step)


class AfterJoinStep(StrEnum):
    """The optional stage after the join (agent.lifecycle); it never touches the join itself."""

    DEVID_ENROL = "devid_enrol"  # a DevID for SPIRE's tpm_devid, unless a valid one is there
    SPIRE_AGENT = "spire_agent"  # systemctl start --no-block <spire_agent_unit>
    DONE = "done"


@dataclass
class LastError:
    step: str
    message: str
    hint: str
    permanent: bool
    at: float
    reason: str = ""  # the server's reason slug for refusals, else the exit class (agent.errors)
    code: str = ""  # the gRPC status name of a refusal
    exit_status: int = 1  # what `nodeagent run` exits with for this error (agent.errors.EXIT_STATUSES)
    action: str = "step"  # agent.errors.Action

    @classmethod
    def of(cls, step: str, exc: AgentError, at: float) -> LastError:
        """What ``exc``, raised at ``step``, leaves in the state: its message, hint, class and action."""
        return cls(
            step=step,
            message=exc.message,
            hint=exc.hint,
            permanent=exc.permanent,
            at=at,
            reason=exc.reason,
            code=exc.code if isinstance(exc, RefusalError) else "",
            exit_status=exc.exit_code,
            action=str(exc.action),
        )


@dataclass
class AfterJoin:
    """Where the stage after the join is; its failures are kept here, apart from the join's."""

    step: AfterJoinStep = AfterJoinStep.DEVID_ENROL
    attempts: int = 0  # consecutive failures at this step
    last_error: LastError | None = None
    devid_id: str = ""  # spiffe://<td>/spire/agent/tpm_devid/<SHA-1 of the DevID leaf>
    devid_expires_at: int = 0
    devid_enrolled_at: float = 0.0  # 0: the DevID found in devid_dir was used as it was
    devid_replaced: bool = False  # a DevID that existed was replaced: restart (not start) the SPIRE agent
    spire_agent_unit: str = ""
    spire_agent_started_at: float = 0.0
    done_at: float = 0.0


@dataclass
class State:
    step: Step = Step.PREFLIGHT
    attempts: int = 0  # consecutive failures at this step
    updated_at: float = 0.0
    last_error: LastError | None = None
    svid_expires_at: int = 0
    spiffe_id: str = ""
    verdict: str = ""
    joined_at: float = 0.0
    # The Kubernetes version the join answer selected and the agent made the installed one (agent.kubeversion).
    kubernetes_version: str = ""
    # The stage after the join, once it has begun (None: not configured, or not reached yet).
    after_join: AfterJoin | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["version"] = STATE_VERSION
        doc["step"] = str(self.step)
        if self.after_join is not None:
            doc["after_join"]["step"] = str(self.after_join.step)
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes, path: Path) -> State:
        try:
            doc = json.loads(raw, parse_constant=_no_constants)
            return _state_from(doc)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge integers, deep nesting
            raise _bad(path, str(exc) or type(exc).__name__) from exc


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number this agent stores")


def _bad(path: Path, what: str) -> StateError:
    return StateError(
        f"{path} is not a state file this agent understands: {what}",
        hint=f"move it aside (mv {path} {path}.bad) and run again; the agent starts over "
        "(it attests again, and never repeats a completed join)",
    )


# -- shape checks ------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_history(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(item, dict) and all(isinstance(k, str) and _is_scalar(x) for k, x in item.items())
        for item in v
    )


def _is_scalar(v: Any) -> bool:
    return v is None or _is_str(v) or _is_bool(v) or _is_number(v)


_Check = tuple[Callable[[Any], bool], str]
_STATE_KEYS: dict[str, _Check] = {
    "version": (_is_int, "an integer"),
    "step": (_is_str, "a step name"),
    "attempts": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "updated_at": (_is_number, "a number"),
    "last_error": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "svid_expires_at": (_is_int, "an integer"),
    "spiffe_id": (_is_str, "a string"),
    "verdict": (_is_str, "a string"),
    "joined_at": (_is_number, "a number"),
    "kubernetes_version": (_is_str, "a string"),
    "after_join": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "history": (_is_history, "a list of objects with plain values"),
}
_ERROR_KEYS: dict[str, _Check] = {
    "step": (_is_str, "a string"),
    "message": (_is_str, "a string"),
    "hint": (_is_str, "a string"),
    "permanent": (_is_bool, "true or false"),
    "at": (_is_number, "a number"),
    "reason": (_is_str, "a string"),
    "code": (_is_str, "a string"),
    "exit_status": (_is_int, "an integer"),
    "action": (_is_str, "a string"),
}
_ERROR_REQUIRED = {f.name for f in fields(LastError) if f.default is MISSING}
_AFTER_JOIN_KEYS: dict[str, _Check] = {
    "step": (_is_str, "a step name"),
    "attempts": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "last_error": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "devid_id": (_is_str, "a string"),
    "devid_expires_at": (_is_int, "an integer"),
    "devid_enrolled_at": (_is_number, "a number"),
    "devid_replaced": (_is_bool, "true or false"),
    "spire_agent_unit": (_is_str, "a string"),
    "spire_agent_started_at": (_is_number, "a number"),
    "done_at": (_is_number, "a number"),
}


def _checked(doc: Any, keys: Mapping[str, _Check], where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(doc).__name__}")
    unknown = sorted(set(doc) - set(keys))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}")
    for key, value in doc.items():
        check, wanted = keys[key]
        if not check(value):
            raise ValueError(f"{where}.{key} must be {wanted}, not {json.dumps(value)[:40]}")
    return doc


def _state_from(doc: Any) -> State:
    doc = dict(_checked(doc, _STATE_KEYS, "the state"))
    version = doc.pop("version", None)
    if version != STATE_VERSION:
        raise ValueError(f"state version {version!r} (this agent reads version {STATE_VERSION})")
    if "step" not in doc:
        raise ValueError("the state has no step")
    try:
        step = Step(doc.pop("step"))
    except ValueError:
        raise ValueError(f"unknown step (known: {', '.join(Step)})") from None
    err = doc.pop("last_error", None)
    after = doc.pop("after_join", None)
    state = State(step=step, **doc)
    state.last_error = _last_error(err, "the state's last_error")
    if after is not None:
        state.after_join = _after_join_from(after)
    return state


def _last_error(doc: Any, where: str) -> LastError | None:
    if doc is None:
        return None
    err = _checked(doc, _ERROR_KEYS, where)
    missing = sorted(_ERROR_REQUIRED - set(err))
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    return LastError(**err)


def _after_join_from(doc: Any) -> AfterJoin:
    doc = dict(_checked(doc, _AFTER_JOIN_KEYS, "the state's after_join"))
    try:
        step = AfterJoinStep(doc.pop("step", AfterJoinStep.DEVID_ENROL))
    except ValueError:
        raise ValueError(
            f"the state's after_join.step is unknown (known: {', '.join(AfterJoinStep)})"
        ) from None
    err = _last_error(doc.pop("last_error", None), "the state's after_join.last_error")
    return AfterJoin(step=step, last_error=err, **doc)


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self._dir_checked = False

    @property
    def path(self) -> Path:
        return self.dir / STATE_FILE

    @property
    def marker(self) -> Path:
        return self.dir / JOINED_MARKER

    def load(self) -> State:
        try:
            raw = read_bounded(self.path, MAX_STATE_BYTES)
        except FileNotFoundError:
            return State()
        except FileTooLargeError as exc:
            raise _bad(self.path, str(exc)) from exc
        except OSError as exc:
            raise StateError(
                f"cannot read {self.path}: {exc.strerror}", hint="check the state directory"
            ) from exc
        return State.from_json(raw, self.path)

    def _private_dir(self) -> None:
        if not self._dir_checked:
            ensure_private_dir(self.dir)
            self._dir_checked = True

    def save(self, state: State) -> None:
        self._private_dir()
        state.updated_at = time.time()
        state.history = state.history[-MAX_HISTORY:]
        write_atomic(self.path, state.to_json(), 0o600)

    def mark_joined(self) -> None:
        self._private_dir()
        write_atomic(self.marker, f"{time.time():.0f}\n".encode(), 0o644)

    def joined(self) -> bool:
        return self.marker.exists()

    @property
    def after_join_marker(self) -> Path:
        return self.dir / AFTER_JOIN_MARKER

    def mark_after_join_pending(self) -> None:
        """The stage after the join has work left: nodeagent.service runs again, even on a joined node."""
        if not self.after_join_marker.exists():
            self._private_dir()
            write_atomic(self.after_join_marker, f"{time.time():.0f}\n".encode(), 0o644)

    def clear_after_join_pending(self) -> None:
        self.after_join_marker.unlink(missing_ok=True)

    def after_join_pending(self) -> bool:
        return self.after_join_marker.exists()
