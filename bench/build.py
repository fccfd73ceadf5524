"""Full versus incremental image builds of the fixture definition: the issue's target is incremental <= 0.25 x full.

Two real ``imagebuilder build`` runs (the command line, as a user runs it) of examples/fixture-node.yaml,
in the VM tier's environment (the fixture installer ISO, the loopback payload server, the shared
download cache ``~/.cache/nodetrust/imagebuilder-downloads``), with a private base cache:

1. **full**: ``--full`` (the installer runs, its result is cached as the installed base, then the
   provisioning boot and the convert);
2. **incremental**: the same definition with one staged Kubernetes version fewer (only staged
   artifacts change; its own lock), which reuses the installed base: no installer run.

Printed for each: the wall time of the whole command, every phase from its manifest, the time in VMs
(the installer, the provisioning boot, the boot test if the builder runs one) against the time on the
host; then the ratio incremental / full, and the image size against the installed content size
(``installed_size``: used bytes of the sealed root file system). Then the cost of the seal, what makes
the image reproducible (docs/reproducible.md): its steps inside the provisioning VM (from the console's
uptime stamps of the staging plan's ``identify`` step and of ``bolt`` through the scrub to the plan's end)
plus the ``seal`` phase on the host, against the rest of the full build (the issue's goal: at most 10 %
more).

    .venv/bin/python -m bench.build [--boot-test] [--work-dir /var/tmp]

Root, libvirtd and the VM tier's host packages are needed (see vm-tests/conftest.py). One VM runs at
a time: the benchmark waits while another QEMU runs. A few minutes under TCG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import cachedirs  # noqa: E402
from tests.support.payload_server import PayloadServer, cached_payloads  # noqa: E402

EXAMPLE = ROOT / "examples" / "fixture-node.yaml"
CACHE = cachedirs.shared("imagebuilder-downloads")
TARGET_RATIO = 0.25
SEAL_TARGET = 0.10  # the seal may add at most this much to a full build
_STAMP = re.compile(r"nodetrust-stage: \[([0-9.]+)s\] (identify:|boot loader:|bolt: canonical|done)")
#: Phases that are a VM running (the rest of the wall time is the host: checks, fetch, wheels, media,
#: qemu-img, the base store, hashing and the trust outputs).
VM_PHASES = ("install", "provision", "boot-test")


@dataclass
class Run:
    label: str
    seconds: float
    manifest: dict[str, Any]
    folder: Path

    def seal_in_vm(self) -> float:
        """Seconds of the seal's steps inside the provisioning VM (identify; bolt, scrub and shadow to the plan's
        end), from the console's uptime stamps of the provisioning boot."""
        text = (self.folder / "console.log").read_text(encoding="utf-8", errors="replace")
        text = text[text.find("==== the provisioning boot") :]
        stamps = {m[2]: float(m[1]) for m in _STAMP.finditer(text)}
        if len(stamps) < 4:
            return 0.0
        return (stamps["boot loader:"] - stamps["identify:"]) + (stamps["done"] - stamps["bolt: canonical"])

    def phase(self, name: str) -> float:
        return sum(float(p["duration_s"]) for p in self.manifest["phases"] if p["name"] == name)

    @property
    def vm_seconds(self) -> float:
        return sum(self.phase(name) for name in VM_PHASES)

    @property
    def image_size(self) -> int:
        image = next(o for o in self.manifest["outputs"] if o["name"].endswith(".qcow2"))
        return int(image["size"])


def definition(tmp: Path, *, drop_newest_staged: bool) -> Path:
    from tests.support.definitions import absolute_paths

    data = yaml.safe_load(EXAMPLE.read_text())
    absolute_paths(data, EXAMPLE.parent)
    if drop_newest_staged:
        data["kubernetes"]["staged"] = data["kubernetes"]["staged"][:-1]
    folder = tmp / ("incremental" if drop_newest_staged else "full")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def imagebuilder(environ: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )


def wait_for_other_vms() -> None:
    while True:
        found = subprocess.run(["pgrep", "-f", "qemu-system"], capture_output=True, text=True, check=False)
        if not found.stdout.split():
            return
        print(f"waiting: another VM runs (qemu pids {' '.join(found.stdout.split())})", flush=True)
        time.sleep(10)


def build(label: str, environ: dict[str, str], defn: Path, work: Path, bases: Path, extra: list[str]) -> Run:  # noqa: PLR0917
    lock = defn.with_suffix(".lock.json")
    locked = imagebuilder(environ, "lock", str(defn), "--lock", str(lock), "--cache-dir", str(CACHE))
    if locked.returncode != 0:
        raise SystemExit(f"imagebuilder lock failed:\n{locked.stderr[-5000:]}")
    wait_for_other_vms()
    started = time.monotonic()
    built = imagebuilder(environ, "build", str(defn), "--lock", str(lock), "--cache-dir", str(CACHE),
                         "--base-cache", str(bases), "--out", str(defn.parent / "out"),
                         "--work-dir", str(work), *extra)  # fmt: skip
    seconds = time.monotonic() - started
    if built.returncode != 0:
        raise SystemExit(f"the {label} build failed ({built.returncode}):\n{built.stderr[-8000:]}")
    folder = Path(built.stdout.strip().splitlines()[-1])
    manifest = json.loads((folder / "manifest.json").read_text())
    return Run(label, seconds, manifest, folder)


def _mib(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def report(full: Run, incremental: Run) -> None:
    for run in (full, incremental):
        m = run.manifest
        print(
            f"\n{run.label} build ({m['build_path']}, base {m['base']['key'][:16]}): {run.seconds:.1f} s wall"
        )
        for p in m["phases"]:
            print(f"  {p['name']:<24} {float(p['duration_s']):7.1f} s")
        vm = run.vm_seconds
        print(f"  in VMs {vm:.1f} s ({vm / run.seconds:.0%}), on the host {run.seconds - vm:.1f} s "
              f"({1 - vm / run.seconds:.0%})")  # fmt: skip
        installed = m.get("installed_size") or 0
        print(f"  image {_mib(run.image_size)} (compressed: {m['image']['compressed']}), installed content "
              f"{_mib(installed)}: {run.image_size / installed:.2f} x" if installed else "")  # fmt: skip
    ratio = incremental.seconds / full.seconds
    print(f"\nincremental / full: {incremental.seconds:.1f} / {full.seconds:.1f} s = {ratio:.3f} "
          f"(target <= {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'NOT met'})")  # fmt: skip
    print(f"installed base: {_mib(full.manifest['base']['size'])} (cached, reused by the incremental build)")
    for run in (full, incremental):
        in_vm, host = run.seal_in_vm(), run.phase("seal")
        cost = in_vm + host
        rest = run.seconds - cost
        print(f"\nseal of the {run.label} build: in the VM {in_vm:.1f} s + on the host {host:.1f} s "
              f"= {cost:.1f} s; the rest of the build {rest:.1f} s: +{cost / rest:.1%} "
              f"(goal <= {SEAL_TARGET:.0%}: {'met' if cost / rest <= SEAL_TARGET else 'NOT met'})")  # fmt: skip
    accel = full.manifest["accelerator"]
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, accelerator {accel['name']} ({accel['why']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--boot-test", action="store_true", help="keep the builder's boot test in both builds"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp"))  # noqa: S108 - QEMU must reach it
    args = parser.parse_args()
    from fixtures.installer.build import build_installer_iso

    iso = build_installer_iso().iso
    server = PayloadServer(cached_payloads(kind="stand-in"))
    CACHE.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        "IMAGEBUILDER_FIXTURE_ISO": str(iso),
        "IMAGEBUILDER_PAYLOADS": server.url,
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    }
    extra = []
    help_text = imagebuilder(environ, "build", "--help").stdout
    if "--no-test" in help_text and not args.boot_test:
        extra.append("--no-test")
    tmp = Path(tempfile.mkdtemp(prefix="bench-build-", dir=args.work_dir))
    tmp.chmod(0o755)
    try:
        work, bases = tmp / "work", tmp / "bases"
        work.mkdir()
        work.chmod(0o755)
        full = build(
            "full", environ, definition(tmp, drop_newest_staged=False), work, bases, [*extra, "--full"]
        )
        incremental = build(
            "incremental", environ, definition(tmp, drop_newest_staged=True), work, bases, extra
        )
        if extra:
            print("(both builds with --no-test: the boot test is measured by the VM tier, not here)")
        report(full, incremental)
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
