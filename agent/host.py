"""Where the agent reads the host's files from.

By default the agent reads the running system (``/``). ``--host-root DIR`` makes it
read ``/proc``, ``/sys`` (except through libudev), ``/dev``, ``/run`` and ``/var``
under ``DIR`` instead: the way to run the checks from a container that mounts the
host at ``/host``, and the way the tests point the collectors at a fixture tree.
libudev (pyudev) always reads the ``/sys`` of the running kernel, and programs
(``journalctl``, ``kubelet``, ``containerd``) are run from ``PATH``.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

from agent.files import FileTooLargeError, read_bounded

# /proc and /sys files are small; the largest the checks read (/proc/net/fib_trie of a big routing
# table) stays far below this. A fixture tree or a container mount could hold anything.
MAX_HOST_FILE_BYTES = 16 * 1024 * 1024


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
        """The text of a host file, bounded; too large or not a regular file is an :class:`OSError`."""
        path = self.path(absolute)
        try:
            data = read_bounded(path, MAX_HOST_FILE_BYTES)
        except FileTooLargeError as exc:
            raise OSError(errno.EFBIG, str(exc), str(path)) from exc
        return data.decode("utf-8", errors="replace")
