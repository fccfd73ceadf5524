"""The imager's boot environment for the VM tier and ``make demo --ipxe``: locked once, built once per inputs.

Public API::

    CACHE = ~/.cache/nodetrust/imager-bootenv (tests.support.cachedirs)
    imager_bootenv(download_cache: Path | None = None) -> Path   # a folder with vmlinuz and initrd.img

``imagebuilder.bootenv`` builds it from pinned Debian packages (the lock, ``bootenv.lock.json``, is made on
first use from the packages the download cache serves) with the imager program of this checkout; the
result is kept under a key of the lock and of every file of ``imager/``, ``protocol/`` and
``imagebuilder/bootenv/``, so a change to any of them builds it again (about 30 s here).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from tests.support import cachedirs

ROOT = Path(__file__).resolve().parents[2]
CACHE = cachedirs.shared("imager-bootenv")
DOWNLOADS = cachedirs.shared("imagebuilder-downloads")


def _inputs_key(lock: Path) -> str:
    digest = hashlib.sha256(lock.read_bytes())
    for folder in ("imager", "protocol", "imagebuilder/bootenv"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def imager_bootenv(download_cache: Path | None = None) -> Path:
    """The boot environment's folder (``vmlinuz``, ``initrd.img``, ``bootenv.json``), built if needed."""
    from imagebuilder.bootenv import build, lock
    from imagebuilder.cache import Cache
    from imagebuilder.errors import BuildError

    cache = Cache(download_cache or DOWNLOADS)
    CACHE.mkdir(parents=True, exist_ok=True)
    lock_path = CACHE / "bootenv.lock.json"
    try:
        lock.load(lock_path)
    except BuildError:
        lock.lock(cache, lock_path)
    out = CACHE / _inputs_key(lock_path)
    if not (out / "bootenv.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        started = time.monotonic()
        build.build(lock_path, cache, out)
        print(f"imager boot environment built in {time.monotonic() - started:.0f} s -> {out}", flush=True)
    return out
