"""Where the agent reads the host's files from.

By default the agent reads the running system (``/``). ``--host-root DIR`` makes it
read ``/proc``, ``/sys`` (except through libudev), ``/dev``, ``/run`` and ``/var``
under ``DIR`` instead: the way to run the checks from a container that mounts the
host at ``/host``, and the way the tests point the collectors at a fixture tree.
libudev (pyudev) always reads the ``/sys`` of the running kernel, and programs
(``journalctl``, ``kubelet``, ``containerd``) are run from ``PATH``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    root: Path = Path("/")

    @property
    def is_live(self) -> bool:
        return self.root == Path("/")

    def path(self, absolute: str) -> Path:
        """``/proc/swaps`` -> ``<root>/proc/swaps``."""
        return self.root / absolute.lstrip("/")

    def read_text(self, absolute: str) -> str:
        return self.path(absolute).read_text(encoding="utf-8", errors="replace")
