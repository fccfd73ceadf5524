"""The EK hash allowlist: a directory of files named by an EK's public-key hash.

The name is the lowercase hex SHA-256 of the EK SubjectPublicKeyInfo DER (the
agent ID suffix); the content is ignored, as in spire-tpm-plugin. A missing
directory at run time means "nothing is listed" (fail closed).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from server.ek.dirwatch import DirWatch

log = logging.getLogger(__name__)

_HASH_NAME = re.compile(r"[0-9a-f]{64}")


class HashAllowlist:
    """The set of listed hashes, re-read when the directory changes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._hashes: frozenset[str] = frozenset()
        self._warned: set[str] = set()
        self._watch = DirWatch(directory)
        self._lock = threading.Lock()
        self.generation = 0

    def __len__(self) -> int:
        return len(self._hashes)

    def contains(self, ek_hash: str) -> bool:
        """Whether ``ek_hash`` is listed; a miss checks the directory itself, so new files count at once."""
        if ek_hash in self._hashes:
            return True
        if not _HASH_NAME.fullmatch(ek_hash):
            return False
        return (self.directory / ek_hash).is_file()

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the directory if it changed (or ``force``); returns True if it was read."""
        if not force and not self._watch.changed():
            return False
        if not self._lock.acquire(blocking=force):
            return False  # another thread is reading it; keep serving the current set
        try:
            signature = self._watch.current()
            hashes = self._read()
            self._watch.mark(signature)
            if hashes != self._hashes:
                log.info("EK hash allowlist %s: %d hashes listed", self.directory, len(hashes))
                self._hashes = hashes
                self.generation += 1
            return True
        finally:
            self._lock.release()

    def _read(self) -> frozenset[str]:
        found: set[str] = set()
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            log.error("EK hash allowlist %s cannot be read (%s): no EK hash is trusted", self.directory, exc)
            return frozenset()
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue  # dotfiles, and the ..data links of Kubernetes volumes
            if not _HASH_NAME.fullmatch(name):
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "EK hash allowlist %s: ignoring %r: a file name must be the 64 lowercase hex "
                        "characters of the EK public-key SHA-256",
                        self.directory,
                        name,
                    )
                continue
            try:
                regular = entry.is_file(follow_symlinks=True)
            except OSError:
                regular = False
            if not regular:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "EK hash allowlist %s: ignoring %r: not a regular file", self.directory, name
                    )
                continue
            found.add(name)
        return frozenset(found)
