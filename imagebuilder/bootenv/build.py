"""Assembling the imager's boot environment: ``vmlinuz``, ``initrd.img`` and ``bootenv.json``.

1. Every locked ``.deb`` is fetched through the cache (its SHA-256 checked) and unpacked with
   ``dpkg-deb -x`` into one tree; no maintainer script runs.
2. The kernel comes out of ``boot/``; its modules are trimmed to
   :data:`imagebuilder.bootenv.recipe.MODULE_DIRS` (``/init`` runs ``depmod`` at boot).
3. Every locked wheel (:data:`imagebuilder.bootenv.recipe.WHEELS`: blake3) is fetched through the same
   cache, its file name's tags checked against :data:`imagebuilder.bootenv.recipe.TARGET`
   (:func:`check_wheel_tags`) and its members unpacked into the tree's ``dist-packages``
   (:func:`install_wheel`: no absolute or ``..`` path, no ``.data`` folder, no file a package installed).
4. ``nodeimager`` and the ``protocol`` package come from a wheel built from a clean export of this
   repository (:func:`imagebuilder.wheelhouse.build_agent_wheel`), unpacked into the tree's
   ``dist-packages``; the release signing keys to bake in go to ``/etc/nodeimager/keys``.
5. ``/init`` (``imagebuilder/bootenv/init.sh``) mounts the kernel's file systems and efivarfs, starts
   udev, configures the network by DHCP and runs ``python3 -m imager run``.
6. The tree becomes a newc cpio archive, sorted, every time stamp clamped to ``SOURCE_DATE_EPOCH``,
   compressed with zstd.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

from imagebuilder.bootenv import lock, recipe
from imagebuilder.buildfolder import dump_json, sha256_file, write_atomic
from imagebuilder.cache import Cache
from imagebuilder.definition import Target
from imagebuilder.errors import BuildError, LockError, OutputError
from imagebuilder.run import run
from imagebuilder.wheelhouse import ARCH_MACHINE, build_agent_wheel, platform_tags

log = logging.getLogger(__name__)

INIT = Path(__file__).with_name("init.sh.tmpl")
UDHCPC = Path(__file__).with_name("udhcpc.sh.tmpl")
REPO = Path(__file__).resolve().parents[2]
WHEEL_PACKAGES = ("imager/", "protocol/")
SITE = Path("usr/lib/python3/dist-packages")


def _unpack(debs: Sequence[Path], tree: Path) -> None:
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(tree)], timeout=600)


def _kernel(tree: Path, out: Path) -> str:
    kernels = sorted((tree / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise BuildError(f"the boot environment has {len(kernels)} kernels in boot/, not one")
    version = kernels[0].name.removeprefix("vmlinuz-")
    shutil.copyfile(kernels[0], out)
    modules = tree / "lib" / "modules" / version / "kernel"
    keep = {modules / rel for rel in recipe.MODULE_DIRS}
    for path in sorted(modules.rglob("*"), reverse=True):
        if path.is_file() and not any(path == k or k in path.parents for k in keep):
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return version


def _supported_tags(target: Target, architecture: str) -> tuple[set[tuple[str, str]], set[str]]:
    """The (python, abi) pairs and the platforms a wheel for ``target`` may name (PEP 425, PEP 600)."""
    major, minor = (int(n) for n in target.python.split("."))
    cp = target.python_tag
    pairs = {(cp, cp), (cp, "none"), (f"py{major}", "none")}
    for older in range(2, minor + 1):
        pairs |= {(f"cp{major}{older}", "abi3"), (f"py{major}{older}", "none")}
    # the platforms the lock resolved the wheel for (pip's --platform list), less the local-build tag
    local = f"linux_{ARCH_MACHINE[architecture]}"
    platforms = {"any"} | {tag for tag in platform_tags(target, architecture) if tag != local}
    return pairs, platforms


def check_wheel_tags(filename: str, target: Target, architecture: str) -> None:
    """Refuse a wheel whose file name names no tag the target's Python, glibc and machine can load:
    CPython ``cpXY`` (or ``abi3`` from an older 3.x, or pure Python) on manylinux up to the target's glibc."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise LockError(f"{filename!r} is not a wheel file name", hint=lock.RELOCK)
    pythons, abis, platforms = (set(part.split(".")) for part in parts[-3:])
    pairs, supported = _supported_tags(target, architecture)
    if not any((py, abi) in pairs for py in pythons for abi in abis) or not platforms & supported:
        raise LockError(
            f"{filename} does not fit the boot environment (CPython {target.python}, glibc {target.glibc}, "
            f"{ARCH_MACHINE[architecture]}): its tags are {parts[-3]}-{parts[-2]}-{parts[-1]}",
            hint="the lock names a wheel for another Python or platform: " + lock.RELOCK,
        )


def install_wheel(wheel: Path, site: Path) -> None:
    """Unpack a wheel's members into ``site``; refused before anything is written when a member's path is
    absolute or leaves ``site`` (``..``), is in a ``.data`` folder (scripts, headers: not installed here)
    or would replace a file that is already there (a Debian package's)."""
    with zipfile.ZipFile(wheel) as archive:
        members = archive.infolist()
        for member in members:
            name = member.filename
            path = PurePosixPath(name)
            escapes = not (site / path).resolve().is_relative_to(site.resolve())
            if not name or name.startswith("/") or "\\" in name or ".." in path.parts or escapes:
                raise BuildError(f"{wheel.name}: member {name!r} would be written outside {site}")
            if path.parts[0].endswith(".data"):
                raise BuildError(
                    f"{wheel.name}: member {name!r} is in a .data folder, which the boot environment "
                    "does not install",
                    hint="take the module from a Debian package, or a wheel with only importable files",
                )
            if not member.is_dir() and (site / path).exists():
                raise BuildError(f"{wheel.name}: member {name!r} would replace {site / path}")
        for member in members:
            archive.extract(member, site)


def _wheels(wheels: Sequence[lock.PinnedWheel], cache: Cache, tree: Path) -> None:
    site = tree / SITE
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        check_wheel_tags(wheel.filename, recipe.TARGET, recipe.ARCHITECTURE)
        fetched = cache.fetch(wheel.filename, [wheel.url], sha256=wheel.sha256, size=wheel.size)
        install_wheel(fetched.path, site)


def _imager(tree: Path, work: Path) -> tuple[str, str]:
    """Unpack imager/ and protocol/ from a clean wheel of this repository; returns (wheel, sha256)."""
    wheel, _export = build_agent_wheel(REPO, work / "wheel")
    site = tree / SITE
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith(WHEEL_PACKAGES) or ".dist-info/" in n]
        if not any(n.startswith("imager/") for n in names):
            raise BuildError(
                f"{wheel.name} holds no imager package", hint="pyproject.toml must include imager*"
            )
        for name in names:
            archive.extract(name, site)
    return wheel.name, sha256_file(wheel)


def _cpio(tree: Path, out: Path, epoch: int) -> None:
    names = ["."]
    for root, dirs, files in os.walk(tree):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(root) / name
            os.utime(path, (epoch, epoch), follow_symlinks=False)
            names.append(str(path.relative_to(tree)))
    os.utime(tree, (epoch, epoch))
    listing = ("\n".join(sorted(names)) + "\n").encode()
    raw = out.with_suffix(".cpio")
    with raw.open("wb") as fh:
        result = run(["cpio", "-o", "-H", "newc", "--quiet", "--reproducible", "-R", "0:0"], input_bytes=listing,
                     cwd=tree, timeout=1800)  # fmt: skip
        fh.write(result.stdout)
    run(["zstd", "-q", "-f", "-10", "-T0", "--rm", str(raw), "-o", str(out)], timeout=1800)


def build(lock_path: Path, cache: Cache, out: Path, *, keys: Sequence[Path] = ()) -> dict[str, Any]:
    """Build the boot environment into ``out`` (a folder: vmlinuz, initrd.img, bootenv.json)."""
    locked = lock.load(lock_path)
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "1764547200"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imager-bootenv-", dir=out.parent) as tmp:
        work = Path(tmp)
        tree = work / "root"
        tree.mkdir()
        debs = [cache.fetch(p.name, [p.url], sha256=p.sha256, size=p.size).path for p in locked.packages]
        _unpack(debs, tree)
        version = _kernel(tree, work / "vmlinuz")
        for rel in recipe.DROP:
            shutil.rmtree(tree / rel, ignore_errors=True)
        _wheels(locked.wheels, cache, tree)
        wheel, wheel_sha = _imager(tree, work)
        keys_dir = tree / "etc" / "nodeimager" / "keys"
        keys_dir.mkdir(parents=True)
        for key in keys:
            shutil.copyfile(key, keys_dir / key.name)
        for path, source, mode in (
            (tree / "init", INIT, 0o755),
            (tree / "etc" / "nodeimager" / "udhcpc.sh", UDHCPC, 0o755),
        ):
            shutil.copyfile(source, path)
            path.chmod(mode)
        for name in ("proc", "sys", "dev", "run", "tmp", "mnt"):
            (tree / name).mkdir(exist_ok=True)
        _cpio(tree, work / "initrd.img", epoch)
        for name in ("vmlinuz", "initrd.img"):
            shutil.move(work / name, out / name)
    initrd_size = (out / "initrd.img").stat().st_size
    manifest: dict[str, Any] = {
        "schema": "https://nodetrust.dev/imager-bootenv/v1",
        "kernel": {
            "name": "vmlinuz",
            "version": version,
            "sha256": sha256_file(out / "vmlinuz"),
            "size": (out / "vmlinuz").stat().st_size,
        },
        "initrd": {
            "name": "initrd.img",
            "sha256": sha256_file(out / "initrd.img"),
            "size": initrd_size,
        },
        "imager": {"wheel": wheel, "sha256": wheel_sha},
        "keys": [{"name": k.name, "sha256": hashlib.sha256(k.read_bytes()).hexdigest()} for k in keys],
        "packages": [asdict(p) for p in locked.packages],
        "wheels": [
            {"name": w.name, "version": w.version, "filename": w.filename, "sha256": w.sha256}
            for w in locked.wheels
        ],
        "lock_sha256": sha256_file(lock_path),
    }
    try:
        write_atomic(out / "bootenv.json", dump_json(manifest))
    except OSError as exc:
        raise OutputError(f"{out}: cannot write bootenv.json: {exc.strerror}") from None
    log.info("imager boot environment: kernel %s, initrd %d bytes", version, initrd_size)
    return manifest
