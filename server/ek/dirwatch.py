"""Cheap change detection for a directory (its mtime, inode and device).

A directory's mtime changes when entries are added, removed or renamed, which is
how operators (and Kubernetes ConfigMap/Secret volumes, which swap a ``..data``
symlink) publish new files. File systems stamp mtimes with a coarse clock, so a
change made within the same tick as our last read may leave the mtime unchanged:
a snapshot taken while the mtime is that recent is marked *racy* and the next
check reads the directory again regardless (the "racy git" rule).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_RACY_WINDOW_NS = 2_000_000_000

Signature = tuple[int, int, int]


class DirWatch:
    """Tells whether a directory may have changed since :meth:`mark` was last called."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._signature: Signature | None = None
        self._racy = True

    def current(self) -> Signature | None:
        """The directory's signature now, or None when it cannot be read (missing, not a directory)."""
        try:
            st = os.stat(self.directory)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ino, st.st_dev)

    def mark(self, signature: Signature | None) -> None:
        """Record the signature seen just before the directory was read."""
        self._signature = signature
        self._racy = signature is None or time.time_ns() - signature[0] < _RACY_WINDOW_NS

    def changed(self) -> bool:
        """True if the directory should be read again (changed, vanished, or last read was racy)."""
        return self._racy or self.current() != self._signature
