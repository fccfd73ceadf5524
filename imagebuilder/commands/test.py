"""``imagebuilder test IMAGE_OR_BUILD_DIR``: boot a built image once and check it from the inside."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from imagebuilder import boottest, interrupt
from imagebuilder.accel import boot_id, choose_accel
from imagebuilder.buildfolder import (
    MANIFEST,
    QCOW2_MEDIA_TYPE,
    boot_measurements_output,
    digests_equal,
    sha256_bytes,
)
from imagebuilder.cache import default_cache_dir
from imagebuilder.commands.options import COMMAND_OPTIONS, TABLE
from imagebuilder.errors import OutputError

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "test",
        help="boot a built image and check it from the inside",
        description=(
            "Boot the image once in a throw-away VM (UEFI, an swtpm TPM, no network route, a copy-on-write overlay: "
            "the image is never written) with a NoCloud seed whose checker reports from inside the guest: the "
            "Kubernetes version installed and held, the staged versions and every staged file (SPIRE agent, "
            "OVN-Kubernetes, ...) with its digest, the node agent's venv and its enabled unit (run at boot, stopped "
            "for want of configuration), /etc/machine-id empty and no SSH host keys in the image, cloud-init done "
            "without errors. What the image must hold comes from the build's manifest.json. `imagebuilder build` "
            "runs the same test before it publishes (unless --no-test). Exit status: 0 every check passed, 1 a "
            "check failed (or the guest reported nothing, a bad digest, a hang), other codes: the test could not "
            "run (see docs/building-images.md)."
        ),
    )
    parser.add_argument(
        "target",
        type=Path,
        metavar="IMAGE_OR_BUILD_DIR",
        help="a build folder, or a .qcow2 (see --manifest)",
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="the build's manifest.json (default: the one in the build folder, or next to the .qcow2)",
    )
    TABLE.add_arguments(parser, COMMAND_OPTIONS["test"], typed=True)
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the JSON report to PATH (never into a published build folder: its files are signed)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report on stdout instead of the text"
    )
    parser.add_argument(
        "--credentials", type=Path, default=None, metavar="FILE",
        help="a file of secrets the image must not carry, one per line (the build's: `imagebuilder build` passes its "
        "own); image/build-credentials fails naming the line, never printing the secret",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=boottest.TOTAL_S, metavar="SECONDS",
        help=f"give up on the boot after this long (default: {boottest.TOTAL_S:.0f})",
    )  # fmt: skip
    parser.set_defaults(func=run)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(
            f"{path}: no such manifest",
            hint="pass a build folder made by `imagebuilder build`, or --manifest with its manifest.json",
        ) from None
    except OSError as exc:
        raise OutputError(f"{path}: cannot read the manifest: {exc.strerror}") from exc
    except ValueError as exc:
        raise OutputError(f"{path}: the manifest is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OutputError(f"{path}: the manifest is not a JSON object")
    return data


def _image_in_folder(folder: Path, manifest: dict[str, Any]) -> Path:
    names = [
        str(o.get("name"))
        for o in manifest.get("outputs", [])
        if isinstance(o, dict) and o.get("media_type") == QCOW2_MEDIA_TYPE
    ]
    if len(names) != 1:
        raise OutputError(f"{folder / MANIFEST}: outputs must name exactly one .qcow2 image; found {names}")
    return folder / Path(names[0]).name


def resolve_target(target: Path, manifest_path: Path | None) -> tuple[Path, dict[str, Any], Path | None]:
    """``(image, manifest, build folder or None)`` for a build folder or an image file."""
    if not target.exists():
        raise OutputError(
            f"{target}: no such file or folder", hint="pass a build folder or its .qcow2 image"
        )
    folder: Path | None = None
    if target.is_dir():
        folder = target
        manifest = _read_manifest(manifest_path or target / MANIFEST)
        image = _image_in_folder(target, manifest)
        if not image.is_file():
            raise OutputError(f"{image}: the manifest's image is not in the folder")
    else:
        image = target
        path = manifest_path or target.parent / MANIFEST
        if manifest_path is None and not path.is_file():
            raise OutputError(
                f"{target}: no {MANIFEST} next to the image",
                hint="pass --manifest with the build's manifest.json",
            )
        manifest = _read_manifest(path)
        if manifest_path is None:
            folder = target.parent
    try:
        with image.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise OutputError(f"{image}: cannot read the image: {exc.strerror}") from exc
    if magic != b"QFI\xfb":
        raise OutputError(f"{image}: not a QCOW2 image", hint="pass the .qcow2 a build published")
    return image, manifest, folder


def _accel(requested: str, arch: str, cache_dir: Path) -> tuple[str, str]:
    """The build's choice: a cached probe verdict of this host boot, else a probe with the host kernel."""
    if requested != "auto":
        return choose_accel(requested, Path("/nonexistent"), arch, cache_dir)
    cached = cache_dir / f"accel-{arch}-{boot_id()}.json"
    kernels = sorted(Path("/boot").glob("vmlinuz-*"))
    if not cached.is_file() and not kernels:
        log.warning(
            "no KVM probe verdict for this host boot and no kernel in /boot to probe with: using TCG"
        )
        return "tcg", "no KVM probe verdict and no kernel to probe with"
    return choose_accel(requested, kernels[-1] if kernels else Path("/nonexistent"), arch, cache_dir)


def _check_report_path(report: Path, folder: Path | None) -> None:
    if folder is None:
        return
    if report.resolve().parent == folder.resolve():
        raise OutputError(
            f"{report}: would change the build folder {folder}, whose files SHA256SUMS and the signature cover",
            hint="write the report elsewhere (a build writes its own boot-test.json before it publishes)",
        )


MEASUREMENTS_LIMIT = 1 << 20  # a build's boot-measurements.json is a few kilobytes
CREDENTIALS_LIMIT = 64 << 10


def read_credentials(path: Path) -> dict[str, bytes]:
    """``{"<file> line N": secret}`` for each non-empty line of ``path`` (the secrets stay out of every message)."""
    try:
        with path.open("rb") as fh:
            data = fh.read(CREDENTIALS_LIMIT + 1)
    except OSError as exc:
        raise OutputError(f"--credentials {path}: cannot read it: {exc.strerror}") from exc
    if len(data) > CREDENTIALS_LIMIT:
        raise OutputError(
            f"--credentials {path}: larger than {CREDENTIALS_LIMIT >> 10} KiB: not a list of secrets"
        )
    out = {
        f"{path.name} line {n}": line.strip() for n, line in enumerate(data.splitlines(), 1) if line.strip()
    }
    short = [label for label, secret in out.items() if len(secret) < 8]
    if short:
        raise OutputError(
            f"--credentials {path}: {', '.join(short)} shorter than 8 bytes: a search for it would match by chance",
            hint="list whole secrets (tokens, passwords, keys), one per line",
        )
    return out


def _measurements(manifest: dict[str, Any], manifest_dir: Path) -> bytes | None:
    """The build's boot-measurements.json (named by the manifest, beside it), checked against the digest the
    manifest lists for it before use; None when the manifest names no boot measurements."""
    try:
        named = boot_measurements_output(manifest)
    except ValueError as exc:
        raise OutputError(
            f"{manifest_dir / MANIFEST}: {exc}", hint="pass the manifest.json the build published, unchanged"
        ) from None
    if named is None:
        return None
    name, listed = named
    path = manifest_dir / name
    try:
        with path.open("rb") as fh:
            data = fh.read(MEASUREMENTS_LIMIT + 1)
    except FileNotFoundError:
        raise OutputError(
            f"{path}: the manifest names boot measurements, and they are not beside it",
            hint="keep the build folder's files together (the boot test compares the booted image's event log "
            "with them)",
        ) from None
    except OSError as exc:
        raise OutputError(f"{path}: cannot read the boot measurements: {exc.strerror}") from exc
    if len(data) > MEASUREMENTS_LIMIT or not digests_equal(sha256_bytes(data), listed):
        raise OutputError(
            f"{path}: its SHA-256 is not the one the manifest lists: the build's boot reference was changed",
            hint="use the build folder as the build published it (`imagebuilder verify` checks it)",
        )
    return data


def run(args: argparse.Namespace) -> int:
    if args.verbose == 0:
        logging.getLogger("imagebuilder").setLevel(logging.INFO)
    image, manifest, folder = resolve_target(args.target, args.manifest)
    manifest_dir = (args.manifest or (folder or image.parent) / MANIFEST).parent
    measurements = _measurements(manifest, manifest_dir)  # verified before any VM starts
    boottest.expect_from_manifest(manifest)  # a manifest without what the test needs fails before any VM
    credentials = read_credentials(args.credentials) if args.credentials is not None else {}
    if args.report is not None:
        _check_report_path(args.report, folder)
    arch = str(manifest.get("architecture", "amd64"))
    accel, why = _accel(args.accel, arch, args.cache_dir or default_cache_dir())
    log.info("accelerator: %s (%s)", accel, why)
    work_root = args.work_dir or Path(os.environ.get("TMPDIR", "/var/tmp"))  # noqa: S108 - a private mkdtemp
    with interrupt.stop_on_signals():  # Ctrl-C and SIGTERM, even if inherited ignored, remove the VM
        verdict = boottest.run_boot_test(
            boottest.BootTestOptions(
                image=image,
                manifest=manifest,
                accel=accel,
                work_root=work_root,
                libvirt_uri=args.libvirt_uri,
                keep_work=args.keep_work,
                total_s=args.timeout,
                measurements=measurements,
                credentials=credentials,
            )
        )
    if args.report is not None:
        boottest.write_report(args.report, verdict)
    if args.json:
        print(json.dumps(verdict.to_json(), sort_keys=True))
    else:
        print(verdict.render())
    return 0 if verdict.passed else 1
