"""OCI image archives for the fixture image: the real pause (sandbox) image, and stand-ins for the others.

Public API::

    PAUSE_VERSION = "3.10.2"                         # kubeadm v1.36.3's constants.PauseVersion
    pause_archive(out: Path) -> Path                 # registry.k8s.io/pause:3.10.2, pause built from upstream source
    standin_archive(out: Path, ref: str, name: str, version: str) -> Path   # a one-binary stand-in image
    write_archive(out, ref, files, *, entrypoint, labels) -> Path            # an OCI image layout as a tar

Archives are OCI image layouts in a tar (``oci-layout``, ``index.json``, ``blobs/sha256/...``), what
``ctr images import`` reads; ``index.json`` names the image by the ``io.containerd.image.name``
annotation, so containerd stores it under ``ref``. Everything is deterministic (fixed times, sorted
entries, gzip without a timestamp): the same inputs give the same digests, which the lock pins.

* **pause**: the sandbox image. ``pause`` is compiled from Kubernetes v1.36.3's own
  ``build/pause/linux/pause.c`` (from the Go module cache that ``make peers`` fills), statically, as
  upstream's Makefile does (``-Os -Wall -Werror -static -DVERSION=...``). The image is therefore a
  working sandbox image, built here instead of pulled from registry.k8s.io.
* **stand-ins** (kube-proxy, OVN-Kubernetes): one static binary that prints that it is a stand-in. The
  images exist so that the build's import, the boot test's listing and the node's offline start can be
  tested; they are not the programs (OVN-Kubernetes cannot be built here, and the fixture's pods never run).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

from tests.support.peers import PeerError, run

PAUSE_VERSION = "3.10.2"
PAUSE_REF = f"registry.k8s.io/pause:{PAUSE_VERSION}"
EPOCH = 1767225600  # 2026-01-01T00:00:00Z
KUBERNETES_SOURCE = "k8s.io/kubernetes@v1.36.3"

_STANDIN_C = r"""#include <stdio.h>
int main(void) {
  puts("@NAME@ @VERSION@ (nodetrust fixture stand-in image, not the real program)");
  return 0;
}
"""


def _gomodcache() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nodetrust"
    return Path(os.environ.get("NODETRUST_CACHE") or default) / "go" / "mod"


def _compile(source: str, out: Path, *flags: str) -> Path:
    with tempfile.TemporaryDirectory(prefix="oci-cc-") as tmp:
        src = Path(tmp) / "main.c"
        src.write_text(source)
        run(["gcc", "-Os", "-Wall", "-Werror", "-static", *flags, "-o", out, src], timeout=300)
        run(["strip", out])
    return out


def _tar_layer(files: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data, mode = files[name]
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, EPOCH
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def _json(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def write_archive(
    out: Path,
    ref: str,
    files: dict[str, tuple[bytes, int]],
    *,
    entrypoint: list[str],
    labels: dict[str, str],
    arch: str = "amd64",
) -> Path:
    """An OCI image layout tar at ``out``: one layer with ``files`` (path -> (content, mode)), named ``ref``."""
    blobs: dict[str, bytes] = {}
    layer = _tar_layer(files)
    compressed = gzip.compress(layer, compresslevel=9, mtime=0)
    config = {
        "architecture": arch,
        "os": "linux",
        "created": "2026-01-01T00:00:00Z",
        "config": {"Entrypoint": entrypoint, "Labels": labels},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
        "history": [
            {"created": "2026-01-01T00:00:00Z", "created_by": "nodetrust tests/support/oci_images.py"}
        ],
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **_blob(blobs, _json(config))},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(blobs, compressed)}],
    }
    tag = ref.rpartition(":")[2] if ":" in ref.rpartition("/")[2] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **_blob(blobs, _json(manifest)),
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
                "platform": {"architecture": arch, "os": "linux"},
            }
        ],
    }
    entries = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(index),
        **{f"blobs/sha256/{d.removeprefix('sha256:')}": data for d, data in blobs.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(entries[name]), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(entries[name]))
    return out


def pause_archive(out: Path) -> Path:
    """registry.k8s.io/pause:3.10.2 with ``/pause`` compiled from Kubernetes v1.36.3's pause.c."""
    source = _gomodcache() / KUBERNETES_SOURCE / "build" / "pause" / "linux" / "pause.c"
    if not source.is_file():
        raise PeerError(f"{source} is missing: run `make peers` (it downloads Kubernetes v1.36.3's source)")
    with tempfile.TemporaryDirectory(prefix="oci-pause-") as tmp:
        binary = _compile(source.read_text(), Path(tmp) / "pause", f"-DVERSION=v{PAUSE_VERSION}-nodetrust")
        data = binary.read_bytes()
    labels = {
        "org.opencontainers.image.source": "https://github.com/kubernetes/kubernetes/tree/v1.36.3/build/pause",
        "dev.nodetrust.fixture": "pause built from Kubernetes v1.36.3 source on this machine",
    }
    return write_archive(out, PAUSE_REF, {"/pause": (data, 0o755)}, entrypoint=["/pause"], labels=labels)


def standin_archive(out: Path, ref: str, name: str, version: str) -> Path:
    """A stand-in image for ``name`` ``version``: one static binary that says what it is."""
    with tempfile.TemporaryDirectory(prefix="oci-standin-") as tmp:
        text = _STANDIN_C.replace("@NAME@", name).replace("@VERSION@", version)
        data = _compile(text, Path(tmp) / name).read_bytes()
    labels = {"dev.nodetrust.fixture": f"STAND-IN for {name} {version}: not the real program"}
    path = f"/usr/local/bin/{name}"
    return write_archive(out, ref, {path: (data, 0o755)}, entrypoint=[path], labels=labels)
