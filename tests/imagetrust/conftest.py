"""Image-trust fixtures: a synthetic, real-looking build folder (a real QCOW2 from ``qemu-img``, a
console log, a manifest as docs/image-manifest.md describes it) and signing keys of both kinds."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from imagebuilder.sign import generate_keypair

IMAGE = "node-debian-12.qcow2"
BUILD_ID = "node-debian-12-20261130T081500Z-3f2a1b"

PACKAGES: list[dict[str, Any]] = [
    {"name": "openssh-server", "version": "1:9.2p1-2+deb12u3", "architecture": "amd64"},
    {"name": "libstdc++6", "version": "12.2.0-14", "architecture": "amd64"},
    {"name": "libc6", "version": "2.36-9+deb12u7", "architecture": "amd64"},
    {"name": "libc6", "version": "2.36-9+deb12u7", "architecture": "i386"},
    {
        "name": "tzdata",
        "version": "2024a-0+deb12u1",
        "architecture": "all",
        "maintainer": "GNU Libc Maintainers <debian-glibc@lists.debian.org>",
    },
]


def _digest(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


INPUTS: list[dict[str, Any]] = [
    {
        "name": "installer-iso",
        "kind": "iso",
        "version": "12.8.0",
        "url": "https://deb.example/debian-12.8.0-amd64.iso",
        "sha256": _digest("iso"),
        "size": 3213064192,
        "destination": "",
    },
    {
        "name": "kubelet",
        "kind": "deb",
        "version": "1.36.3-1.1",
        "url": "https://pkgs.k8s.io/core:/stable:/v1.36/deb/amd64/kubelet_1.36.3-1.1_amd64.deb",
        "sha256": _digest("kubelet-1.36.3"),
        "size": 11,
        "destination": "/opt/nodetrust/staged/kubernetes/1.36.3/",
    },
    {
        "name": "kubelet",
        "kind": "deb",
        "version": "1.35.3-1.1",
        "url": "https://pkgs.k8s.io/core:/stable:/v1.35/deb/amd64/kubelet_1.35.3-1.1_amd64.deb",
        "sha256": _digest("kubelet-1.35.3"),
        "size": 12,
        "destination": "/opt/nodetrust/staged/kubernetes/1.35.3/",
    },
    {
        "name": "spire-agent",
        "kind": "tarball",
        "version": "1.13.0",
        "url": "https://github.com/spiffe/spire/releases/download/v1.13.0/spire-1.13.0-linux-amd64-musl.tar.gz",
        "sha256": _digest("spire"),
        "size": 13,
        "destination": "/opt/nodetrust/staged/spire/1.13.0/",
    },
    {
        "name": "nodeagent",
        "kind": "wheel",
        "version": "0.1.0",
        "url": "file:dist/nodetrust-0.1.0-py3-none-any.whl",
        "sha256": _digest("wheel"),
        "size": 14,
        "destination": "/opt/nodeagent",
    },
]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(build: Path, manifest: dict[str, Any]) -> None:
    (build / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")


def make_manifest(build: Path) -> dict[str, Any]:
    """A manifest for the files in ``build`` (the image and console.log), following docs/image-manifest.md."""
    outputs = [
        {
            "name": IMAGE,
            "sha256": file_sha256(build / IMAGE),
            "size": (build / IMAGE).stat().st_size,
            "media_type": "application/x-qemu-disk",
        },
        {
            "name": "console.log",
            "sha256": file_sha256(build / "console.log"),
            "size": (build / "console.log").stat().st_size,
            "media_type": "text/plain",
        },
    ]
    return {
        "schema": "https://nodetrust.dev/image-manifest/v1",
        "build_id": BUILD_ID,
        "name": "node-debian-12",
        "architecture": "amd64",
        "distro": "debian",
        "started_at": "2026-11-30T08:15:00Z",
        "finished_at": "2026-11-30T08:41:10Z",
        "builder": {
            "id": "https://nodetrust.dev/imagebuilder@v1",
            "version": "0.1.0",
            "host": "ci-runner-7",
        },
        "definition": {"path": "examples/debian-12.yaml", "sha256": _digest("definition")},
        "lock": {"path": "examples/debian-12.lock.json", "sha256": _digest("lock")},
        "inputs": copy.deepcopy(INPUTS),
        "outputs": outputs,
        "packages": copy.deepcopy(PACKAGES),
        "kubernetes": {"installed": "1.36.3", "staged": ["1.35.3"]},
        "phases": [{"name": "fetch", "started_at": "2026-11-30T08:15:00Z", "duration_s": 12.3}],
        "tools": {"qemu-img": "7.2.22", "libvirt": "9.0.0", "python": "3.11.2", "imagebuilder": "0.1.0"},
        "installed_size": 2147483648,
    }


@pytest.fixture(scope="session")
def qcow2_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small real QCOW2, made once per session with ``qemu-img`` (qemu-utils)."""
    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        pytest.fail("qemu-img not found; install qemu-utils")
    path = tmp_path_factory.mktemp("qcow2") / IMAGE
    subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", str(path), "64M"], check=True, timeout=60)
    return path


@pytest.fixture
def unsigned_build(tmp_path: Path, qcow2_template: Path) -> Path:
    """A build folder as the build leaves it before the trust step: image, console.log, manifest.json."""
    build = tmp_path / BUILD_ID
    build.mkdir()
    shutil.copyfile(qcow2_template, build / IMAGE)
    (build / "console.log").write_text(
        "[    0.000000] Linux version 6.1.0-28-amd64\nsubiquity/Install: done\n"
    )
    write_manifest(build, make_manifest(build))
    return build


@pytest.fixture(params=["ecdsa-p256", "ed25519"])
def key_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


KeyFiles = tuple[Path, Path]


@pytest.fixture
def make_keys(tmp_path: Path) -> Callable[[str, str], KeyFiles]:
    """Write a key pair (private 0600, public 0644) as ``<tmp>/<name>.key`` and ``.pub``."""

    def _make(kind: str, name: str = "signer") -> KeyFiles:
        private_pem, public_pem = generate_keypair(kind)
        key, pub = tmp_path / f"{name}.key", tmp_path / f"{name}.pub"
        key.write_bytes(private_pem)
        key.chmod(0o600)
        pub.write_bytes(public_pem)
        return key, pub

    return _make


@pytest.fixture
def keys(make_keys: Callable[[str, str], KeyFiles], key_kind: str) -> KeyFiles:
    return make_keys(key_kind, "signer")
