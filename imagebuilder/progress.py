"""Machine-readable progress of a build: one JSON object per line, appended as the build moves on.

``imagebuilder build --progress FILE`` writes, besides its human log on stderr::

    {"build_id": "...", "event": "start", "phase": "fetch", "run_id": "...-3f2a1b", "time": 1764620000.123}
    {"build_id": "...", "duration_s": 1.2, "event": "end", "outcome": "ok", "phase": "fetch", "time": ...}
    {"build_id": "...", "event": "start", "phase": "install/boot", "time": ...}
    ...
    {"build_id": "...", "event": "result", "outcome": "published", "folder": "out/<build-id>", "time": ...}

* ``start`` / ``end`` for each phase of the build (``check``, ``fetch``, ``wheelhouse``, ``media``,
  ``base``, ``installer-media``, ``accelerator``, ``install``, ``base-store``, ``provision``,
  ``image``, ``boot-test``); ``end`` carries ``duration_s`` and ``outcome`` (``ok``, ``failed`` or
  ``interrupted``);
* ``start`` for each phase of a build VM, named as in the manifest: ``install/boot``,
  ``install/install``, ``install/late``, ``install/shutdown`` (the installer), ``provision/boot``,
  ``provision/stage``, ``provision/shutdown`` (the provisioning boot). ``install/boot`` and
  ``provision/boot`` start once the VM is defined and running;
* ``build_id`` names the build (the same for every build of one lock: its folder's name); ``run_id`` names
  this run of it (``<build_id>-<6 hex digits>``): its VMs are the libvirt domains ``imagebuilder-<run_id>``;
* one ``result`` at the end: ``published`` (with ``folder``), ``failed`` (with ``exit_code``) or
  ``interrupted``.

Each line is written with one ``write`` on a file opened for appending, so a reader that polls the
file never sees half a line of it. Keys are sorted; new keys may be added, none removed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from imagebuilder.errors import OutputError

log = logging.getLogger(__name__)


class ProgressLog:
    """Appends progress events to ``path``; with ``path`` None it only keeps the build id."""

    def __init__(self, path: Path | None, build_id: str, run_id: str = "") -> None:
        self.path = path
        self.build_id = build_id
        self.run_id = run_id or build_id
        self._fd: int | None = None
        self._broken = False
        if path is not None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise OutputError(
                    f"--progress {path}: cannot open it for appending: {exc.strerror}",
                    hint="name a file in a folder that exists and that this user may write",
                ) from exc

    def emit(self, event: str, phase: str = "", **fields: Any) -> None:
        if self._fd is None or self._broken:
            return
        record: dict[str, Any] = {
            "build_id": self.build_id,
            "event": event,
            "run_id": self.run_id,
            "time": round(time.time(), 3),
        }
        if phase:
            record["phase"] = phase
        record.update(fields)
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        try:
            os.write(self._fd, line)
        except OSError as exc:
            self._broken = True
            log.warning(
                "--progress %s: cannot write (%s); no further progress lines", self.path, exc.strerror
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
