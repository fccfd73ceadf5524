"""``imagebuilder release``: from a published build folder it verifies first, one signed release folder.

::

    <out>/k8s-1.36.3-amd64-h200/
      boot.ipxe                        the release's iPXE script (ipxe/boot.ipxe.tmpl), pinning the imager,
                                       the signing key and the image
      entry.ipxe                       a site entry script chaining boot.ipxe (ipxe/entry.ipxe.tmpl)
      imager.vmlinuz, imager.initrd    the imager's boot environment
      <image>.qcow2                    the build's image, byte for byte (and <image>.raw with --raw)
      <image>.sha256-chunks            each image's per-chunk SHA-256 (protocol.chunklist), for parallel checks
      worker.user-data                 node-pool cloud-init (only writes configuration)
      control-plane-init.user-data     with --control-plane-endpoint: kubeadm init (v1beta4)
      control-plane-join.user-data     with --control-plane-endpoint: kubeadm join --control-plane
      release.json                     the release manifest (docs/bare-metal.md, "The release manifest")
      signing-key.pub                  the public key that signs it
      SHA256SUMS, signature.dsse.json  as a build: one signature over every file

The folder is assembled in a hidden sibling, checked by the same readers the imager uses
(:mod:`protocol.release`), and renamed into place in one step; a release of that name that exists
already is refused: a release is never changed in place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from imagebuilder import nodespec
from imagebuilder.buildfolder import (
    SHA256SUMS,
    SIGNATURE,
    boot_measurements_output,
    digests_equal,
    dump_json,
    format_sha256sums,
    load_manifest_bytes,
    sha256_file,
    write_atomic,
)
from imagebuilder.errors import BuildError, OutputError, VerificationError
from imagebuilder.release import cloudinit
from imagebuilder.release.cloudinit import ControlPlane, PoolConfig
from imagebuilder.release.digests import digest_file
from imagebuilder.release.ipxe import BootScript, render_boot, render_entry
from imagebuilder.run import run
from imagebuilder.sign import (
    IN_TOTO_PAYLOAD_TYPE,
    PublicKey,
    key_id,
    load_private_key,
    public_pem,
    sign_envelope,
)
from imagebuilder.sign import load_public_key as load_build_key
from imagebuilder.verify import VerifyResult, verify_build
from protocol import chunklist
from protocol.dsse import fingerprint, load_public_key, parse_envelope, verify_envelope
from protocol.release import (
    RELEASE_ATTESTATION,
    RELEASE_MANIFEST,
    RELEASE_SCHEMA,
    STATEMENT_TYPE,
    read_manifest,
    read_statement,
)

log = logging.getLogger(__name__)

KERNEL = "imager.vmlinuz"
INITRD = "imager.initrd"
SIGNING_KEY = "signing-key.pub"


@dataclass(frozen=True)
class ReleaseSpec:
    build_dir: Path
    build_key: Path  # the build's signer (public): the build is verified with it first
    signing_key: Path  # the release's signer (private)
    out: Path
    base_url: str  # where the release folders are served; the release is at <base_url><name>/
    imager_kernel: Path
    imager_initrd: Path
    pool: PoolConfig | None = None
    control_plane_endpoint: str = ""
    suffix: str = ""  # the name's last part (default: the pool)
    name: str = ""
    hints: Mapping[str, str] = field(default_factory=dict)
    without_hints: str = "refuse"
    events_url: str = ""
    raw: bool = False
    kubeadm: str = ""
    console: str = "ttyS0,115200"
    agent_params: Mapping[str, str] = field(default_factory=dict)  # nodeagent.<key>= on the kernel line
    retries: int = 3
    pause_s: int = 5
    require_digest: bool = False


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _artifact(folder: Path, name: str) -> dict[str, Any]:
    return {"name": name, "sha256": sha256_file(folder / name), "size": (folder / name).stat().st_size}


def _boot_measurements(build_dir: Path, manifest: Mapping[str, Any], part: Path) -> dict[str, Any] | None:
    """The build's boot reference values (``boot_measurements``), copied into the release: the servers' pools
    pin them (docs/attestation.md). The build folder's signature covers the file; it must also be the one
    the manifest lists, and load as the server loads it."""
    from protocol.errors import ProtocolError
    from protocol.measurements import load

    try:
        named = boot_measurements_output(manifest)
    except ValueError as exc:
        raise OutputError(f"the build's manifest: {exc}") from None
    if named is None:
        return None
    name, listed = named
    shutil.copyfile(build_dir / name, part / name)
    entry = _artifact(part, name)
    if not digests_equal(entry["sha256"], listed):
        raise OutputError(f"{build_dir / name}: not the boot measurements the build's manifest lists")
    try:
        reference = load((part / name).read_bytes())
    except ProtocolError as exc:
        raise OutputError(f"{build_dir / name}: the build's boot measurements do not load: {exc}") from None
    return {**entry, "pcrs": sorted(reference.pcrs)}


def _time_client(manifest: Mapping[str, Any]) -> str:
    """The time client the image runs (its manifest's ``contents.node.host.time_sync.client``), or the
    default for an image that names none."""
    node = (manifest.get("contents") or {}).get("node") or {}
    time_sync = (node.get("host") or {}).get("time_sync") or {}
    return str(time_sync.get("client") or nodespec.DEFAULT_TIME_CLIENT)


def release_name(spec: ReleaseSpec, version: str, architecture: str) -> str:
    if spec.name:
        return spec.name
    suffix = spec.suffix or (spec.pool.pool if spec.pool else "")
    return f"k8s-{version}-{architecture}" + (f"-{suffix}" if suffix else "")


def _cloud_init(spec: ReleaseSpec, work: Path, version: str, time_client: str) -> dict[str, str]:
    """file name -> text of each role's user-data, each validated twice (ours, then cloud-init's);
    ``time_client``: the image's (its manifest's ``contents.node.host.time_sync``)."""
    files: dict[str, str] = {}
    if spec.pool is not None:
        text = cloudinit.worker_user_data(spec.pool, time_client)
        cloudinit.check_worker(text)
        files["worker.user-data"] = text
    if spec.control_plane_endpoint:
        cp = ControlPlane(spec.control_plane_endpoint, version)
        init_docs = cloudinit.kubeadm_init_documents(cp)
        cloudinit.check_kubeadm(init_docs, ["InitConfiguration", "ClusterConfiguration"], version)
        join_doc = cloudinit.kubeadm_join_document(cp)
        cloudinit.check_kubeadm([join_doc], ["JoinConfiguration"], version)
        # The discovery kubeconfig exists only on the joining node (handed over out of band; a release holds
        # no secret): kubeadm checks that the file exists, so its copy here names a stand-in file.
        (work / "discovery.conf").write_text("")
        checked_join = {**join_doc, "discovery": {"file": {"kubeConfigPath": str(work / "discovery.conf")}}}
        for name, docs in (("kubeadm-init.yaml", init_docs), ("kubeadm-join.yaml", [checked_join])):
            (work / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
            cloudinit.validate_kubeadm(work / name, spec.kubeadm or None)
        files["control-plane-init.user-data"] = cloudinit.control_plane_init_user_data(cp)
        files["control-plane-join.user-data"] = cloudinit.control_plane_join_user_data(cp)
    if not files:
        raise BuildError(
            "a release needs a node pool (--pool ...) or a control plane (--control-plane-endpoint)"
        )
    for name, text in files.items():
        (work / name).write_text(text)
        cloudinit.validate_schema(work / name)
    return files


def write_release(spec: ReleaseSpec) -> Path:
    """Verify the build, assemble, check and publish the release folder; returns its path."""
    verified = verify_build(spec.build_dir, load_build_key(spec.build_key))
    manifest = load_manifest_bytes((spec.build_dir / "manifest.json").read_bytes())
    version = str((manifest.get("kubernetes") or {}).get("installed", ""))
    if not version:
        raise BuildError("the build's manifest names no installed Kubernetes version")
    architecture = str(manifest.get("architecture", "amd64"))
    name = release_name(spec, version, architecture)
    dest = spec.out / name
    if os.path.lexists(dest):
        raise OutputError(
            f"{dest}: a release of that name exists; releases are never changed in place",
            hint="give the new release another name (--suffix or --name)",
        )
    private = load_private_key(spec.signing_key)
    spec.out.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=spec.out))
    try:
        with tempfile.TemporaryDirectory(prefix="imagebuilder-release-") as scratch:
            _assemble(spec, part, Path(scratch), name, version, architecture, verified, manifest, private)
        os.chmod(part, 0o755)  # noqa: S103 - a release folder is published for servers to read
        try:
            os.rename(part, dest)  # the folder appears complete, or not at all
        except OSError as exc:
            raise OutputError(f"{dest}: cannot publish the release: {exc.strerror}") from None
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    log.info("release %s published at %s", name, dest)
    return dest


def _image_entry(part: Path, name: str, fmt: str, virtual_size: int | None) -> dict[str, Any]:
    """An image's entry of ``release.json`` from one read of it: its SHA-256 and size, its BLAKE3
    (protocol.imagedigest), and its per-chunk SHA-256 list, written beside it (protocol.chunklist)."""
    digests = digest_file(part / name)
    listed = name + chunklist.SUFFIX
    (part / listed).write_bytes(digests.chunk_list)
    entry = {"name": name, "sha256": digests.sha256, "size": digests.size, "format": fmt,
             "virtual_size": virtual_size, "blake3": digests.blake3,
             "chunks": {**_artifact(part, listed), "chunk_size": chunklist.CHUNK_SIZE}}  # fmt: skip
    return {k: v for k, v in entry.items() if v is not None}


def _assemble(  # noqa: PLR0917 - one private step of write_release
    spec: ReleaseSpec, part: Path, scratch: Path, name: str, version: str, architecture: str,
    verified: VerifyResult, manifest: Mapping[str, Any], private: Any,
) -> None:  # fmt: skip
    public: PublicKey = private.public_key()
    image = verified.image
    _link_or_copy(spec.build_dir / image, part / image)
    virtual = int((manifest.get("image") or {}).get("virtual_size") or 0) or None
    images = [_image_entry(part, image, "qcow2", virtual)]
    if images[0]["sha256"] != verified.image_sha256:  # the digests signed next are of the verified bytes
        raise OutputError(
            f"{spec.build_dir / image}: changed while the release was made (sha256 {images[0]['sha256']}, "
            f"verified {verified.image_sha256})",
            hint="publish a build folder that nothing writes to, then make the release again",
        )
    if spec.raw:
        raw = Path(image).with_suffix(".raw").name
        run(
            ["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(part / image), str(part / raw)],
            timeout=7200,
        )
        images.append(_image_entry(part, raw, "raw", (part / raw).stat().st_size))
    for source, dest in ((spec.imager_kernel, KERNEL), (spec.imager_initrd, INITRD)):
        shutil.copyfile(source, part / dest)
    cloud = _cloud_init(spec, scratch, version, _time_client(manifest))
    for file_name, text in cloud.items():
        (part / file_name).write_text(text)
    (part / SIGNING_KEY).write_bytes(public_pem(public))
    base = spec.base_url if spec.base_url.endswith("/") else spec.base_url + "/"
    url = f"{base}{name}/"
    qcow2_sha = images[0]["sha256"]
    params = [("console", spec.console), ("nodeimager.release", url), ("nodeimager.key", fingerprint(public)),
              ("nodeimager.image", f"sha256:{qcow2_sha}")]  # fmt: skip
    params += [(f"nodeagent.{key}", value) for key, value in sorted(spec.agent_params.items())]
    kernel, initrd = _artifact(part, KERNEL), _artifact(part, INITRD)
    script = BootScript(release=name, base_url=url, kernel=KERNEL, initrd=INITRD, kernel_sha256=kernel["sha256"],
                        initrd_sha256=initrd["sha256"], params=tuple(params), architecture=architecture,
                        retries=spec.retries, pause_s=spec.pause_s, require_digest=spec.require_digest)  # fmt: skip
    (part / "boot.ipxe").write_text(render_boot(script))
    (part / "entry.ipxe").write_text(render_entry(url, retries=spec.retries, pause_s=spec.pause_s))
    document: dict[str, Any] = {
        "schema": RELEASE_SCHEMA,
        "name": name,
        "architecture": architecture,
        "build": {
            "build_id": manifest["build_id"],
            "manifest_sha256": sha256_file(spec.build_dir / "manifest.json"),
            "image": image,
        },
        "kubernetes": {"version": version},
        "images": images,
        "imager": {"kernel": kernel, "initrd": initrd},
        "boot": {"script": "boot.ipxe", "entry": "entry.ipxe", "url": url, "key": fingerprint(public)},
        "disk": {"hints": dict(spec.hints), "without_hints": spec.without_hints},
        "cloud_init": {
            role: _artifact(part, f"{role}.user-data")
            for role in ("worker", "control-plane-init", "control-plane-join")
            if f"{role}.user-data" in cloud
        },
    }
    if (measurements := _boot_measurements(spec.build_dir, manifest, part)) is not None:
        document["boot_measurements"] = measurements
    if spec.pool is not None:
        document["pool"] = spec.pool.pool
    if spec.events_url:
        document["events"] = {"url": spec.events_url}
    write_atomic(part / RELEASE_MANIFEST, dump_json(document))
    digests = {entry.name: sha256_file(entry) for entry in sorted(part.iterdir())}
    write_atomic(part / SHA256SUMS, format_sha256sums(digests))
    subjects = {**digests, SHA256SUMS: sha256_file(part / SHA256SUMS)}
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": n, "digest": {"sha256": subjects[n]}} for n in sorted(subjects)],
        "predicateType": RELEASE_ATTESTATION,
        "predicate": {
            "release": name,
            "buildId": manifest["build_id"],
            "manifest": RELEASE_MANIFEST,
            "image": image,
        },
    }
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode("utf-8")
    write_atomic(part / SIGNATURE, dump_json(sign_envelope(IN_TOTO_PAYLOAD_TYPE, payload, private)))
    _self_check(part, public)
    log.info("release %s signed by %s", name, key_id(public))


def _self_check(part: Path, public: PublicKey) -> None:
    """Read the folder back with the imager's readers: it must verify before it is published."""
    try:
        verify_release(part, public)
    except VerificationError as exc:
        raise OutputError(f"the assembled release does not read back: {exc}") from None


def verify_release(folder: Path, public: PublicKey) -> None:
    """A release folder as the imager reads it: the DSSE signature by ``public``, ``release.json`` as the signed
    statement names it, and every file it lists (images, chunk lists, cloud-init, the imager, boot measurements)
    by its digest, each image's BLAKE3 and chunk digests too; :class:`VerificationError` names the first that
    does not match."""
    try:
        key = load_public_key(public_pem(public))
        verified = verify_envelope(parse_envelope((folder / SIGNATURE).read_bytes()), [key])
        view = read_manifest(read_statement(verified), (folder / RELEASE_MANIFEST).read_bytes())
    except OSError as exc:
        raise VerificationError(f"{folder}: cannot read the release: {exc}") from None
    except ValueError as exc:
        raise VerificationError(
            f"{folder}: the release does not verify with key {key_id(public)}: {exc}",
            hint="pass the public key the release was signed with (its signing-key file is not proof of it)",
        ) from None
    extra = () if view.boot_measurements is None else (view.boot_measurements,)
    lists = tuple(image.chunks for image in view.images if image.chunks is not None)
    for artifact in (*view.images, *lists, *view.cloud_init.values(), *view.imager.values(), *extra):
        path = folder / artifact.name
        if not path.is_file() or sha256_file(path) != artifact.sha256:
            raise VerificationError(
                f"{path}: missing, or not the file the signed release lists (sha256 mismatch)"
            )
    for image in view.images:
        if image.chunks is None or image.blake3 is None:
            raise VerificationError(f"{image.name}: the release lists no chunk digests or no BLAKE3 for it")
        try:
            chunklist.parse((folder / image.chunks.name).read_bytes(), size=image.size,
                            chunk_size=image.chunks.chunk_size, name=image.chunks.name)  # fmt: skip
        except ValueError as exc:
            raise VerificationError(f"{folder / image.chunks.name}: {exc}") from None
        found = digest_file(folder / image.name, image.chunks.chunk_size)
        if found.blake3 != image.blake3 or found.chunk_list != (folder / image.chunks.name).read_bytes():
            raise VerificationError(
                f"{folder / image.name}: its BLAKE3 or its chunk digests are not the ones the signed release lists"
            )


__all__ = ["ReleaseSpec", "release_name", "verify_release", "write_release"]
