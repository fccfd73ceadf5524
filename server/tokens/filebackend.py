"""The file token backend: one Secret manifest per token, for ``kubectl apply`` in air-gapped labs.

Public API::

    class FileBackend:                  # satisfies server.tokens.backend.TokenBackend
        name = "file"
        def __init__(self, directory: Path) -> None
        def path_for(self, token_id: str) -> Path    # <directory>/bootstrap-token-<id>.yaml
        def check(self) -> None        # creates the folder 0700 if missing; refuses a shared or unwritable one
        def create(self, token: BootstrapToken) -> str   # the file's path
        def delete(self, token_id: str, backend_ref: str) -> None   # missing file is fine

Each file is written atomically (temporary file, fsync, rename) with mode 0600 and
holds the token secret: the folder must stay private to the nodeserver's user.
An operator (or a sync job) applies the files to the cluster; the server removes
a file when its token is replaced, used up or expired. ``backend_ref`` is only
informational: the file deleted is always the one derived from ``token_id``, so a
tampered store row cannot make the server delete anything outside the folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

import yaml

from protocol.files import write_atomic
from server.errors import ConfigError, TokenBackendError, TokenConflictError
from server.tokens.token import BootstrapToken, secret_manifest, secret_name

log = logging.getLogger(__name__)

_HEADER = (
    "# A kubeadm bootstrap token written by nodeserver (token backend 'file').\n"
    "# It holds a secret: apply it with `kubectl apply -f <this file>` and keep the folder private.\n"
    "# nodeserver deletes this file when the token is replaced or expires.\n"
)


class FileBackend:
    name = "file"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"FileBackend(directory={str(self.directory)!r})"

    def path_for(self, token_id: str) -> Path:
        return self.directory / f"{secret_name(token_id)}.yaml"

    def check(self) -> None:
        where = f"token_backend.directory {self.directory}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = self.directory.stat()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot create it ({exc.strerror})") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{where}: exists and is not a folder")
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"{where}: owned by uid {st.st_uid}, not by the nodeserver (uid {os.geteuid()})"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{where}: mode {mode:04o} lets other users read bootstrap tokens; run: chmod 700 {self.directory}"
            )
        probe = self.directory / f".probe-{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
        except OSError as exc:
            raise ConfigError(f"{where}: not writable by the nodeserver ({exc.strerror})") from exc
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        log.info("token backend file: writing bootstrap-token Secrets to %s", self.directory)

    def create(self, token: BootstrapToken) -> str:
        path = self.path_for(token.token_id)
        if path.exists():
            raise TokenConflictError(f"{path} already exists: mint a new token and retry")
        data = _HEADER + yaml.safe_dump(secret_manifest(token), sort_keys=False, default_flow_style=False)
        try:
            write_atomic(path, data.encode(), mode=0o600)
        except OSError as exc:
            raise TokenBackendError(f"cannot write {path}: {exc.strerror}") from exc
        log.info("wrote bootstrap token %s to %s", token.token_id, path)
        return str(path)

    def delete(self, token_id: str, backend_ref: str) -> None:
        try:
            path = self.path_for(token_id)
        except ValueError as exc:
            raise TokenBackendError(f"cannot delete a token with a malformed id {token_id!r}") from exc
        if backend_ref and backend_ref != str(path):
            log.warning(
                "token %s: backend_ref %r is not %s; deleting the latter", token_id, backend_ref, path
            )
        try:
            path.unlink()
        except FileNotFoundError:
            log.debug("bootstrap token file %s was already gone", path)
            return
        except OSError as exc:
            raise TokenBackendError(f"cannot delete {path}: {exc.strerror}") from exc
        log.info("deleted bootstrap token %s (%s)", token_id, path)
