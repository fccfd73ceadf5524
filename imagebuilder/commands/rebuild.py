"""``imagebuilder rebuild FOLDER``: build a published image again from its definition and lock, and compare.

FOLDER is a build folder (``manifest.json``) or a release folder (``release.json``), verified first with the
publisher's public key (``--key``: the build's signature and every file's digest, or the release's as the
imager reads it): the digests compared are the ones the publisher signed, never ones read from a folder
that anyone could have edited. The definition and
the lock must be the ones the build used: by default the paths its manifest records, else
``--definition`` and ``--lock``; their digests are checked against the manifest (a release names the
build id, which names the lock) before anything is built. The rebuild is a full build (the installer
runs, with a base cache of its own: nothing of this machine's caches but verified downloads) into a
folder of its own, without a boot test unless ``--boot-test``. Then:

* the image's digest (and for a build folder the boot measurements, the SBOM, and the manifest and
  provenance without the fields that record the run, :mod:`imagebuilder.reprocheck`);
* on a different image: what differs inside (:mod:`imagebuilder.imagediff`): the partition table, the
  file systems' metadata, which files with which kind of change;
* the host tools whose versions differ from the published manifest's (an explanation, not a verdict).

Exit status: 0 the same, 1 something differs (the report says what), other codes: the rebuild could not
run (the build's own, docs/building-images.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder import interrupt
from imagebuilder.buildfolder import MANIFEST, QCOW2_MEDIA_TYPE
from imagebuilder.cache import default_cache_dir
from imagebuilder.commands.options import COMMAND_OPTIONS, TABLE
from imagebuilder.errors import LockError, OutputError
from imagebuilder.outputs import sha256_file

log = logging.getLogger(__name__)

RELEASE_MANIFEST = "release.json"
MAX_JSON = 64 << 20


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rebuild",
        help="build a published image again from its definition and lock, and compare",
        description=(
            "Verify a build folder or a release folder with its publisher's key (--key), then rebuild it from the "
            "definition and lock it was built from (a full "
            "build, its own base cache, no boot test unless --boot-test) and compare: the image's digest, the boot "
            "measurements, the SBOM, the manifest and provenance except the fields that record the run. On a "
            "different image it names what differs: the partition table, file-system metadata, which files with "
            "which kind of change. Exit status 0: the same; 1: something differs; other: the rebuild could not run. "
            "docs/reproducible.md."
        ),
    )
    parser.add_argument("folder", type=Path, metavar="FOLDER", help="a build folder or a release folder")
    parser.add_argument("--key", required=True, type=Path, metavar="PUB",
                        help="the publisher's public key: the build's (imagebuilder build --key) for a build folder, "
                             "the release's (imagebuilder release --key) for a release folder; checked first")  # fmt: skip
    parser.add_argument("--definition", type=Path, default=None,
                        help="the definition it was built from (default: the path its manifest records)")  # fmt: skip
    TABLE.add_arguments(parser, COMMAND_OPTIONS["rebuild"], typed=True)
    parser.add_argument(
        "--out", type=Path, default=None,
        help="keep the rebuilt folder here (default: a temporary folder, removed after the comparison)",
    )  # fmt: skip
    parser.add_argument("--boot-test", action="store_true", help="boot the rebuilt image as a build does")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    parser.set_defaults(func=run)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_JSON + 1)
        data = json.loads(raw)
    except FileNotFoundError:
        raise OutputError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: not readable JSON: {exc}") from exc
    if len(raw) > MAX_JSON or not isinstance(data, dict):
        raise OutputError(f"{path}: not a JSON object of at most {MAX_JSON >> 20} MiB")
    return data


@dataclass
class Published:
    """What the folder says was built: the image's name and digest, and for a build folder its manifest."""

    folder: Path
    kind: str  # build | release
    build_id: str
    image: str
    image_sha256: str
    manifest: dict[str, Any] = field(default_factory=dict)
    measurements_sha256: str = ""


def read_published(folder: Path) -> Published:
    if (folder / MANIFEST).is_file():
        manifest = _read_json(folder / MANIFEST)
        images = [
            o
            for o in manifest.get("outputs", [])
            if isinstance(o, dict) and o.get("media_type") == QCOW2_MEDIA_TYPE
        ]
        if len(images) != 1:
            raise OutputError(f"{folder / MANIFEST}: outputs must name exactly one .qcow2 image")
        named = (manifest.get("boot_measurements") or {}).get("file", "")
        measured = next((o["sha256"] for o in manifest.get("outputs", []) if o.get("name") == named), "")
        return Published(folder, "build", str(manifest.get("build_id", "")), str(images[0]["name"]),
                         str(images[0]["sha256"]), manifest, str(measured))  # fmt: skip
    if (folder / RELEASE_MANIFEST).is_file():
        release = _read_json(folder / RELEASE_MANIFEST)
        build, images = release.get("build") or {}, release.get("images") or []
        qcow2 = next((i for i in images if isinstance(i, dict) and i.get("format") == "qcow2"), None)
        if not isinstance(build, dict) or qcow2 is None:
            raise OutputError(f"{folder / RELEASE_MANIFEST}: no build or qcow2 image listed")
        measured = str((release.get("boot_measurements") or {}).get("sha256", ""))
        return Published(folder, "release", str(build.get("build_id", "")), str(qcow2["name"]), str(qcow2["sha256"]),
                         measurements_sha256=measured)  # fmt: skip
    raise OutputError(
        f"{folder}: neither a build folder ({MANIFEST}) nor a release folder ({RELEASE_MANIFEST})",
        hint="pass the folder `imagebuilder build` or `imagebuilder release` published",
    )


def verify_published(published: Published, key: Path) -> None:
    """The folder's signature by ``key`` and every digest it lists, before any of them is trusted
    (:class:`VerificationError` names the first that does not match)."""
    from imagebuilder.sign import load_public_key

    public = load_public_key(key)
    if published.kind == "build":
        from imagebuilder.verify import verify_build

        verify_build(published.folder, public)
    else:
        from imagebuilder.release.folder import verify_release

        verify_release(published.folder, public)
    log.info("%s: verified with %s", published.folder, key)


def _inputs(args: argparse.Namespace, published: Published) -> tuple[Path, Path]:
    """The definition and lock to rebuild from, checked against what the folder records."""
    recorded = published.manifest
    definition = args.definition or (Path(recorded["definition"]["path"]) if recorded else None)
    lock = args.lock or (Path(recorded["lock"]["path"]) if recorded else None)
    if definition is None or lock is None:
        raise OutputError(
            f"{published.folder} is a release: it does not record where its definition and lock are",
            hint="pass --definition and --lock (from the repository at the release's commit)",
        )
    for what, path in (("definition", definition), ("lock", lock)):
        if not path.is_file():
            raise OutputError(
                f"the {what} {path} does not exist", hint=f"pass --{what} with the published build's {what}"
            )
    if recorded:
        for what, path in (("definition", definition), ("lock", lock)):
            if sha256_file(path) != recorded[what]["sha256"]:
                raise LockError(
                    f"{path} is not the {what} the published build used (its sha256 is not {recorded[what]['sha256']})",
                    hint=f"use the {what} of the build (the repository at the build's commit)",
                )
    return definition, lock


def _agent_source_note(published: Published) -> str:
    source = (published.manifest.get("agent") or {}).get("source") or {}
    modified = source.get("modified") or []
    if modified:
        return (f"the published agent was built from {len(modified)} modified file(s) at commit "
                f"{str(source.get('commit', '?'))[:12]}: a rebuild matches only with the same changes")  # fmt: skip
    return ""


def compare(published: Published, rebuilt_folder: Path, work: Path) -> dict[str, Any]:
    """The comparison report (module docstring)."""
    from imagebuilder import imagediff, reprocheck

    manifest = _read_json(rebuilt_folder / MANIFEST)
    image = rebuilt_folder / published.image
    rebuilt_sha = sha256_file(image)
    report: dict[str, Any] = {
        "folder": str(published.folder),
        "kind": published.kind,
        "build_id": published.build_id,
        "rebuilt_build_id": manifest.get("build_id"),
        "image": {
            "name": published.image,
            "published": published.image_sha256,
            "rebuilt": rebuilt_sha,
            "same": rebuilt_sha == published.image_sha256,
        },
    }
    same = report["image"]["same"] and manifest.get("build_id") == published.build_id
    measured = next(
        (o["sha256"] for o in manifest.get("outputs", []) if o.get("name") == "boot-measurements.json"), ""
    )
    if published.measurements_sha256 or measured:
        ok = measured == published.measurements_sha256
        report["boot_measurements"] = {
            "published": published.measurements_sha256,
            "rebuilt": measured,
            "same": ok,
        }
        same = same and ok
    if published.kind == "build":
        files = {}
        for name in reprocheck.IDENTICAL_FILES:
            a, b = published.folder / name, rebuilt_folder / name
            if a.exists() or b.exists():
                files[name] = a.exists() and b.exists() and a.read_bytes() == b.read_bytes()
        report["identical_files"] = files
        diffs = {
            "manifest": reprocheck.differences(reprocheck.comparable_manifest(published.manifest),
                                               reprocheck.comparable_manifest(manifest)),
        }  # fmt: skip
        prov_a, prov_b = (
            published.folder / "provenance.intoto.json",
            rebuilt_folder / "provenance.intoto.json",
        )
        if prov_a.exists() and prov_b.exists():
            diffs["provenance"] = reprocheck.differences(reprocheck.comparable_provenance(_read_json(prov_a)),
                                                         reprocheck.comparable_provenance(_read_json(prov_b)))  # fmt: skip
        report["differences"] = {k: [d.to_json() for d in v] for k, v in diffs.items()}
        report["tools"] = [d.to_json() for d in reprocheck.tool_differences(published.manifest, manifest)]
        same = same and all(files.values()) and not any(diffs.values())
        note = _agent_source_note(published)
        if note:
            report["note"] = note
    if not report["image"]["same"]:
        published_image = published.folder / published.image
        report["image_differences"] = imagediff.diff_images(published_image, image, work / "diff").to_json()
    report["same"] = same
    return report


def render(report: dict[str, Any]) -> str:
    img = report["image"]
    lines = [f"{report['kind']} {report['build_id']}: image {img['name']}",
             f"  published {img['published']}", f"  rebuilt   {img['rebuilt']}"]  # fmt: skip
    if report.get("rebuilt_build_id") != report["build_id"]:
        lines.append(f"  build id: the rebuild is {report.get('rebuilt_build_id')}")
    if "boot_measurements" in report:
        lines.append(
            f"  boot measurements: {'the same' if report['boot_measurements']['same'] else 'DIFFERENT'}"
        )
    for name, ok in (report.get("identical_files") or {}).items():
        lines.append(f"  {name}: {'the same' if ok else 'DIFFERENT'}")
    for what, items in (report.get("differences") or {}).items():
        lines.append(
            f"  {what}: {'the same except the run record' if not items else f'{len(items)} difference(s)'}"
        )
        lines += [
            f"    {d['path']}: {str(d['published'])[:80]!s} -> {str(d['rebuilt'])[:80]!s}"
            for d in items[:30]
        ]
    if "image_differences" in report:
        diff = report["image_differences"]
        lines.append(f"  inside the image: {diff['summary']}")
        lines += [f"    partition table: {d}" for d in diff["partition_table"]]
        lines += [f"    file system: {d}" for d in diff["file_systems"][:40]]
        lines += [f"    {f['tree']}:{f['path']}: {f['change']}" + (f" ({f['detail']})" if f["detail"] else "")
                  for f in diff["files"][:60]]  # fmt: skip
        if len(diff["files"]) > 60:
            lines.append(f"    ... {len(diff['files']) - 60} more (--json lists them all)")
    if report.get("tools"):
        lines.append(
            "  host tools that differ from the published build's (bit-identity needs the same versions):"
        )
        lines += [f"    {d['path']}: {d['published']} -> {d['rebuilt']}" for d in report["tools"]]
    if report.get("note"):
        lines.append(f"  note: {report['note']}")
    lines.append(
        "REPRODUCED: the same image" if report["same"] else "NOT REPRODUCED: see the differences above"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from imagebuilder.build import BuildOptions, build

    if args.verbose == 0:
        logging.getLogger("imagebuilder").setLevel(logging.INFO)
    published = read_published(args.folder)
    verify_published(published, args.key)
    definition, lock = _inputs(args, published)
    if published.kind == "release":
        from imagebuilder.lock import load_lock
        from imagebuilder.reproducible import build_id, source_date_epoch

        loaded = load_lock(lock)
        name = published.build_id.rsplit("-", 2)[0]
        expected = build_id(name, loaded.file_sha256, source_date_epoch(loaded.created_at))
        if expected != published.build_id:
            raise LockError(f"{lock} is not the lock of the release's build {published.build_id} (it names {expected})",
                            hint="pass the lock the release's build was made from")  # fmt: skip
    work_root = args.work_dir or Path(os.environ.get("TMPDIR", "/var/tmp"))  # noqa: S108 - a private mkdtemp
    work = Path(tempfile.mkdtemp(prefix="imagebuilder-rebuild-", dir=work_root))
    work.chmod(0o755)  # the build's work directory below must be reachable for QEMU
    try:
        out = args.out or work / "out"
        bases = work / "bases"
        with interrupt.stop_on_signals():
            result = build(BuildOptions(definition=definition, out=out, cache_dir=args.cache_dir or default_cache_dir(),
                                        lock=lock, work_root=work, libvirt_uri=args.libvirt_uri, accel=args.accel,
                                        base_cache=bases, full=True, boot_test=args.boot_test,
                                        keep_work=args.keep_work))  # fmt: skip
        report = compare(published, result.folder, work)
        report["rebuilt_folder"] = str(result.folder) if args.out else ""
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, sort_keys=True) if args.json else render(report))
    return 0 if report["same"] else 1
