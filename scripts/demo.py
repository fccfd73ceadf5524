"""``make demo``: a node image built, then a racked server provisioned with it, attested, checked and joined
to a real cluster, printing each step (docs/demo.md).

1. the image: ``imagebuilder lock`` and ``build`` of ``examples/fixture-node.yaml`` (the fixture
   installer ISO and the stand-in payloads, served on the loopback), or of
   ``examples/ubuntu-2404-node.yaml`` when ``UBUNTU_ISO`` names the Ubuntu 24.04 server ISO, signed with
   a build key made for the demo; ``--image FOLDER --build-key PUB`` takes a signed build instead;
2. the rack (scripts/demo_rack.py): a network namespace with a real control plane, ``nodeserver``, the
   site NTP server and the release server;
3. the release set: ``imagebuilder release`` of the build for the ``cpu`` pool;
4. the server: a VM with UEFI firmware and a TPM whose EK certificate comes from a local EK CA;
5. with ``--ipxe``: iPXE -> the imager writes the verified image to the disk the release's hint names ->
   the firmware boots the boot entry it created (without: the image is the server's disk, the pool's
   cloud-init beside it);
6. the first boot: cloud-init writes the pool's configuration, ``nodeagent`` attests, checks, quotes the
   boot, joins with the real kubeadm, and the Node becomes Ready with the pool's labels and taint;
7. the server powered off and its disk read; 8. the verdict, from the server's audit log, the API server
   and the node's disk.

``--host-only`` runs the agent's steps on the host against the swtpm socket, without an image or a VM
(seconds instead of minutes). Everything runs from a temporary folder under /var/tmp and is stopped and
removed at the end (``--keep`` keeps the folder), even on failure, Ctrl-C or SIGTERM; libvirtd/virtlogd
are started for the image build if they are not running, and then stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from demo_common import (
    ROOT,
    WAITED,
    DemoError,
    demo_kubernetes_version,
    step,
    wait_for_other_vms,
)
from demo_host import host_chain

from tests.support import cachedirs

FIXTURE_DEFINITION = ROOT / "examples" / "fixture-node.yaml"
UBUNTU_DEFINITION = ROOT / "examples" / "ubuntu-2404-node.yaml"
# The VM tier's download cache: offline, the fixture build only works from what it holds.
DEFAULT_CACHE = cachedirs.shared("imagebuilder-downloads")


# -- the VM chain: services, image, seed, boot ------------------------------------------------------


def _qemu_user_in_kvm_group() -> None:
    """As scripts/services.sh does: QEMU's user joins /dev/kvm's group, or libvirt re-probes QEMU
    on every domain start (~100 s each). Idempotent; only before libvirtd starts."""
    import grp
    import pwd

    kvm = Path("/dev/kvm")
    try:
        user = pwd.getpwnam("libvirt-qemu")
    except KeyError:
        return
    if not kvm.exists():
        return
    group = grp.getgrgid(kvm.stat().st_gid)
    if user.pw_gid != group.gr_gid and user.pw_name not in group.gr_mem:
        subprocess.run(["/usr/sbin/usermod", "-aG", group.gr_name, user.pw_name], check=True)


@contextlib.contextmanager
def libvirt_services(work: Path) -> Iterator[None]:
    """virtlogd and libvirtd, started here only if they are not running; stopped only if started here."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    sockets = {
        "virtlogd": Path("/var/run/libvirt/virtlogd-sock"),
        "libvirtd": Path("/var/run/libvirt/libvirt-sock"),
    }
    try:
        for name, sock in sockets.items():
            running = subprocess.run(["pgrep", "-x", name], capture_output=True, check=False).returncode == 0  # noqa: S607
            if running:
                continue
            binary = Path("/usr/sbin") / name
            if not binary.exists():
                raise DemoError(f"{binary} is missing: run `make deps` (installs libvirt-daemon-system)")
            if name == "libvirtd":
                _qemu_user_in_kvm_group()
            Path("/var/run/libvirt").mkdir(parents=True, exist_ok=True)
            Path("/var/log/libvirt/qemu").mkdir(parents=True, exist_ok=True)
            with (work / f"{name}.log").open("wb") as log:
                proc = subprocess.Popen([str(binary)], stdout=log, stderr=subprocess.STDOUT)
            started.append((name, proc))
            print(f"  started {name} (pid {proc.pid}); it is stopped at the end")
            deadline = time.monotonic() + 20
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DemoError(f"{name} did not come up; its log: {work / f'{name}.log'}")
                time.sleep(0.2)
        yield
    finally:
        for name, proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            print(f"  stopped {name} (pid {proc.pid}), which the demo started")


def _definition_variant(example: Path, out: Path, iso_url: str | None) -> Path:
    """``example`` with its relative paths made absolute (and the ISO URL replaced), written to ``out``."""
    import yaml

    from tests.support.definitions import absolute_paths

    data = yaml.safe_load(example.read_text())
    absolute_paths(data, example.parent)
    if iso_url is not None:
        data["installer"]["iso"]["url"] = iso_url
        data["installer"]["iso"].pop("mirrors", None)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def check_ubuntu_iso(value: str) -> Path:
    path = Path(value).expanduser()
    hint = "set UBUNTU_ISO to the Ubuntu 24.04 live server ISO (ubuntu-24.04.4-live-server-amd64.iso), or unset it"
    if not path.is_file():
        raise DemoError(f"UBUNTU_ISO={value}: no such file; {hint} to build the fixture image")
    try:
        with path.open("rb") as fh:
            fh.seek(0x8001)
            magic = fh.read(5)
    except OSError as exc:
        raise DemoError(f"UBUNTU_ISO={value} cannot be read: {exc.strerror}; {hint}") from None
    if magic != b"CD001":
        raise DemoError(f"UBUNTU_ISO={value} is not an ISO 9660 image; {hint}")
    return path.resolve()


def imagebuilder_cmd(args: list[str], env: dict[str, str]) -> str:
    """Run ``imagebuilder ARGS``, echoing its log; return the last folder it printed (the build's)."""
    print("  $ imagebuilder " + " ".join(args), flush=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "imagebuilder.cli", *args],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    last = ""
    if proc.stdout is None:
        raise DemoError("imagebuilder has no output pipe")
    try:
        for line in proc.stdout:
            if line.strip():
                if Path(line.strip()).is_absolute() and Path(line.strip()).is_dir():
                    last = line.strip()  # the build folder, on stdout (interleaved with the log)
                print("    " + line.rstrip(), flush=True)
        rc = proc.wait()
    except BaseException:
        proc.terminate()  # the builder removes its own VM and work directory on SIGTERM
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if rc != 0:
        raise DemoError(f"imagebuilder {args[0]} failed with exit status {rc} (its messages are above)")
    return last


def build_image(
    work: Path, stack: contextlib.ExitStack, cache: Path, ubuntu_iso: str | None, *, key: Path
) -> Path:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}
    if ubuntu_iso:
        iso = check_ubuntu_iso(ubuntu_iso)
        print(f"  UBUNTU_ISO={iso}: building examples/ubuntu-2404-node.yaml (needs the Ubuntu archive)")
        definition = _definition_variant(UBUNTU_DEFINITION, work / "ubuntu-2404-node.yaml", f"file://{iso}")
    else:
        from fixtures.installer.build import build_installer_iso
        from tests.support.payload_server import PayloadServer, cached_payloads

        print("  no UBUNTU_ISO: the fixture image (a Debian-based fixture installer stands in for Ubuntu's)")
        built = build_installer_iso()
        fixture_iso = built.iso
        print(f"  fixture installer ISO: {fixture_iso}")
        # the real kubeadm, kubelet and kubectl (make peers) in the Kubernetes packages: the node joins a real cluster
        root = cached_payloads(kind="real", kernel=str(built.manifest.get("kernel") or ""))
        payloads = PayloadServer(root)
        stack.callback(payloads.close)
        print(
            f"  the payloads (real Kubernetes binaries from make peers, stand-ins for the rest) at {payloads.url}"
        )
        env.update(IMAGEBUILDER_FIXTURE_ISO=str(fixture_iso), IMAGEBUILDER_PAYLOADS=payloads.url)
        definition = _definition_variant(FIXTURE_DEFINITION, work / "fixture-node.yaml", None)
    lock = work / (definition.stem + ".lock.json")
    imagebuilder_cmd(["lock", str(definition), "--lock", str(lock), "--cache-dir", str(cache)], env)
    build = ["build", str(definition), "--lock", str(lock), "--cache-dir", str(cache),
             "--out", str(work / "out"), "--work-dir", str(work), "--key", str(key)]  # fmt: skip
    helptext = subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", "build", "--help"], cwd=ROOT, env=env,
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    if "--no-test" in helptext:
        build.append("--no-test")  # the demo boots the image itself, right after
    wait_for_other_vms()
    return Path(imagebuilder_cmd(build, env))


def image_of(folder: Path) -> tuple[Path, dict[str, Any]]:
    if not folder.is_dir():
        raise DemoError(
            f"--image {folder}: not a folder; pass a build folder published by `imagebuilder build`"
        )
    images = sorted(folder.glob("*.qcow2"))
    manifest = folder / "manifest.json"
    if len(images) != 1 or not manifest.is_file():
        raise DemoError(
            f"--image {folder}: expected one *.qcow2 and manifest.json (a folder published by `imagebuilder build`)"
        )
    return images[0], json.loads(manifest.read_text())


def vm_chain(work: Path, args: argparse.Namespace) -> int:
    from demo_rack import rack_chain

    if args.image:
        step(1, f"The image: {args.image} (--image, not built)")
        folder = Path(args.image).resolve()
        if not args.build_key:
            raise DemoError(
                "--image needs --build-key PUB: the public key the build was signed with "
                "(`imagebuilder build --key KEY`); the release verifies the build with it first"
            )
        build_pub = Path(args.build_key).resolve()
    else:
        from imagebuilder.sign import generate_keypair

        private, public = generate_keypair("ecdsa-p256")
        (work / "build.key").write_bytes(private)
        (work / "build.key").chmod(0o600)
        build_pub = work / "build.pub"
        build_pub.write_bytes(public)
        with contextlib.ExitStack() as stack:
            step(0, "Services: libvirtd and virtlogd, for the image builder's VMs")
            stack.enter_context(libvirt_services(work))
            step(1, "The image: imagebuilder lock and build, signed with a build key made for the demo")
            started = time.monotonic()
            folder = build_image(work, stack, Path(args.cache_dir), args.ubuntu_iso, key=work / "build.key")
            print(f"  built {folder} in {time.monotonic() - started:.0f} s")
    if not (folder / "signature.dsse.json").is_file():
        raise DemoError(
            f"{folder} is not signed: build it with `imagebuilder build --key KEY` (the release verifies it)"
        )
    image, manifest = image_of(folder)
    kube = manifest.get("kubernetes") or {}
    version = args.kubernetes_version or demo_kubernetes_version(kube)
    accel = args.accel or str((manifest.get("accelerator") or {}).get("name") or "tcg")
    staged = ", ".join(map(str, kube.get("staged") or [])) or "none"
    switch = (
        "the agent installs the staged packages of that version and holds them before kubeadm join"
        if version != kube.get("installed")
        else "the image's installed version"
    )
    print(f"  {image.name}: {manifest.get('name')} {manifest.get('build_id')}, {manifest.get('architecture')}; "
          f"the server boots it under {accel} (what its build used; --accel overrides)")  # fmt: skip
    print(f"  the cluster runs Kubernetes v{version}; the image installs {kube.get('installed')} and stages "
          f"{staged}: {switch}")  # fmt: skip
    return rack_chain(
        work,
        folder=folder,
        build_pub=build_pub,
        manifest=manifest,
        version=version,
        accel=accel,
        ipxe=args.ipxe,
    )


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host-only", action="store_true",
                        help="the agent's steps on the host against swtpm: no image, no VM (seconds)")  # fmt: skip
    parser.add_argument("--image", metavar="FOLDER",
                        help="boot this build folder (published and signed by `imagebuilder build --key`) instead "
                             "of building")  # fmt: skip
    parser.add_argument(
        "--build-key", metavar="PUB", help="with --image: the public key its build was signed with"
    )
    parser.add_argument("--ipxe", action="store_true",
                        help="provision the server as a racked one: iPXE -> the imager writes the verified image to "
                             "the disk the release's hint names -> the firmware boots the new entry")  # fmt: skip
    parser.add_argument("--tampered-boot", action="store_true",
                        help="with --host-only: then reboot into another command line; the re-check is refused")  # fmt: skip
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (server data, token, console, built image)")  # fmt: skip
    parser.add_argument("--accel", choices=("kvm", "tcg"), help="override the image's build accelerator")
    parser.add_argument("--kubernetes-version", metavar="X.Y.Z",
                        help="the cluster's version in the join answer (default: the image's newest staged version "
                             "of the minor below its installed one, else the installed one)")  # fmt: skip
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help=f"download cache (default {DEFAULT_CACHE})"
    )
    parser.add_argument("--ubuntu-iso", default=os.environ.get("UBUNTU_ISO") or None,
                        help="the Ubuntu 24.04 live server ISO (default $UBUNTU_ISO): build the real image")  # fmt: skip
    args = parser.parse_args()
    from tests.support.swtpm import missing_tools

    missing = missing_tools()
    if missing:
        print(
            f"demo: missing {', '.join(missing)}; run `make deps` (installs swtpm and swtpm-tools)",
            file=sys.stderr,
        )
        return 1
    if not args.host_only and os.geteuid() != 0:
        print(
            "demo: the VM chain needs root (qemu:///system); run it as root, or use --host-only",
            file=sys.stderr,
        )
        return 1
    if args.ubuntu_iso and not (args.host_only or args.image):
        try:
            args.ubuntu_iso = str(check_ubuntu_iso(args.ubuntu_iso))
        except DemoError as exc:
            print(f"demo: error: {exc}", file=sys.stderr)
            return 1
    signal.signal(signal.SIGTERM, _sigterm)
    # Under /var/tmp: QEMU (another user) must traverse to the VM's folder; nothing else is readable.
    work = Path(tempfile.mkdtemp(prefix="nodetrust-demo-", dir="/var/tmp"))
    work.chmod(0o711)
    began = time.monotonic()
    try:
        rc = host_chain(work, tampered=args.tampered_boot) if args.host_only else vm_chain(work, args)
    except DemoError as exc:
        print(f"\ndemo: error: {exc}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print("\ndemo: interrupted; cleaning up", file=sys.stderr)
        rc = 130
    except Exception as exc:
        from imagebuilder.errors import BuildError

        if not isinstance(exc, BuildError):
            raise
        print(
            f"\ndemo: error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr
        )
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if args.keep:
            print(f"demo: kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    waited = f" ({WAITED[0]:.0f} s of it waiting for other VMs)" if WAITED[0] >= 1 else ""
    print(f"demo: {time.monotonic() - began:.0f} s in all{waited}")
    return rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
