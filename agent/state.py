"""The agent's lifecycle state on disk: ``<state_dir>/state.json``, replaced atomically.

Written (write, fsync, rename) at every step change and every failure, so a
crash or a reboot resumes at the right step, and ``nodeagent status`` can say
where the agent is, what went wrong last and what to do. The ``joined`` marker
is a separate file so that the systemd unit's ``ConditionPathExists=!`` can
see it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from agent.errors import StateError
from agent.files import ensure_private_dir, write_atomic

STATE_FILE = "state.json"
JOINED_MARKER = "joined"
STATE_VERSION = 1


class Step(StrEnum):
    PREFLIGHT = "preflight"
    ATTEST = "attest"
    VERIFY = "verify"
    JOIN_REQUEST = "join_request"
    KUBEADM_JOIN = "kubeadm_join"
    JOINED = "joined"


ORDER = list(Step)


@dataclass
class LastError:
    step: str
    message: str
    hint: str
    permanent: bool
    at: float


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
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["version"] = STATE_VERSION
        doc["step"] = str(self.step)
        return json.dumps(doc, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, path: Path) -> State:
        try:
            doc = json.loads(raw)
            if doc.pop("version", None) != STATE_VERSION:
                raise ValueError("unknown state version")
            err = doc.pop("last_error", None)
            state = cls(**{**doc, "step": Step(doc["step"])})
            state.last_error = LastError(**err) if err else None
            return state
        except (ValueError, TypeError, KeyError) as exc:
            raise StateError(
                f"{path} is not a state file this agent understands: {exc}",
                hint=f"move it aside (mv {path} {path}.bad) and run again; the agent starts over",
            ) from exc


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir

    @property
    def path(self) -> Path:
        return self.dir / STATE_FILE

    @property
    def marker(self) -> Path:
        return self.dir / JOINED_MARKER

    def load(self) -> State:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return State()
        except OSError as exc:
            raise StateError(
                f"cannot read {self.path}: {exc.strerror}", hint="check the state directory"
            ) from exc
        return State.from_json(raw, self.path)

    def save(self, state: State) -> None:
        ensure_private_dir(self.dir)
        state.updated_at = time.time()
        state.history = state.history[-50:]
        write_atomic(self.path, state.to_json(), 0o600)

    def mark_joined(self) -> None:
        ensure_private_dir(self.dir)
        write_atomic(self.marker, f"{time.time():.0f}\n".encode(), 0o644)

    def joined(self) -> bool:
        return self.marker.exists()
