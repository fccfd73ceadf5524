"""The image builder's VM tier: real builds of the fixture definition under libvirt (TCG here).

Nothing here skips. A missing piece (libvirtd, QEMU, OVMF, swtpm, the fixture installer ISO,
a host tool) fails the test with what to install or start. One VM runs at a time: before a
test boots anything it waits while another engineer's QEMU is running.

Session fixtures share the expensive parts honestly: one fixture ISO, one download cache
(``~/.cache/nodetrust/imagebuilder-downloads``: outside the checkout, so a clean clone reuses it like any CI
cache), one lock and one full build of ``examples/fixture-node.yaml``; several tests read that build's outputs.

Two payload trees (tests/support/payload_server.py), each on a server of its own:

* ``env``: the **runtime** tree (the real crictl, stand-ins for kubeadm, kubelet, kubectl and SPIRE). It needs
  only the cri-tools peer, so the session build starts while ``make test`` still builds the Kubernetes and
  SPIRE peers beside this tier: on a fresh machine the installer runs instead of waiting for them;
* ``real_env``: the **real** tree (every peer): the incremental build of the same definition, whose image the
  demo boots and joins to a real control plane. It reuses the session build's installed base (the base holds
  the definition's Debian packages, not these), which vm-tests/test_incremental.py asserts.

The tests that need the real tree run last (``pytest_collection_modifyitems``), when the peers are built.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import cachedirs  # noqa: E402
from tests.support.definitions import absolute_paths  # noqa: E402
from tests.support.payload_server import PEER_MODULES, Kind, PayloadServer, cached_payloads  # noqa: E402

EXAMPLE = REPO / "examples" / "fixture-node.yaml"
CACHE = cachedirs.shared("imagebuilder-downloads")
HOST_TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "xorriso": "xorriso",
    "dpkg-deb": "dpkg",
    "gpg": "gnupg",
    "gpgv": "gpgv",
    "debugfs": "e2fsprogs",
    "sfdisk": "fdisk",
    "swtpm": "swtpm",
    "swtpm_setup": "swtpm-tools",
    "virsh": "libvirt-clients",
}
OVMF = (Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd"))
OTHER_VM_WAIT_S = 1800


def _require_host() -> None:
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool, path=search) is None})
    if not all(p.is_file() for p in OVMF):
        missing.append("ovmf")
    if missing:
        pytest.fail(f"the image builder's VM tests need: apt-get install {' '.join(missing)}")
    if os.geteuid() != 0:
        pytest.fail("the VM tests need root (qemu:///system, the fixture ISO build)")
    if not Path("/var/run/libvirt/libvirt-sock").exists():
        pytest.fail("libvirtd is not running: start it with `scripts/services.sh start` (make vm-test does)")


def wait_for_other_vms(timeout: float = OTHER_VM_WAIT_S) -> None:
    """The machine is shared: wait while someone else's QEMU runs (one VM at a time)."""
    deadline = time.monotonic() + timeout
    while True:
        found = subprocess.run(
            ["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True, check=False
        )
        others = []
        for line in found.stdout.splitlines():
            pid, stat, comm = ([*line.split(None, 2), "", "", ""])[:3]
            # A zombie (state Z) is a QEMU that has exited and not been reaped: it holds no CPU.
            if comm.startswith("qemu-system") and not stat.startswith("Z") and int(pid) != os.getpid():
                others.append(pid)
        if not others:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"another VM (qemu pids {', '.join(others)}) kept running for {timeout:.0f} s")
        time.sleep(10)


@dataclass(frozen=True)
class Env:
    iso: Path
    payloads: PayloadServer
    cache: Path
    environ: dict[str, str]


def _peers(*modules: str) -> None:
    """Build the peers ``modules`` (all when none), or wait for ``make test``'s build of them beside this tier
    (scripts/run-tests.sh) through interop/build.sh's per-module locks; a no-op when they are built."""
    what = " ".join(modules) or "every module"
    try:
        peers = subprocess.run(
            [str(REPO / "interop" / "build.sh"), *modules],
            capture_output=True,
            text=True,
            check=False,
            timeout=3600,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"building the test peers (interop/build.sh {what}) took more than an hour")
    if peers.returncode != 0:
        pytest.fail(
            f"building the test peers (interop/build.sh {what}) failed:\n{peers.stdout[-4000:]}{peers.stderr[-4000:]}"
        )


@contextlib.contextmanager
def _served(kind: Kind, iso: Path, kernel: str, peers: tuple[str, ...]) -> Iterator[Env]:
    """The payload tree of ``kind`` on a server of its own, once ``peers`` are built or waited for (every
    module when empty)."""
    from tests.support.peers import PeerError

    _peers(*peers)
    try:
        # the NVIDIA stand-ins for the installer's kernel; the Kubernetes debs as the kind says
        root = cached_payloads(kind=kind, kernel=kernel)
    except PeerError as exc:
        pytest.fail(f"the fixture's {kind} payloads need the test peers: {exc}")
    server = PayloadServer(root)
    CACHE.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        "IMAGEBUILDER_FIXTURE_ISO": str(iso),
        "IMAGEBUILDER_PAYLOADS": server.url,
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    }
    try:
        yield Env(iso, server, CACHE, environ)
    finally:
        server.close()


@pytest.fixture(scope="session")
def installer_iso() -> tuple[Path, str]:
    """The fixture installer ISO and its kernel release (built once per recipe, cached)."""
    _require_host()
    from fixtures.installer.build import build_installer_iso
    from fixtures.installer.proc import BuildError

    try:
        built = build_installer_iso()
    except BuildError as exc:
        pytest.fail(f"building the fixture installer ISO failed: {exc}")
    return built.iso, str(built.manifest.get("kernel") or "")


@pytest.fixture(scope="session")
def env(installer_iso: tuple[Path, str]) -> Iterator[Env]:
    """The session build's payloads: the runtime tree (the cri-tools peer only)."""
    with _served("runtime", *installer_iso, PEER_MODULES["runtime"]) as served:
        yield served


@pytest.fixture(scope="session")
def real_env(installer_iso: tuple[Path, str]) -> Iterator[Env]:
    """The demo image's payloads: the real tree (every peer: waits for `make test`'s build of them)."""
    # every module: the demo needs the control plane's and spire-server's peers too, not only the tree's
    with _served("real", *installer_iso, ()) as served:
        yield served


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that need the real payload tree (every peer) last: on a fresh machine the peers are built
    beside this tier, and everything else runs meanwhile. Otherwise pytest's order is kept."""
    items.sort(key=lambda item: "real_env" in getattr(item, "fixturenames", ()))


def work_dir(tmp: Path) -> Path:
    """A work directory QEMU can reach (pytest's own temporary directories are private to root)."""
    work = Path(tempfile.mkdtemp(prefix=f"vmtest-{tmp.name}-", dir="/var/tmp"))
    work.chmod(0o755)
    return work


def imagebuilder(env: Env, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """Run the real command line, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", *args],
        cwd=REPO,
        env=env.environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def variant(tmp: Path, change: dict[str, Any]) -> Path:
    """examples/fixture-node.yaml with changes, written where the test wants it (paths made absolute)."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data = copy.deepcopy(data)
    absolute_paths(data, EXAMPLE.parent)
    for key, value in change.items():
        if key.endswith("+"):
            data[key[:-1]] = [*data.get(key[:-1], []), *value]
        else:
            data[key] = value
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def extras_source(env: Env) -> dict[str, Any]:
    return {
        "name": "fixture-extras",
        "url": env.payloads.url + "/extras/deb/",
        "flat": True,
        "keyring": str(REPO / "examples" / "keys" / "fixture-payload-signing.asc"),
    }


@dataclass(frozen=True)
class Build:
    definition: Path
    lock: Path
    out: Path
    work: Path
    folder: Path
    seconds: float
    stderr: str
    bases: Path | None = None  # the session's base cache (--base-cache): the installed base of this build
    key: Path | None = None  # the public key the build folder is signed with (imagebuilder build --key)


def domains() -> list[str]:
    out = subprocess.run(["virsh", "-c", "qemu:///system", "list", "--all", "--name"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return [name for name in out.stdout.split() if name.startswith("imagebuilder-")]


#: The VM tier's installed bases, kept across runs like the download cache: the product's own base cache,
#: keyed by everything that shapes the installed system (imagebuilder.base), three kept.
BASES = cachedirs.shared("imagebuilder-bases")


def _signing_key(folder: Path) -> tuple[Path, Path]:
    """A fresh ECDSA P-256 build key in ``folder``: (private, public)."""
    from imagebuilder.sign import generate_keypair

    private, public = generate_keypair("ecdsa-p256")
    (folder / "build.key").write_bytes(private)
    (folder / "build.key").chmod(0o600)
    (folder / "build.pub").write_bytes(public)
    return folder / "build.key", folder / "build.pub"


@pytest.fixture(scope="session")
def full_build(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Build]:
    """One lock and one build of the fixture definition, signed, shared by the tests that read its outputs.

    Its installed base comes from the machine's base cache (:data:`BASES`) when an earlier run made the same one:
    the installer runs on a cold machine, or when anything that shapes the base changed. The installer's path is
    proven on every run all the same: vm-tests/test_reproducible.py rebuilds this build with a cold base cache of
    its own and asserts the full path there, the installer error and the SIGTERM test run the installer too."""
    base = tmp_path_factory.mktemp("full-build")
    definition = variant(base, {})
    lock = base / "fixture-node.lock.json"
    locked = imagebuilder(env, "lock", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache))
    assert locked.returncode == 0, f"imagebuilder lock failed:\n{locked.stderr[-5000:]}"
    out, work = base / "out", work_dir(base)
    key, public = _signing_key(base)  # signed: vm-tests/test_reproducible.py makes a release of it
    BASES.mkdir(parents=True, exist_ok=True)
    wait_for_other_vms()
    started = time.monotonic()
    built = imagebuilder(env, "build", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache),
                         "--base-cache", str(BASES), "--out", str(out), "--work-dir", str(work),
                         "--key", str(key))  # fmt: skip
    seconds = time.monotonic() - started
    assert built.returncode == 0, f"imagebuilder build failed ({built.returncode}):\n{built.stderr[-8000:]}"
    folder = Path(built.stdout.strip().splitlines()[-1])
    path = json.loads((folder / "manifest.json").read_text())["build_path"]
    print(f"\nfixture build ({path} path: the installed base {'made now' if path == 'full' else 'from ' + str(BASES)}):"
          f" {seconds:.0f} s -> {folder}")  # fmt: skip
    try:
        yield Build(definition, lock, out, work, folder, seconds, built.stderr, BASES, public)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def incremental_build(
    real_env: Env, full_build: Build, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Build]:
    """A rebuild that changes staged artifacts only: the real tree's Kubernetes and SPIRE in place of the
    runtime tree's stand-ins, and the newest staged Kubernetes dropped. It reuses the full build's installed
    base. Built with ``--no-test``: its image is booted by the demo (vm-tests/test_demo.py), which asks far more
    of it than the boot test (attest, checks, measured boot, the real join); one boot, not two."""
    env = real_env
    base = tmp_path_factory.mktemp("incremental-build")
    kube = yaml.safe_load(full_build.definition.read_text())["kubernetes"]
    definition = variant(base, {"kubernetes": {**kube, "staged": kube["staged"][:-1]}})
    lock = base / "fixture-node.lock.json"
    locked = imagebuilder(env, "lock", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache))
    assert locked.returncode == 0, f"imagebuilder lock failed:\n{locked.stderr[-5000:]}"
    out, work = base / "out", work_dir(base)
    assert full_build.bases is not None
    key, public = _signing_key(base)  # signed, as the demo's release verifies the build first
    wait_for_other_vms()
    started = time.monotonic()
    built = imagebuilder(env, "build", str(definition), "--lock", str(lock), "--cache-dir", str(env.cache),
                         "--base-cache", str(full_build.bases), "--out", str(out), "--work-dir", str(work),
                         "--no-test", "--key", str(key))  # fmt: skip
    seconds = time.monotonic() - started
    assert built.returncode == 0, f"incremental build failed ({built.returncode}):\n{built.stderr[-8000:]}"
    folder = Path(built.stdout.strip().splitlines()[-1])
    print(f"\nincremental fixture build: {seconds:.0f} s (full: {full_build.seconds:.0f} s) -> {folder}")
    try:
        yield Build(definition, lock, out, work, folder, seconds, built.stderr, full_build.bases, public)
    finally:
        shutil.rmtree(work, ignore_errors=True)
