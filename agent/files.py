"""Atomic, permission-safe file writes for the agent's state (write, fsync, rename)."""

from __future__ import annotations

import os
from pathlib import Path

from protocol.files import write_atomic

__all__ = ["ensure_private_dir", "write_atomic"]


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path
