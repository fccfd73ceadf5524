"""The imager's boot environment for the VM tier and ``make demo --ipxe``: locked once, built once per inputs.

Public API::

    CACHE = ~/.cache/nodetrust/imager-bootenv (tests.support.cachedirs)
    imager_bootenv(download_cache: Path | None = None) -> Path   # a folder with vmlinuz and initrd.img
    run_in_bootenv(folder, argv) -> CompletedProcess[str]        # argv in the unpacked initrd.img, by chroot

``imagebuilder.bootenv`` builds it from pinned Debian packages and wheels (the lock, ``bootenv.lock.json``, is made on
first use from the packages the download cache serves) with the imager program of this checkout; the
result is kept under a key of the lock and of every file of ``imager/``, ``protocol/`` and
``imagebuilder/bootenv/``, so a change to any of them builds it again (about 30 s here).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
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


def run_in_bootenv(
    folder: Path, argv: Sequence[str], *, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``argv`` run inside the boot environment's own tree: ``initrd.img`` (zstd, newc cpio) unpacked into a
    temporary folder and entered with chroot, as root or in a user namespace that maps this user to root."""
    with tempfile.TemporaryDirectory(prefix="imager-bootenv-tree-") as tmp:
        tree, raw = Path(tmp) / "root", Path(tmp) / "initrd.cpio"
        tree.mkdir()
        subprocess.run(
            ["zstd", "-q", "-d", str(folder / "initrd.img"), "-o", str(raw)], check=True, timeout=timeout
        )
        with raw.open("rb") as fh:
            subprocess.run(["cpio", "-idm", "--quiet", "--no-absolute-filenames"], stdin=fh, cwd=tree, check=True,
                           timeout=timeout)  # fmt: skip
        raw.unlink()
        enter = ["chroot"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "chroot"]
        return subprocess.run(
            [*enter, str(tree), *argv], capture_output=True, text=True, timeout=timeout, check=False
        )
