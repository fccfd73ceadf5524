"""Fixture payloads for the image builder, served from a loopback HTTP server.

Small, deterministic payloads with real SHA-256 pins for what a node image stages:

* Kubernetes: for each version, kubeadm, kubelet and kubectl debs built with dpkg-deb, plus their
  dependencies cri-tools and kubernetes-cni, in flat apt repositories laid out like pkgs.k8s.io
  (``/k8s/core:/stable:/v1.36/deb/{InRelease,Packages,amd64/*.deb}``), ``InRelease`` clear-signed with
  the fixture test key. The tree's **kind** (:data:`KINDS`) says what the debs hold:

  - ``real`` (the demo's image in the VM tier, and ``make demo``): the real kubeadm, kubelet, kubectl and
    crictl that ``make peers`` builds, in the upstream packages' layout with kubeadm's systemd drop-in
    (:mod:`tests.support.kube_debs` says exactly what each version's binaries are), and kubernetes-cni's
    links to Debian's CNI plugins;
  - ``runtime`` (the VM tier's session build, whose boot test lists the imported images with crictl): the
    real crictl and CNI links of ``real``, and stand-ins for kubeadm, kubelet and kubectl, the pause image
    and SPIRE. It needs only the cri-tools peer (a minute to build), so the session build need not wait for
    the Kubernetes and SPIRE peers; its installed base is the one a ``real`` tree's build reuses (the
    base holds the definition's Debian packages, never these);
  - ``stand-in`` (the fast tier): shell scripts that say they are stand-ins, no peers needed;
* OCI image archives imported by the image's containerd at build time: the sandbox image
  ``registry.k8s.io/pause:3.10.2`` (``/images/pause/3.10.2/``, pause compiled from Kubernetes v1.36.3's
  source in a ``real`` tree), and stand-in images for kube-proxy (laid out like dl.k8s.io:
  ``/k8s-release/v1.36.3/bin/linux/amd64/kube-proxy.tar`` and ``.tar.sha256``) and OVN-Kubernetes (in the
  signed ``SHA256SUMS`` of its release) (:mod:`tests.support.oci_images`);
* ``/nvidia/deb/``: a signed flat apt repository of stand-ins for the NVIDIA stack, named ``*-standin``
  (:mod:`tests.support.nvidia_standins`), the kernel modules built for ``kernel``;
* SPIRE agent 1.14.1 and the TPM attestor plugin 1.9.0: tarballs with the checksum files
  their projects publish (unsigned). In a ``real`` tree the SPIRE tarball holds the real
  spire-agent of ``make peers`` (v1.13.3's source with 1.14.1 stamped as its version) in upstream's
  layout, without spire-server (:mod:`tests.support.spire_release` says exactly what it is); otherwise
  a stand-in;
* OVN-Kubernetes 2.4.2: a tarball with a ``SHA256SUMS`` and a detached OpenPGP signature;
* ``/extras/deb/``: a signed flat apt repository with two packages that misbehave on purpose,
  for the VM tests of the builder's diagnoses: ``nodetrust-fixture-fails`` (its postinst
  exits 1) and ``nodetrust-fixture-hangs`` (its postinst sleeps forever, silently);
* ``/k8s-hangs/core:/stable:/v1.36/deb/``: a Kubernetes 1.36.3 repository of stand-ins whose kubelet's
  postinst sleeps forever, silently: the provisioning boot's watchdog meets it on a cached base.

Every stand-in binary says that it is a stand-in. The signing key is a test key
(``tests/support/data/fixture-payload-signing.secret.asc``; its public half is
``examples/keys/fixture-payload-signing.asc``): never trust it for anything else.

:class:`PayloadServer` serves a payload tree with ``Range`` support and can tamper with,
truncate or fail a path on demand (the tests' way to corrupt a download).

    python -m tests.support.payload_server [--root DIR] [--port 8765] [--kind KIND] [--kernel RELEASE]

builds the tree (once) and serves it, for ``imagebuilder build examples/fixture-node.yaml``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal, get_args

from tests.support import cachedirs, kube_debs, nvidia_standins, oci_images, spire_release

REPO = Path(__file__).resolve().parents[2]
SECRET_KEY = Path(__file__).resolve().parent / "data" / "fixture-payload-signing.secret.asc"
PUBLIC_KEY = REPO / "examples" / "keys" / "fixture-payload-signing.asc"
#: The payload trees of :func:`cached_payloads`, one folder per digest of what makes them.
PAYLOADS = cachedirs.shared("imagebuilder-payloads")
#: What a payload tree is made from, besides FORMAT, its kind and its kernel: these modules, the signing key,
#: and (for the real Kubernetes binaries) the peers' pins.
_RECIPE_FILES = (
    "payload_server.py",
    "kube_debs.py",
    "nvidia_standins.py",
    "oci_images.py",
    "spire_release.py",
)
KEEP_TREES = 3
#: What a tree's Kubernetes debs, pause image and SPIRE tarball hold (the module's docstring says each).
Kind = Literal["stand-in", "runtime", "real"]
KINDS: tuple[Kind, ...] = get_args(Kind)
#: The peers (interop/<module>) each kind is built from.
PEER_MODULES: dict[Kind, tuple[str, ...]] = {
    "stand-in": (),
    "runtime": ("critools",),
    "real": ("critools", "kube", "spire"),
}
#: The packages whose files are real in a ``runtime`` tree.
RUNTIME_PACKAGES = frozenset({"cri-tools", "kubernetes-cni"})
DEFAULT_PORT = 8765
EPOCH = 1767225600  # 2026-01-01T00:00:00Z, every mtime in the payloads
FORMAT = "7"  # bump when the payloads change
DEFAULT_KERNEL = (
    "6.1.0-50-amd64"  # the fixture installer's kernel when none is given (build.json's "kernel")
)

KUBERNETES_VERSIONS = ("1.34.2", "1.35.3", "1.36.3", "1.37.2")
DEB_REVISION = "1.1"
KUBERNETES_CNI = "1.7.1"
SPIRE_VERSION = spire_release.FIXTURE_SPIRE_VERSION
TPM_PLUGIN_VERSION = "1.9.0"
OVNK_VERSION = "2.4.2"
OVNK_IMAGE = f"ghcr.io/ovn-kubernetes/ovn-kubernetes/ovn-kube-ubuntu:v{OVNK_VERSION}"
KUBE_PROXY_IMAGE = "registry.k8s.io/kube-proxy:v1.36.3"


def _standin(name: str, version: str) -> bytes:
    return (
        f"#!/bin/sh\n# nodetrust fixture payload: a stand-in for {name} {version}, not the real program\n"
        f'echo "{name} {version} (nodetrust fixture stand-in)"\n'
    ).encode()


# -- debs ---------------------------------------------------------------------------------------


def _deb(
    out: Path,
    name: str,
    version: str,
    files: dict[str, kube_debs.Content],
    depends: str = "",
    arch: str = "amd64",
    postinst: str = "",
    description: str = "",
    compression: str = "xz",
) -> Path:
    with tempfile.TemporaryDirectory(prefix="payload-deb-") as tmp:
        root = Path(tmp) / "root"
        (root / "DEBIAN").mkdir(parents=True)
        control = (
            f"Package: {name}\nVersion: {version}\nArchitecture: {arch}\n"
            "Maintainer: nodetrust tests <tests@nodetrust.invalid>\n"
            + (f"Depends: {depends}\n" if depends else "")
            + f"Description: {description or f'{name} stand-in (nodetrust fixture payload, not the real package)'}\n"
        )
        (root / "DEBIAN" / "control").write_text(control)
        if postinst:
            (root / "DEBIAN" / "postinst").write_text(postinst)
            (root / "DEBIAN" / "postinst").chmod(0o755)
        for rel, data in files.items():
            path = root / rel.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, kube_debs.Link):
                path.symlink_to(data.target)
                continue
            if isinstance(data, Path):
                shutil.copyfile(data, path)
            else:
                path.write_bytes(data)
            path.chmod(0o755 if rel.startswith(("/usr/bin/", "/usr/sbin/")) else 0o644)
        for path in sorted(root.rglob("*"), reverse=True):
            os.utime(path, (EPOCH, EPOCH), follow_symlinks=False)
        os.utime(root, (EPOCH, EPOCH))
        out.mkdir(parents=True, exist_ok=True)
        deb = out / f"{name}_{version}_{arch}.deb"
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH)}
        # gzip at level 1 for the real binaries (tens of MB each): about five times less CPU than dpkg-deb's
        # default 9 for a few per cent more bytes, and a payload tree is built on every cold run
        level = ["-z1"] if compression == "gzip" else []
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", f"-Z{compression}", *level, "--build", str(root), str(deb)],
            check=True,
            capture_output=True,
            env=env,
        )
    return deb


def _control(deb: Path) -> str:
    return subprocess.run(
        ["dpkg-deb", "--field", str(deb)], check=True, capture_output=True, text=True
    ).stdout


def _flat_repo(repo: Path, gnupghome: Path) -> None:
    """Packages, Packages.gz, Release, InRelease and Release.gpg for repo/amd64/*.deb (pkgs.k8s.io layout)."""
    stanzas = []
    for deb in sorted(repo.glob("*/*.deb")):
        data = deb.read_bytes()
        stanzas.append(
            _control(deb).strip()
            + f"\nFilename: {deb.parent.name}/{deb.name}\nSize: {len(data)}\nSHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    packages = "\n".join(stanzas).encode()
    (repo / "Packages").write_bytes(packages)
    (repo / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    sums = "".join(
        f" {hashlib.sha256((repo / n).read_bytes()).hexdigest()} {(repo / n).stat().st_size} {n}\n"
        for n in ("Packages", "Packages.gz")
    )
    (repo / "Release").write_text(
        "Origin: nodetrust fixture payloads\nLabel: nodetrust fixture payloads\nArchitectures: amd64 all\n"
        "Date: Thu, 01 Jan 2026 00:00:00 UTC\nSHA256:\n" + sums
    )
    _gpg(gnupghome, "--clearsign", "--output", str(repo / "InRelease"), str(repo / "Release"))
    _gpg(gnupghome, "--detach-sign", "--armor", "--output", str(repo / "Release.gpg"), str(repo / "Release"))


# -- tarballs ----------------------------------------------------------------------------------------


def _tarball(out: Path, members: dict[str, bytes], executables: set[str] | None = None) -> Path:
    """A gzipped tar of ``members``; mode 0755 for ``executables`` (default: under bin/, or no dot in the name)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        dirs: set[str] = set()
        for name in sorted(members):
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
                    tar.addfile(info)
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(members[name]), EPOCH
            guessed = "/bin/" in name or "." not in name.rsplit("/", 1)[-1]
            info.mode = 0o755 if (guessed if executables is None else name in executables) else 0o644
            tar.addfile(info, io.BytesIO(members[name]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(buffer.getvalue(), mtime=0))
    return out


def _sums(files: list[Path]) -> str:
    return "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)


# -- signing --------------------------------------------------------------------------------------------


def _gpg(home: Path, *args: str) -> None:
    subprocess.run(
        [
            "gpg",
            "--homedir",
            str(home),
            "--batch",
            "--yes",
            "--pinentry-mode",
            "loopback",
            "--passphrase",
            "",
            *args,
        ],
        check=True,
        capture_output=True,
    )


@contextlib.contextmanager
def _signing_home() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="payload-gpg-") as tmp:
        home = Path(tmp)
        home.chmod(0o700)
        _gpg(home, "--import", str(SECRET_KEY))
        try:
            yield home
        finally:
            subprocess.run(
                ["gpgconf", "--homedir", str(home), "--kill", "all"], check=False, capture_output=True
            )


# -- the tree ------------------------------------------------------------------------------------------------


def recipe_files(kind: Kind) -> list[Path]:
    """The files a tree of ``kind`` is made from: this module and its helpers, the signing key, and the
    ``go.sum`` and ``peer.conf`` of the kind's own peers (a Kubernetes pin leaves a runtime tree alone)."""
    here = Path(__file__).resolve().parent
    files = [here / name for name in _RECIPE_FILES] + [SECRET_KEY]
    for module in PEER_MODULES[kind]:
        files += [REPO / "interop" / module / "go.sum", REPO / "interop" / module / "peer.conf"]
    return files


def cached_payloads(*, kind: Kind, kernel: str = DEFAULT_KERNEL) -> Path:
    """The payload tree for this kind and kernel in the machine's cache (:mod:`tests.support.cachedirs`),
    built first if needed; one builder at a time, older trees pruned (the newest :data:`KEEP_TREES` stay).

    The tree's folder is named by a digest of FORMAT, the kind, the kernel, the modules that make it, the
    signing key and the ``go.sum`` and ``peer.conf`` of the kind's peers: a clone with other payload code gets
    its own.
    """
    if kind not in KINDS:
        raise ValueError(f"payload tree kind {kind!r}: one of {', '.join(KINDS)}")
    kernel = kernel or DEFAULT_KERNEL
    key = cachedirs.inputs_key(FORMAT, kind, kernel, files=recipe_files(kind), base=REPO)
    root = PAYLOADS / f"{kind}-{key}"
    PAYLOADS.mkdir(parents=True, exist_ok=True)
    with open(PAYLOADS / f".lock-{kind}-{key}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build_payloads(root, kind=kind, kernel=kernel)
    cachedirs.prune(PAYLOADS, keep=KEEP_TREES, current=root)
    return root


def build_payloads(root: Path, *, kind: Kind = "stand-in", kernel: str = DEFAULT_KERNEL) -> Path:
    """Build the payload tree under ``root`` (once per FORMAT, kind and kernel) and return ``root``.

    ``kind``: what the Kubernetes debs, the pause image and the SPIRE tarball hold (:data:`KINDS`, the
    module's docstring); a kind with real binaries needs its peers (:data:`PEER_MODULES`;
    :class:`tests.support.peers.PeerError` names ``make peers`` when they are missing); ``kernel``: the kernel
    release the NVIDIA stand-in modules are built for (the fixture installer's ``build.json`` ``kernel``).
    """
    if kind not in KINDS:
        raise ValueError(f"payload tree kind {kind!r}: one of {', '.join(KINDS)}")
    kernel = kernel or DEFAULT_KERNEL
    real_kubernetes = kind == "real"
    recipe = f"{FORMAT} {kind} {kernel}"
    stamp = root / ".complete"
    if stamp.is_file() and stamp.read_text().strip() == recipe:
        return root
    work = root.with_name(root.name + f".build-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        with _signing_home() as home:
            for version in KUBERNETES_VERSIONS:
                minor = ".".join(version.split(".")[:2])
                repo = work / "k8s" / f"core:/stable:/v{minor}" / "deb"
                debs = repo / "amd64"
                deb_version = f"{version}-{DEB_REVISION}"
                cri = f"{minor}.0"

                def real(package: str) -> bool:
                    return real_kubernetes or (kind == "runtime" and package in RUNTIME_PACKAGES)

                def big(package: str) -> str:
                    # Real binaries are tens of MB: gzip unpacks several times faster than xz under emulation.
                    return "gzip" if real(package) else "xz"

                def files(package: str, upstream: str, what: str) -> dict[str, kube_debs.Content]:
                    return kube_debs.package_files(
                        package, upstream, real=real(package), standin=_standin(what, upstream)
                    )

                def about(package: str) -> str:
                    if not real(package):
                        return ""
                    return f"{package} for the nodetrust fixture image, from the test peers (tests/support/kube_debs.py)"

                _deb(debs, "cri-tools", f"{cri}-{DEB_REVISION}", files("cri-tools", cri, "crictl"),
                     compression=big("cri-tools"), description=about("cri-tools"))  # fmt: skip
                _deb(debs, "kubernetes-cni", f"{KUBERNETES_CNI}-{DEB_REVISION}",
                     files("kubernetes-cni", KUBERNETES_CNI, "cni bridge"), description=about("kubernetes-cni"))  # fmt: skip
                _deb(debs, "kubectl", deb_version, files("kubectl", version, "kubectl"), compression=big("kubectl"),
                     description=about("kubectl"))  # fmt: skip
                _deb(debs, "kubelet", deb_version, files("kubelet", version, "kubelet"),
                     depends="kubernetes-cni (>= 1.2.0)", compression=big("kubelet"), description=about("kubelet"))  # fmt: skip
                _deb(
                    debs,
                    "kubeadm",
                    deb_version,
                    files("kubeadm", version, "kubeadm"),
                    depends=f"kubelet (>= {minor}.0), kubectl (>= {minor}.0), cri-tools (>= {minor}.0)",
                    compression=big("kubeadm"),
                    description=about("kubeadm"),
                )
                _flat_repo(repo, home)

            nvidia = work / "nvidia" / "deb"
            for package in nvidia_standins.packages(kernel):
                _deb(nvidia / "amd64", package.name, package.version, dict(package.files),
                     depends=package.depends, description=package.description)  # fmt: skip
            _flat_repo(nvidia, home)

            pause = work / "images" / "pause" / oci_images.PAUSE_VERSION
            pause_tar = pause / f"pause-{oci_images.PAUSE_VERSION}-linux-amd64.tar"
            if real_kubernetes:
                oci_images.pause_archive(pause_tar)
            else:
                oci_images.standin_archive(
                    pause_tar, oci_images.PAUSE_REF, "pause", oci_images.PAUSE_VERSION
                )
            (pause / "SHA256SUMS").write_text(_sums([pause_tar]))
            _gpg(
                home,
                "--detach-sign",
                "--armor",
                "--output",
                str(pause / "SHA256SUMS.asc"),
                str(pause / "SHA256SUMS"),
            )
            proxy = work / "k8s-release" / "v1.36.3" / "bin" / "linux" / "amd64"
            proxy_tar = oci_images.standin_archive(
                proxy / "kube-proxy.tar", KUBE_PROXY_IMAGE, "kube-proxy", "v1.36.3"
            )
            (proxy / "kube-proxy.tar.sha256").write_text(hashlib.sha256(proxy_tar.read_bytes()).hexdigest())

            extras = work / "extras" / "deb"
            _deb(
                extras / "all",
                "nodetrust-fixture-fails",
                "1.0",
                {"/usr/share/nodetrust-fixture/fails": b"x\n"},
                arch="all",
                postinst="#!/bin/sh\necho 'nodetrust-fixture-fails: this postinst fails on purpose' >&2\nexit 1\n",
            )
            _deb(
                extras / "all",
                "nodetrust-fixture-hangs",
                "1.0",
                {"/usr/share/nodetrust-fixture/hangs": b"x\n"},
                arch="all",
                postinst="#!/bin/sh\nexec sleep 1000000\n",
            )
            _flat_repo(extras, home)

            # A Kubernetes repository whose kubelet never finishes installing (its postinst sleeps, silently):
            # the provisioning boot applies the Kubernetes packages, so a build on a cached base meets it
            # there, for the VM test of the staging plan's watchdog (vm-tests/test_failures.py).
            hangs = work / "k8s-hangs" / "core:/stable:/v1.36" / "deb"
            for name, upstream, depends in (
                ("cri-tools", "1.36.0", ""),
                ("kubernetes-cni", KUBERNETES_CNI, ""),
                ("kubectl", "1.36.3", ""),
                ("kubelet", "1.36.3", "kubernetes-cni (>= 1.2.0)"),
                ("kubeadm", "1.36.3", "kubelet (>= 1.36.0), kubectl (>= 1.36.0), cri-tools (>= 1.36.0)"),
            ):
                _deb(hangs / "amd64", name, f"{upstream}-{DEB_REVISION}",
                     {f"/usr/share/nodetrust-fixture/{name}": b"a stand-in that hangs in its kubelet's postinst\n"},
                     depends=depends, postinst="#!/bin/sh\nexec sleep 1000000\n" if name == "kubelet" else "")  # fmt: skip
            _flat_repo(hangs, home)

            spire_tarball(work / "spire" / f"v{SPIRE_VERSION}", real=real_kubernetes)

            plugin = work / "spire-tpm-plugin" / f"v{TPM_PLUGIN_VERSION}"
            plugin_tar = _tarball(
                plugin / f"spire_tpm_plugin_tpm_attestor_agent_linux_amd64_v{TPM_PLUGIN_VERSION}.tar.gz",
                {"tpm_attestor_agent": _standin("tpm_attestor_agent", TPM_PLUGIN_VERSION)},
            )
            (plugin / "checksums.txt").write_text(_sums([plugin_tar]))

            ovnk = work / "ovn-kubernetes" / f"v{OVNK_VERSION}"
            ovnk_tar = _tarball(
                ovnk / f"ovn-kubernetes-{OVNK_VERSION}-linux-amd64.tar.gz",
                {
                    f"ovn-kubernetes-{OVNK_VERSION}/bin/ovnkube": _standin("ovnkube", OVNK_VERSION),
                    f"ovn-kubernetes-{OVNK_VERSION}/manifests/ovnkube-node.yaml": b"# ovnkube-node manifest stand-in\n",
                },
            )
            ovnk_image = oci_images.standin_archive(
                ovnk / f"ovn-kube-image-{OVNK_VERSION}-linux-amd64.tar", OVNK_IMAGE, "ovnkube", OVNK_VERSION
            )
            (ovnk / "SHA256SUMS").write_text(_sums([ovnk_tar, ovnk_image]))
            _gpg(
                home,
                "--detach-sign",
                "--armor",
                "--output",
                str(ovnk / "SHA256SUMS.asc"),
                str(ovnk / "SHA256SUMS"),
            )
        (work / ".complete").write_text(recipe + "\n")
        shutil.rmtree(root, ignore_errors=True)
        work.rename(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def spire_tarball(folder: Path, *, real: bool) -> Path:
    """SPIRE's release tarball and its ``_sha256sum.txt`` in ``folder`` (``/spire/v<version>/``); returns the
    tarball. ``real``: the real spire-agent, stamped with the fixture's version, in upstream's layout;
    otherwise stand-ins (:mod:`tests.support.spire_release` says exactly what each is)."""
    members = spire_release.release_members(
        SPIRE_VERSION, real=real, standin=_standin("spire-agent", SPIRE_VERSION)
    )
    agent = f"spire-{SPIRE_VERSION}/bin/spire-agent"
    tar = _tarball(folder / spire_release.tarball_name(SPIRE_VERSION), members, executables={agent})
    (folder / f"spire-{SPIRE_VERSION}-linux-amd64-musl_sha256sum.txt").write_text(_sums([tar]))
    return tar


# -- the server -------------------------------------------------------------------------------------------------


class PayloadServer:
    """Serves ``root`` on 127.0.0.1 with Range support; paths can be tampered with, truncated or failed."""

    def __init__(self, root: Path, port: int = 0) -> None:
        self.root = root
        self.overrides: dict[str, bytes] = {}
        self.truncate_once: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.fail_next: dict[str, tuple[int, int]] = {}  # path -> (HTTP status, how many requests)
        self.stall_once: set[str] = set()  # answer nothing until close(): the client must time out
        self._release = threading.Event()
        self.requests: list[tuple[str, str]] = []  # (path, Range header)
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server._get(self)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="payload-server", daemon=True)
        self._thread.start()

    def _content(self, path: str) -> bytes | None:
        if path in self.overrides:
            return self.overrides[path]
        local = (self.root / path.lstrip("/")).resolve()
        if not local.is_relative_to(self.root.resolve()) or not local.is_file():
            return None
        return local.read_bytes()

    def _get(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?", 1)[0]
        range_header = handler.headers.get("Range", "")
        with self._lock:
            self.requests.append((path, range_header))
            status = self.status.get(path)
            cut = self.truncate_once.pop(path, None)
            stall = path in self.stall_once
            self.stall_once.discard(path)
            if status is None and path in self.fail_next:
                status, left = self.fail_next[path]
                if left > 1:
                    self.fail_next[path] = (status, left - 1)
                else:
                    del self.fail_next[path]
        if stall:
            self._release.wait(30)
            handler.close_connection = True
            return
        if status is not None:
            handler.send_response(status)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        data = self._content(path)
        if data is None:
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        start = 0
        if range_header.startswith("bytes=") and range_header.endswith("-"):
            start = int(range_header[len("bytes=") : -1])
            if start >= len(data):
                handler.send_response(416)
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            handler.send_response(200)
        body = data[start:]
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if cut is not None:
            handler.wfile.write(body[:cut])
            handler.wfile.flush()
            handler.close_connection = True
            with contextlib.suppress(OSError):
                handler.connection.shutdown(2)
            return
        handler.wfile.write(body)

    def tamper(self, path: str, data: bytes) -> None:
        self.overrides[path] = data

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def fixture_kernel() -> str:
    """The kernel release of the fixture installer ISO (built first when it is not cached): the one the VM
    tier's payload trees are built for."""
    from fixtures.installer.build import build_installer_iso

    return str(build_installer_iso().manifest.get("kernel") or DEFAULT_KERNEL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.payload_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--root", type=Path, default=None,
                        help=f"payload tree (default: one under {PAYLOADS}, named by what makes it)")  # fmt: skip
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"loopback port (default: {DEFAULT_PORT})"
    )
    parser.add_argument("--kind", choices=KINDS, default="real",
                        help="real: the binaries of `make peers` (default); runtime: only crictl real (the cri-tools "
                             "peer); stand-in: scripts that say they are stand-ins (no peers needed)")  # fmt: skip
    kernel = parser.add_mutually_exclusive_group()
    kernel.add_argument(
        "--kernel", default=DEFAULT_KERNEL, help="kernel release for the NVIDIA stand-in modules"
    )
    kernel.add_argument("--for-fixture-iso", action="store_true",
                        help="the NVIDIA stand-ins for the fixture installer ISO's kernel, as the VM tier builds them "
                             "(builds the ISO first when it is not cached)")  # fmt: skip
    parser.add_argument("--prepare", action="store_true",
                        help="build the tree (when it is not built) and print its folder; serve nothing: "
                             "make test builds the real tree this way once the peers are built")  # fmt: skip
    args = parser.parse_args(argv)
    release = fixture_kernel() if args.for_fixture_iso else args.kernel
    if args.root is None:
        root = cached_payloads(kind=args.kind, kernel=release)
    else:
        root = build_payloads(args.root, kind=args.kind, kernel=release)
    if args.prepare:
        print(root, flush=True)
        return 0
    server = PayloadServer(root, args.port)
    print(f"serving fixture payloads from {root} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
