"""The live CA directory: the current :class:`CaStore` snapshot and when to replace it.

Readers take ``self.store`` (an immutable snapshot) without locking; a reload
builds a new snapshot and swaps it in, bumping the generation so cached
verification results of the old one are never reused. The directory is read
again only when its mtime changes (or a listing fingerprint of names, sizes and
mtimes differs after a racy mtime), never per attestation.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from server.ek.dirwatch import DirWatch
from server.ek.store import CaStore

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int], ...]


class CaDirectory:
    def __init__(self, directory: Path, *, lenient: bool) -> None:
        self.directory = directory
        self.lenient = lenient
        self._watch = DirWatch(directory)
        self._lock = threading.Lock()
        signature = self._watch.current()
        self._fingerprint = self._listing()
        self.store = CaStore.load(directory, generation=1, lenient=lenient)
        self._watch.mark(signature)

    def refresh(self, *, force: bool = False) -> bool:
        """Reload if the directory changed (or ``force``); True if a new snapshot was installed."""
        if not force and not self._watch.changed():
            return False
        if not self._lock.acquire(blocking=force):
            return False  # another thread is reloading; keep serving the current snapshot
        try:
            signature = self._watch.current()
            fingerprint = self._listing()
            if not force and fingerprint == self._fingerprint:
                self._watch.mark(signature)
                return False
            store = CaStore.load(self.directory, generation=self.store.generation + 1, lenient=self.lenient)
            self._watch.mark(signature)
            self._fingerprint = fingerprint
            self.store = store
            return True
        finally:
            self._lock.release()

    def _listing(self) -> Fingerprint | None:
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return None
        out: list[tuple[str, int, int]] = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError:
                continue
            out.append((entry.name, st.st_size, st.st_mtime_ns))
        return tuple(sorted(out))
