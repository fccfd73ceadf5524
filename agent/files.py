"""Files and folders of the agent's state: atomic writes, bounded reads, private folders.

* :func:`write_atomic` (write, fsync, rename) comes from :mod:`protocol.files`.
* :func:`read_bounded` reads a regular file of at most ``limit`` bytes, so that nothing
  is parsed before its size is known (a FIFO or a device never blocks or floods it).
* :func:`ensure_private_dir` creates a folder 0700 when it is absent. A folder that
  exists is *never* chmod'ed (it may be ``/var/lib`` or ``/tmp`` by mistake, and
  forcing its mode would break the host): one that others may write to, or that
  another user owns, is refused; one that others may read is used with a warning.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from agent.errors import StateError
from protocol.files import write_atomic

__all__ = ["FileTooLargeError", "ensure_private_dir", "read_bounded", "write_atomic"]

log = logging.getLogger(__name__)


class FileTooLargeError(ValueError):
    """A file is larger than its reader's bound (or not a regular file at all)."""


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``; :class:`FileTooLargeError` past ``limit`` bytes.

    Raises :class:`OSError` as ``open`` does (``FileNotFoundError`` included).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileTooLargeError(f"{path} is not a regular file")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileTooLargeError(f"{path} is larger than {limit} bytes")
    return data


def ensure_private_dir(path: Path, *, what: str = "state folder") -> Path:
    """Make sure ``path`` is a folder only root (or this user) can change; create it 0700 if absent."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        log.debug("created the %s %s (0700)", what, path)
        return path
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateError(
            f"cannot create the {what} {path}: {exc.strerror}",
            hint=f"create it yourself (install -d -m 0700 {path}) or point the setting elsewhere",
        ) from exc
    try:
        st = path.stat()
    except OSError as exc:
        raise StateError(f"cannot use the {what} {path}: {exc.strerror}", hint="check the path") from exc
    problem = _unsafe(st)
    if problem:
        raise StateError(
            f"the {what} {path} {problem}; the agent keeps its key and identity there",
            hint=f"give the agent a folder of its own (install -d -m 0700 {path}, or systemd's "
            "StateDirectory=/RuntimeDirectory=); the agent never changes the mode of a folder it did not create",
        )
    if st.st_mode & 0o077:
        log.warning(
            "the %s %s has mode %04o: other users can list it (the agent's files in it are 0600); "
            "chmod 0700 it if it is the agent's own folder",
            what,
            path,
            stat.S_IMODE(st.st_mode),
        )
    return path


def _unsafe(st: os.stat_result) -> str:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid not in (0, os.geteuid()):
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""
