"""The signed release files every consumer of a build reads: the statement, the build manifest, the
release manifest.

A published build folder and a release folder are both signed the same way: ``signature.dsse.json``
is a DSSE envelope over an in-toto Statement v1 whose subjects are ``SHA256SUMS`` and every file it
lists, each with its sha256. They differ in the predicate:

* a build (``https://nodetrust.dev/image-attestation/v1``): ``buildId``, ``image``, ``manifest``
  (``manifest.json``, docs/image-manifest.md);
* a release (``https://nodetrust.dev/release-attestation/v1``): ``release`` (its name), ``buildId``,
  ``manifest`` (``release.json``, docs/bare-metal.md "The release manifest").

:func:`read_statement` turns a verified payload into a :class:`Statement`; :func:`read_manifest`
checks the signed manifest (whose bytes must hash to the statement's subject) and returns a
:class:`ReleaseView`: the image artifacts with their signed digests and sizes, and, for a release,
the imager artifacts, the node-pool and control-plane cloud-init, the disk policy and the events
URL. Every digest the view carries is the one the statement signs: a manifest that disagrees with
its own statement is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from protocol import chunklist, imagedigest
from protocol.dsse import Verified
from protocol.errors import ReleaseFormatError

__all__ = [
    "BUILD_ATTESTATION",
    "BUILD_MANIFEST",
    "MAX_MANIFEST_BYTES",
    "NO_HINT_POLICIES",
    "RELEASE_ATTESTATION",
    "RELEASE_MANIFEST",
    "RELEASE_SCHEMA",
    "ROLES",
    "SHA256SUMS",
    "SIGNATURE",
    "STATEMENT_TYPE",
    "Artifact",
    "ChunkList",
    "Image",
    "ReleaseView",
    "Statement",
    "digests_equal",
    "read_manifest",
    "read_statement",
]

SIGNATURE = "signature.dsse.json"
SHA256SUMS = "SHA256SUMS"
BUILD_MANIFEST = "manifest.json"
RELEASE_MANIFEST = "release.json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
BUILD_ATTESTATION = "https://nodetrust.dev/image-attestation/v1"
RELEASE_ATTESTATION = "https://nodetrust.dev/release-attestation/v1"
RELEASE_SCHEMA = "https://nodetrust.dev/release/v1"
QCOW2_MEDIA_TYPE = "application/x-qemu-disk"
RAW_MEDIA_TYPE = "application/vnd.nodetrust.raw-disk"
#: A manifest larger than this is refused before it is parsed (a build manifest with a thousand
#: packages is about 200 KiB).
MAX_MANIFEST_BYTES = 16 << 20
#: What the imager does when no disk hint is given: refuse, or Ironic's smallest disk of >= 4 GiB.
NO_HINT_POLICIES = ("refuse", "smallest")
#: The cloud-init a release carries, by the role of the node that boots it.
ROLES = ("worker", "control-plane-init", "control-plane-join")
IMAGE_FORMATS = ("qcow2", "raw")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_HINT_KEYS = frozenset({"serial", "wwn", "model", "vendor", "size", "by_path", "rotational"})


def digests_equal(a: str, b: str) -> bool:
    """Compare two hex digests in constant time (case-insensitive: hex is hex)."""
    return hmac.compare_digest(a.lower().encode("ascii", "replace"), b.lower().encode("ascii", "replace"))


@dataclass(frozen=True)
class Statement:
    """A verified statement: what it signs (file name -> sha256) and what it is."""

    kind: Literal["build", "release"]
    name: str  # the build id, or the release name
    build_id: str
    manifest: str  # the signed manifest's file name
    subjects: Mapping[str, str]
    key_id: str

    def digest(self, name: str) -> str:
        """The signed sha256 of ``name``; ReleaseFormatError when the statement does not sign it."""
        value = self.subjects.get(name)
        if value is None:
            raise ReleaseFormatError(SIGNATURE, f"the signed statement does not cover {name}")
        return value


@dataclass(frozen=True)
class Artifact:
    """A file of the folder with its signed digest and size."""

    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class ChunkList(Artifact):
    """The signed list of an image's per-chunk SHA-256 (:mod:`protocol.chunklist`)."""

    chunk_size: int = 0


@dataclass(frozen=True)
class Image(Artifact):
    format: str = "qcow2"  # "qcow2" or "raw"
    virtual_size: int | None = None  # the disk the image holds, in bytes (None: not recorded)
    chunks: ChunkList | None = None  # a release's per-chunk digests of this image (None: not published)
    blake3: str | None = None  # a release's BLAKE3 of the image, signed with it (protocol.imagedigest)


@dataclass(frozen=True)
class ReleaseView:
    """What a consumer needs from a verified build or release, every digest signed."""

    kind: Literal["build", "release"]
    name: str
    build_id: str
    images: tuple[Image, ...]
    architecture: str = ""
    kubernetes_version: str = ""
    pool: str = ""
    events_url: str = ""
    no_hint_policy: str = "refuse"
    hints: Mapping[str, str] = field(default_factory=dict)
    cloud_init: Mapping[str, Artifact] = field(default_factory=dict)
    imager: Mapping[str, Artifact] = field(default_factory=dict)
    # a release's copy of the build's boot-measurements.json (what a pool pins), with the PCRs it checks
    boot_measurements: Artifact | None = None
    measured_pcrs: tuple[int, ...] = ()

    def image(self, fmt: str | None = None) -> Image:
        """The image of format ``fmt`` (default: the first the manifest lists)."""
        for image in self.images:
            if fmt is None or image.format == fmt:
                return image
        have = ", ".join(f"{i.name} ({i.format})" for i in self.images)
        raise ReleaseFormatError(
            RELEASE_MANIFEST if self.kind == "release" else BUILD_MANIFEST,
            f"no {fmt} image (the folder has {have})",
        )


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(obj: Mapping[str, Any], key: str, file: str, where: str = "", *, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise ReleaseFormatError(file, f"{where}{key} must be a non-empty string")
    return value


def _size(obj: Mapping[str, Any], key: str, file: str, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ReleaseFormatError(file, f"{where}{key} must be a non-negative integer")
    return value


def read_statement(verified: Verified) -> Statement:
    """The statement a verified envelope carries; ReleaseFormatError names what is wrong."""
    try:
        statement = json.loads(verified.payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ReleaseFormatError(SIGNATURE, f"the signed payload is not UTF-8 JSON ({exc})") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise ReleaseFormatError(SIGNATURE, "the signed payload is not an in-toto Statement v1")
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict):
        raise ReleaseFormatError(SIGNATURE, "the signed statement has no predicate object")
    kind: Literal["build", "release"]
    if statement.get("predicateType") == BUILD_ATTESTATION:
        kind, name_key, manifest = "build", "buildId", BUILD_MANIFEST
    elif statement.get("predicateType") == RELEASE_ATTESTATION:
        kind, name_key, manifest = "release", "release", RELEASE_MANIFEST
    else:
        raise ReleaseFormatError(
            SIGNATURE,
            f"predicateType {statement.get('predicateType')!r} is neither a build ({BUILD_ATTESTATION}) "
            f"nor a release ({RELEASE_ATTESTATION})",
        )
    name = _str(predicate, name_key, SIGNATURE, "predicate.")
    build_id = _str(predicate, "buildId", SIGNATURE, "predicate.")
    if _NAME.fullmatch(name) is None:
        raise ReleaseFormatError(SIGNATURE, f"predicate.{name_key} {name[:80]!r} is not a plain name")
    if predicate.get("manifest") != manifest:
        raise ReleaseFormatError(SIGNATURE, f"predicate.manifest must be {manifest!r} for a {kind}")
    items = statement.get("subject")
    if not isinstance(items, list) or not items:
        raise ReleaseFormatError(SIGNATURE, "the signed statement has no subjects")
    subjects: dict[str, str] = {}
    for item in items:
        sub_name = item.get("name") if isinstance(item, dict) else None
        digest = item.get("digest") if isinstance(item, dict) else None
        sha = digest.get("sha256") if isinstance(digest, dict) else None
        if not isinstance(sub_name, str) or _NAME.fullmatch(sub_name) is None:
            raise ReleaseFormatError(SIGNATURE, "a subject's name is missing or not a plain file name")
        if not isinstance(sha, str) or _HEX64.fullmatch(sha) is None:
            raise ReleaseFormatError(SIGNATURE, f"subject {sub_name} has no lower-case hex sha256")
        if sub_name in subjects:
            raise ReleaseFormatError(SIGNATURE, f"subject {sub_name} appears twice")
        subjects[sub_name] = sha
    for needed in (SHA256SUMS, manifest):
        if needed not in subjects:
            raise ReleaseFormatError(SIGNATURE, f"the signed statement does not cover {needed}")
    return Statement(kind, name, build_id, manifest, subjects, verified.key_id)


def _parse(statement: Statement, data: bytes) -> dict[str, Any]:
    file = statement.manifest
    if len(data) > MAX_MANIFEST_BYTES:
        raise ReleaseFormatError(file, f"{len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    actual = hashlib.sha256(data).hexdigest()
    signed = statement.digest(file)
    if not digests_equal(actual, signed):
        raise ReleaseFormatError(
            file, f"sha256 mismatch (the signature says {signed}, the file is {actual})", reason="digest"
        )
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ReleaseFormatError(file, f"not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ReleaseFormatError(file, "not a JSON object")
    return obj


def _artifact(statement: Statement, obj: object, where: str) -> Artifact:
    file = statement.manifest
    if not isinstance(obj, dict):
        raise ReleaseFormatError(file, f"{where} must be an object with name, sha256 and size")
    name = _str(obj, "name", file, f"{where}.")
    sha = _str(obj, "sha256", file, f"{where}.")
    size = _size(obj, "size", file, f"{where}.")
    if _HEX64.fullmatch(sha) is None:
        raise ReleaseFormatError(file, f"{where}.sha256 must be 64 lower-case hex digits")
    signed = statement.digest(name)
    if not digests_equal(sha, signed):
        raise ReleaseFormatError(
            file,
            f"{where} {name}: sha256 {sha} is not the one the signature covers ({signed})",
            reason="digest",
        )
    return Artifact(name, signed, size)


def _image(statement: Statement, obj: Mapping[str, Any], where: str, fmt: str, vsize: object) -> Image:
    base = _artifact(statement, obj, where)
    if fmt not in IMAGE_FORMATS:
        raise ReleaseFormatError(statement.manifest, f"{where}.format {fmt!r} is not one of {IMAGE_FORMATS}")
    virtual: int | None = None
    if vsize is not None:
        if not isinstance(vsize, int) or isinstance(vsize, bool) or vsize <= 0:
            raise ReleaseFormatError(statement.manifest, f"{where}.virtual_size must be a positive integer")
        virtual = vsize
    if fmt == "raw":
        virtual = base.size if virtual is None else virtual
        if virtual != base.size:
            raise ReleaseFormatError(statement.manifest, f"{where}: a raw image's virtual size is its size")
    chunks = None
    if obj.get("chunks") is not None:
        listed = _artifact(statement, obj["chunks"], f"{where}.chunks")
        chunk_size = chunklist.check_chunk_size(
            obj["chunks"].get("chunk_size"), statement.manifest, f"{where}.chunks"
        )
        if listed.size != chunklist.chunk_count(base.size, chunk_size) * chunklist.LINE:
            raise ReleaseFormatError(
                statement.manifest,
                f"{where}.chunks: {listed.size} bytes do not list the chunks of a {base.size}-byte image",
            )
        chunks = ChunkList(listed.name, listed.sha256, listed.size, chunk_size)
    blake3 = obj.get("blake3")
    if blake3 is not None and not imagedigest.is_hex(blake3):
        raise ReleaseFormatError(statement.manifest, f"{where}.blake3 must be 64 lower-case hex digits")
    return Image(base.name, base.sha256, base.size, fmt, virtual, chunks, blake3)


def _build_view(statement: Statement, manifest: dict[str, Any]) -> ReleaseView:
    file = statement.manifest
    if manifest.get("build_id") != statement.build_id:
        raise ReleaseFormatError(
            file, f"build_id {manifest.get('build_id')!r} is not the signed build {statement.build_id!r}"
        )
    outputs = manifest.get("outputs")
    if not isinstance(outputs, list):
        raise ReleaseFormatError(file, "outputs must be a list")
    recorded = _obj(manifest.get("image"))
    images: list[Image] = []
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise ReleaseFormatError(file, f"outputs[{i}] must be an object")
        name = str(out.get("name", ""))
        if out.get("media_type") == QCOW2_MEDIA_TYPE or name.endswith(".qcow2"):
            images.append(_image(statement, out, f"outputs[{i}]", "qcow2", recorded.get("virtual_size")))
        elif out.get("media_type") == RAW_MEDIA_TYPE:
            images.append(_image(statement, out, f"outputs[{i}]", "raw", None))
    if not [i for i in images if i.format == "qcow2"]:
        raise ReleaseFormatError(file, "outputs hold no QCOW2 image")
    if len([i for i in images if i.format == "qcow2"]) > 1:
        raise ReleaseFormatError(file, "outputs hold more than one QCOW2 image")
    kubernetes = _obj(manifest.get("kubernetes"))
    return ReleaseView(
        kind="build",
        name=statement.name,
        build_id=statement.build_id,
        images=tuple(sorted(images, key=lambda i: i.format != "qcow2")),
        architecture=str(manifest.get("architecture", "")),
        kubernetes_version=str(kubernetes.get("installed", "")),
    )


def _events_url(file: str, obj: object) -> str:
    if obj is None:
        return ""
    if not isinstance(obj, dict) or not isinstance(obj.get("url"), str):
        raise ReleaseFormatError(file, "events must be an object with a url")
    url = str(obj["url"])
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise ReleaseFormatError(file, f"events.url {url[:120]!r} is not an http:// or https:// URL")
    return url


def _disk(file: str, obj: object) -> tuple[str, dict[str, str]]:
    if obj is None:
        return "refuse", {}
    if not isinstance(obj, dict):
        raise ReleaseFormatError(file, "disk must be an object")
    policy = obj.get("without_hints", "refuse")
    if policy not in NO_HINT_POLICIES:
        raise ReleaseFormatError(
            file, f"disk.without_hints must be one of {NO_HINT_POLICIES}, not {policy!r}"
        )
    hints = obj.get("hints", {})
    if not isinstance(hints, dict):
        raise ReleaseFormatError(file, "disk.hints must be an object")
    out: dict[str, str] = {}
    for key, value in hints.items():
        if key not in _HINT_KEYS:
            raise ReleaseFormatError(
                file, f"disk.hints.{key}: unknown hint (known: {', '.join(sorted(_HINT_KEYS))})"
            )
        if not isinstance(value, str | bool | int) or (isinstance(value, bool) and key != "rotational"):
            raise ReleaseFormatError(file, f"disk.hints.{key} must be a string")
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return str(policy), out


def _release_view(statement: Statement, manifest: dict[str, Any]) -> ReleaseView:
    file = statement.manifest
    if manifest.get("schema") != RELEASE_SCHEMA:
        raise ReleaseFormatError(file, f"schema must be {RELEASE_SCHEMA!r}")
    if manifest.get("name") != statement.name:
        raise ReleaseFormatError(
            file, f"name {manifest.get('name')!r} is not the signed release {statement.name!r}"
        )
    build = manifest.get("build")
    if not isinstance(build, dict) or build.get("build_id") != statement.build_id:
        raise ReleaseFormatError(file, f"build.build_id is not the signed build {statement.build_id!r}")
    raw_images = manifest.get("images")
    if not isinstance(raw_images, list) or not raw_images:
        raise ReleaseFormatError(file, "images must be a non-empty list")
    images = []
    for i, obj in enumerate(raw_images):
        if not isinstance(obj, dict):
            raise ReleaseFormatError(file, f"images[{i}] must be an object")
        images.append(
            _image(statement, obj, f"images[{i}]", str(obj.get("format")), obj.get("virtual_size"))
        )
    if len({i.format for i in images}) != len(images):
        raise ReleaseFormatError(file, "images lists one format twice")
    cloud = manifest.get("cloud_init", {})
    if not isinstance(cloud, dict):
        raise ReleaseFormatError(file, "cloud_init must be an object")
    for role in cloud:
        if role not in ROLES:
            raise ReleaseFormatError(file, f"cloud_init.{role}: unknown role (known: {', '.join(ROLES)})")
    imager = manifest.get("imager", {})
    if not isinstance(imager, dict) or set(imager) - {"kernel", "initrd"}:
        raise ReleaseFormatError(file, "imager must be an object with kernel and initrd")
    kubernetes = _obj(manifest.get("kubernetes"))
    policy, hints = _disk(file, manifest.get("disk"))
    measured = manifest.get("boot_measurements")
    pcrs = measured.get("pcrs") if isinstance(measured, dict) else None
    if measured is not None and (
        not isinstance(pcrs, list) or not all(isinstance(p, int) and 0 <= p < 24 for p in pcrs)
    ):
        raise ReleaseFormatError(file, "boot_measurements.pcrs must be a list of PCR numbers (0-23)")
    return ReleaseView(
        kind="release",
        name=statement.name,
        build_id=statement.build_id,
        images=tuple(images),
        architecture=_str(manifest, "architecture", file, required=False),
        kubernetes_version=str(kubernetes.get("version", "")),
        pool=_str(manifest, "pool", file, required=False),
        events_url=_events_url(file, manifest.get("events")),
        no_hint_policy=policy,
        hints=hints,
        cloud_init={
            role: _artifact(statement, obj, f"cloud_init.{role}") for role, obj in sorted(cloud.items())
        },
        imager={part: _artifact(statement, obj, f"imager.{part}") for part, obj in sorted(imager.items())},
        boot_measurements=None if measured is None else _artifact(statement, measured, "boot_measurements"),
        measured_pcrs=tuple(pcrs or ()),
    )


def read_manifest(statement: Statement, data: bytes) -> ReleaseView:
    """Check the signed manifest's bytes against the statement and read what a consumer needs."""
    manifest = _parse(statement, data)
    if statement.kind == "build":
        return _build_view(statement, manifest)
    return _release_view(statement, manifest)
