"""Build outputs: the compacted QCOW2, the manifest, SHA256SUMS, and the atomic publish.

The build writes everything into ``<out>/.partial-<build-id>/`` and publishes it with one
``rename`` to ``<out>/<build-id>/``: a reader sees a whole build folder or none. When
:mod:`imagebuilder.trust` is present, its ``write_trust_outputs`` writes the SBOM, the
provenance, ``SHA256SUMS`` and (with a key) the signature before the rename; without it
the builder writes ``SHA256SUMS`` itself. A failed or interrupted build removes its
partial folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from imagebuilder import interrupt
from imagebuilder.errors import OutputError
from imagebuilder.run import run

log = logging.getLogger(__name__)

MANIFEST_SCHEMA = "https://nodetrust.dev/image-manifest/v1"
QCOW2_MEDIA_TYPE = "application/x-qemu-disk"
NOT_LISTED = {
    "manifest.json",
    "SHA256SUMS",
    "sbom.spdx.json",
    "provenance.intoto.json",
    "signature.dsse.json",
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def convert_image(
    source: Path, dest: Path, *, compress: bool, source_format: str = "qcow2"
) -> dict[str, Any]:
    """A compacted copy of ``source`` (unallocated and zeroed clusters dropped), optionally compressed; the source's
    format is named, never probed."""
    argv = ["qemu-img", "convert", "-f", source_format, "-O", "qcow2", "-o", "compat=1.1"]
    if compress:
        argv.append("-c")
    run([*argv, str(source), str(dest)], hint="qemu-img could not convert the installed disk")
    info = json.loads(run(["qemu-img", "info", "--output=json", str(dest)]).text)
    return {
        "format": info.get("format", "qcow2"),
        "virtual_size": int(info.get("virtual-size", 0)),
        "compressed": compress,
    }


def file_entry(path: Path, media_type: str) -> dict[str, Any]:
    return {
        "name": path.name,
        "sha256": sha256_file(path),
        "size": path.stat().st_size,
        "media_type": media_type,
    }


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_sha256sums(folder: Path) -> None:
    lines = [
        f"{sha256_file(p)}  {p.name}\n"
        for p in sorted(folder.iterdir(), key=lambda p: p.name.encode())
        if p.is_file() and p.name not in ("SHA256SUMS", "signature.dsse.json")
    ]
    (folder / "SHA256SUMS").write_text("".join(lines), encoding="utf-8")


def trust_outputs_available() -> bool:
    return importlib.util.find_spec("imagebuilder.trust") is not None


def finish_folder(folder: Path, *, key: Path | None) -> None:
    """SBOM, provenance, SHA256SUMS and signature (imagebuilder.trust), or SHA256SUMS alone."""
    if trust_outputs_available():
        trust = importlib.import_module("imagebuilder.trust")
        trust.write_trust_outputs(folder, key=key)
        return
    if key is not None:
        raise OutputError("--key given, but this builder has no signing (imagebuilder.trust is missing)")
    log.warning(
        "imagebuilder.trust is not available: publishing SHA256SUMS without SBOM, provenance or signature"
    )
    write_sha256sums(folder)


@contextlib.contextmanager
def partial_folder(out: Path, build_id: str, *, run_id: str = "") -> Iterator[Path]:
    """``<out>/.partial-<run id>`` (by default the build id), removed unless it was published."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".partial-{run_id or build_id}"
    if (out / build_id).exists():
        raise OutputError(f"{out / build_id} already exists")
    partial.mkdir()
    try:
        yield partial
    finally:
        if partial.exists():
            with interrupt.deferred():  # never half a folder left behind
                shutil.rmtree(partial, ignore_errors=True)


def publish(partial: Path, final: Path) -> Path:
    """Make the finished folder visible in one step."""
    os.chmod(partial, 0o755)  # noqa: S103 - a published build folder is world-readable
    try:
        os.rename(partial, final)
    except OSError as exc:
        raise OutputError(f"cannot publish {final}: {exc.strerror}") from exc
    log.info("published %s", final)
    return final
