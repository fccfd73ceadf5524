"""The installed base: what the installer leaves on the disk, cached and reused by later builds.

A build is two VM runs of one script (``cloud-init/stage.sh``, see :mod:`imagebuilder.staging`):

1. the **installer** lays out the disk, writes the OS and, in its late-command, applies the base
   plan (the definition's OS packages, the provisioning hook); it also hands the installed
   kernel and initrd to the builder on a small raw disk. The result is the **installed base**;
2. the **provisioning boot** starts that base's own kernel (no firmware, no boot loader, no
   systemd) on a QCOW2 overlay backed by the base and applies the staging plan: the installed
   Kubernetes version, the staged versions, SPIRE, OVN-Kubernetes, the agent's venv and units,
   the user, generalisation. ``qemu-img convert`` then reads overlay plus base into one
   standalone, compacted QCOW2: the image.

A **full build** runs both and stores the base here; an **incremental build** finds the base
by its key and runs only the provisioning boot. The key is the SHA-256 of everything that
shapes the base (:func:`base_material`): :data:`BASE_RECIPE`, the installer ISO's digest, the
architecture, firmware and disk size, the installer's kernel, initrd, kernel arguments and
source id, the autoinstall user-data (rendered without the per-build webhook), and the digest
of the base medium (the OS packages' debs, the pinned pip wheel, ``stage.sh``,
``provision-init.sh``, the base plan). Changing the Kubernetes versions, an artifact, the agent
or the user keeps the key; changing the ISO, the OS packages, the pip pin, the disk size, the
SSH server choice (the installer installs it or not) or the builder's base recipe changes it.

Layout under ``<cache>/bases/`` (``--base-cache`` to put it elsewhere)::

    <key>/base.qcow2       the installed base, compacted (mode 0644)
    <key>/vmlinuz          its kernel and initrd, for the provisioning boot
    <key>/initrd.img
    <key>/console.log      the installer's console, republished with every image built on the base
    <key>/base.json        the key's material, the digests of the three files, who made it and when
    <key>/last-used        touched at every use; only the KEEP most recently used bases are kept
    locks/<key>.lock       one build installs a base at a time; others wait and reuse it

Every file is re-hashed against ``base.json`` when a build uses it: a truncated or corrupted
base is removed and rebuilt, never used. That guards against damage, not against someone who
can write the cache (they could rewrite ``base.json`` too): restore this folder only from a
cache you trust as much as the build host. The manifest of every image records the base's key
and digest (``base``) and which path the build took (``build_path``).
"""

from __future__ import annotations

import calendar
import contextlib
import fcntl
import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuilder import interrupt
from imagebuilder.definition import Definition, canonical_sha256
from imagebuilder.errors import BuildError, DefinitionError
from imagebuilder.outputs import sha256_file
from imagebuilder.run import run

log = logging.getLogger(__name__)

#: Bump when the installer run changes in a way the key's other parts cannot see.
BASE_RECIPE = "1"
#: Bases kept in a cache (the most recently used); each is one installed system (about 1 to 4 GiB).
KEEP = 3
#: The raw disk the installer writes the kernel and initrd to: far smaller than any target disk.
EXPORT_SIZE = 512 * 2**20
BOOT_FILES = ("vmlinuz", "initrd.img")
#: The files of a cached base that base.json records and every use re-hashes.
BASE_FILES = ("base.qcow2", "vmlinuz", "initrd.img", "console.log")


def base_material(
    defn: Definition, *, iso_sha256: str, user_data: str, medium_digest: str
) -> dict[str, Any]:
    """Everything that shapes the installed base (the key is its canonical SHA-256)."""
    return {
        "recipe": BASE_RECIPE,
        "architecture": defn.architecture,
        "firmware": defn.firmware,
        "disk_size": defn.disk_size,
        "installer": {
            "iso_sha256": iso_sha256,
            "kernel": defn.installer.kernel,
            "initrd": defn.installer.initrd,
            "kernel_args": list(defn.installer.kernel_args),
            "source_id": defn.installer.source_id,
        },
        "user_data_sha256": canonical_sha256(user_data),
        "base_medium_sha256": medium_digest,
    }


def base_key(material: Mapping[str, Any]) -> str:
    return canonical_sha256(material)


@dataclass(frozen=True)
class Base:
    key: str
    folder: Path
    record: dict[str, Any]

    @property
    def disk(self) -> Path:
        return self.folder / "base.qcow2"

    @property
    def kernel(self) -> Path:
        return self.folder / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.folder / "initrd.img"

    @property
    def console(self) -> Path:
        return self.folder / "console.log"

    @property
    def sha256(self) -> str:
        return str(self.record["files"]["base.qcow2"]["sha256"])

    @property
    def root(self) -> str:
        return str(self.record["root"])

    @property
    def installer_started(self) -> int | None:
        """When its installer VM started (seconds, the host's clock): the earliest time any file it wrote
        can carry (:class:`imagebuilder.reproducible.TimeClamp`); None when the record does not say."""
        return installer_started(self.record)


def installer_started(record: Mapping[str, Any]) -> int | None:
    installer = record.get("installer")
    phases = installer.get("phases") if isinstance(installer, Mapping) else None
    if not isinstance(phases, list) or not phases:
        return None
    starts = []
    for phase in phases:
        started = phase.get("started_at") if isinstance(phase, Mapping) else None
        try:
            starts.append(calendar.timegm(time.strptime(str(started), "%Y-%m-%dT%H:%M:%SZ")))
        except ValueError:
            return None
    return min(starts)


class BaseCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def folder(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """One builder installs a given base at a time; a second one waits, then finds it."""
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        with (self.root / "locks" / f"{key}.lock").open("w") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another build is installing the base %s; waiting for it", key[:16])
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            yield

    def lookup(self, key: str) -> Base | None:
        """The base for ``key`` when it is complete and every file matches its digest; else None."""
        folder = self.folder(key)
        try:
            record = json.loads((folder / "base.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("the cached base %s is unreadable (%s); removing it", folder, exc)
            self.remove(key)
            return None
        if not isinstance(record, dict) or installer_started(record) is None:
            # without it the seal cannot tell the installer's time stamps from the packages' (TimeClamp)
            log.warning("the cached base %s does not record when its installer started; removing it", folder)
            self.remove(key)
            return None
        recorded = record.get("files")
        for name in BASE_FILES:  # fixed names: base.json never names a path
            expected = recorded.get(name) if isinstance(recorded, dict) else None
            if not isinstance(expected, dict):
                expected = {}
            path = folder / name
            try:
                actual, size = sha256_file(path), path.stat().st_size
            except OSError:
                actual, size = "missing", -1
            if actual != expected.get("sha256") or size != expected.get("size"):
                log.warning(
                    "the cached base %s is damaged (%s: sha256 %s, %d bytes; base.json says %s, %s bytes); "
                    "removing it: this build installs it again",
                    folder,
                    name,
                    actual,
                    size,
                    expected.get("sha256"),
                    expected.get("size"),
                )
                self.remove(key)
                return None
        (folder / "last-used").touch()
        return Base(key, folder, record)

    def store(
        self,
        key: str,
        *,
        disk: Path,
        kernel: Path,
        initrd: Path,
        console: Path,
        record: dict[str, Any],
    ) -> Base:
        """Compact ``disk`` into the cache with its boot files and console; one rename makes it visible."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{key[:16]}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            run(
                [
                    "qemu-img",
                    "convert",
                    "-O",
                    "qcow2",
                    "-o",
                    "compat=1.1",
                    str(disk),
                    str(tmp / "base.qcow2"),
                ],
                hint="qemu-img could not convert the installed disk into the base cache",
            )
            shutil.copyfile(kernel, tmp / "vmlinuz")
            shutil.copyfile(initrd, tmp / "initrd.img")
            shutil.copyfile(console, tmp / "console.log")
            files: dict[str, dict[str, Any]] = {}
            for name in BASE_FILES:
                (tmp / name).chmod(0o644)
                files[name] = {"sha256": sha256_file(tmp / name), "size": (tmp / name).stat().st_size}
            full = {**record, "key": key, "files": files}
            (tmp / "base.json").write_text(
                json.dumps(full, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
            (tmp / "last-used").touch()
            tmp.chmod(0o755)
            final = self.folder(key)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            with interrupt.deferred():
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("installed base stored: %s (%d MiB)", final, int(files["base.qcow2"]["size"]) >> 20)
        self.evict(protect=key)
        return Base(key, final, full)

    def remove(self, key: str) -> None:
        shutil.rmtree(self.folder(key), ignore_errors=True)

    def evict(self, *, keep: int = KEEP, protect: str = "") -> list[str]:
        """Remove all but the ``keep`` most recently used bases (never ``protect``)."""
        if not self.root.is_dir():
            return []
        bases = []
        for folder in self.root.iterdir():
            if folder.is_dir() and (folder / "base.json").exists():
                marker = folder / "last-used"
                used = marker.stat().st_mtime if marker.exists() else 0.0
                bases.append((used, folder.name))
        removed = []
        for _used, key in sorted(bases, reverse=True)[keep:]:
            if key != protect:
                log.info("removing the least recently used base %s", key[:16])
                self.remove(key)
                removed.append(key)
        return removed


def read_export(raw: Path, reported: Mapping[str, str] | None, out: Path) -> tuple[Path, Path]:
    """Kernel and initrd from the export disk's tar, checked against what the installer reported."""
    if not reported:
        raise BuildError(
            "the installer did not report the installed system's boot files (no NODETRUST-BOOT on the data port)",
            hint="the base plan's `export` step did not run: see the console log",
        )
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(raw, mode="r:") as archive:
            for name in BOOT_FILES:
                member = archive.getmember(name)
                handle = archive.extractfile(member) if member.isreg() else None
                if handle is None:
                    raise BuildError(f"the export disk has no regular file {name}")
                with handle, (out / name).open("wb") as fh:
                    shutil.copyfileobj(handle, fh, 1 << 20)
    except (tarfile.TarError, KeyError, OSError) as exc:
        raise BuildError(f"cannot read the boot files from the export disk {raw}: {exc}") from exc
    for name in BOOT_FILES:
        path = out / name
        actual = f"{sha256_file(path)}:{path.stat().st_size}"
        if reported.get(name) != actual:
            raise BuildError(
                f"{name} from the export disk does not match what the installer reported "
                f"({actual} instead of {reported.get(name)})",
                hint="a damaged transfer; run the build again",
            )
        path.chmod(0o644)
    return out / "vmlinuz", out / "initrd.img"


def link_into(source: Path, dest: Path) -> Path:
    """``source`` at ``dest`` for QEMU to read: a hard link when it is on the same file system and
    readable by others, else a copy (the published image or cached base is never changed)."""
    if dest.exists() and dest.samefile(source):
        return dest
    dest.unlink(missing_ok=True)
    if source.stat().st_mode & 0o004:
        try:
            os.link(source, dest)
            return dest
        except OSError:
            pass
    started = time.monotonic()
    shutil.copyfile(source, dest)
    dest.chmod(0o644)
    log.info("copied %s into the work directory (%.0f s)", source, time.monotonic() - started)
    return dest


def check_disk_size(defn: Definition) -> None:
    if defn.disk_size_bytes < 2 * EXPORT_SIZE:
        raise DefinitionError(
            f"disk_size {defn.disk_size} is too small: the target disk must be at least 1G "
            "(the installer picks the largest disk, and the builder's export disk is 512M)"
        )
