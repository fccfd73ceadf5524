"""Verify a published build folder; stop at the first file that does not match and say why.

The checks, in this order (docs/building-images.md, "Keys, signatures and verification"):

1. ``SHA256SUMS`` parses, lists every file of the folder except itself and ``signature.dsse.json``,
   lists no missing file, and every listed digest matches its file. Only regular files may be there.
2. ``manifest.json`` parses and its ``outputs`` are exactly the folder's files other than the trust
   files, each with the right sha256 and size.
3. The SBOM's root package (the one ``SPDXRef-DOCUMENT`` DESCRIBES) has the image's sha256, and the
   provenance's subjects (and byproducts) carry the digests of the files they name, the image's included.
4. ``signature.dsse.json`` holds a DSSE signature that verifies with the given public key over an
   in-toto Statement whose subjects are exactly ``SHA256SUMS`` and every file it lists, with their digests.

Every file is hashed once; the small JSON files are parsed from the very bytes that were hashed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from imagebuilder.buildfolder import (
    MANIFEST,
    NOT_IN_SHA256SUMS,
    PROVENANCE,
    SBOM,
    SHA256SUMS,
    SIGNATURE,
    TRUST_FILES,
    Manifest,
    digests_equal,
    folder_entries,
    image_output,
    is_sha256_hex,
    load_manifest_bytes,
    parse_sha256sums,
    sha256_bytes,
    sha256_file,
)
from imagebuilder.errors import FolderMismatch, OutputError, VerificationError
from imagebuilder.provenance import SLSA_PROVENANCE_V1, STATEMENT_TYPE
from imagebuilder.sbom import DOCUMENT_ID, SPDX_VERSION, package_sha256, root_package
from imagebuilder.sign import (
    ATTESTATION_TYPE,
    IN_TOTO_PAYLOAD_TYPE,
    PublicKey,
    key_id,
    key_kind,
    verify_envelope,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyResult:
    """What a successful verification found."""

    build_id: str
    image: str
    image_sha256: str
    signer_keyid: str | None
    signer_kind: str | None
    packages: int
    inputs: int
    files: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **asdict(self)}


def verify_build(build_dir: Path, public_key: PublicKey | None) -> VerifyResult:
    """Run the four checks on ``build_dir``; raise FolderMismatch naming the first file that fails.

    ``public_key=None`` skips the signature check (step 4); ``imagebuilder verify`` always passes a key.
    """
    if not build_dir.is_dir():
        raise OutputError(f"{build_dir}: not a directory")
    entries = folder_entries(build_dir)
    digests = _check_sha256sums(build_dir, entries)
    manifest = _check_manifest(build_dir, entries, digests)
    image = image_output(manifest)
    image_name, image_digest = str(image["name"]), digests[str(image["name"])]
    _check_sbom(build_dir, digests, image_name, image_digest)
    _check_provenance(build_dir, digests, manifest, image_name, image_digest)
    keyid = kind = None
    if public_key is not None:
        _check_signature(build_dir, entries, digests, manifest, public_key)
        keyid, kind = key_id(public_key), key_kind(public_key)
    else:
        log.warning("%s: signature not checked (no public key given)", build_dir)
    return VerifyResult(
        build_id=str(manifest["build_id"]),
        image=image_name,
        image_sha256=image_digest,
        signer_keyid=keyid,
        signer_kind=kind,
        packages=len(manifest["packages"]),
        inputs=len(manifest["inputs"]),
        files=len(digests) + (1 if public_key is not None else 0),
    )


def _check_sha256sums(build_dir: Path, entries: Mapping[str, str]) -> dict[str, str]:
    """Step 1. Returns name -> sha256 for ``SHA256SUMS`` and every file it lists."""
    if entries.get(SHA256SUMS) is None:
        raise FolderMismatch(SHA256SUMS, "missing")
    if entries[SHA256SUMS] != "file":
        raise FolderMismatch(SHA256SUMS, f"is a {entries[SHA256SUMS]}, not a regular file")
    data = (build_dir / SHA256SUMS).read_bytes()
    try:
        listed = parse_sha256sums(data)
    except ValueError as exc:
        raise FolderMismatch(SHA256SUMS, str(exc)) from None
    forbidden = sorted(NOT_IN_SHA256SUMS & set(listed))
    if forbidden:
        raise FolderMismatch(SHA256SUMS, f"lists {forbidden[0]}, which it must not cover")
    digests = {SHA256SUMS: sha256_bytes(data)}
    for name in sorted(set(listed) | (set(entries) - NOT_IN_SHA256SUMS)):
        kind = entries.get(name)
        if kind is None:
            raise FolderMismatch(name, f"listed in {SHA256SUMS} but missing from the folder")
        if kind != "file":
            raise FolderMismatch(name, f"is a {kind}, not a regular file")
        if name not in listed:
            raise FolderMismatch(name, f"not listed in {SHA256SUMS}")
        actual = sha256_file(build_dir / name)
        if not digests_equal(listed[name], actual):
            raise FolderMismatch(
                name, f"sha256 mismatch ({SHA256SUMS} says {listed[name]}, file is {actual})"
            )
        digests[name] = actual
    log.debug("step 1: %d files match %s", len(listed), SHA256SUMS)
    return digests


def _read_hashed(build_dir: Path, name: str, digests: Mapping[str, str]) -> bytes:
    """A small file's bytes, which must still be the bytes step 1 hashed."""
    if name not in digests:
        raise FolderMismatch(name, "missing")
    data = (build_dir / name).read_bytes()
    if not digests_equal(sha256_bytes(data), digests[name]):
        raise FolderMismatch(name, "changed while the folder was being verified")
    return data


def _parse_json(name: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderMismatch(name, f"not valid UTF-8 JSON ({exc})") from None


def _check_manifest(build_dir: Path, entries: Mapping[str, str], digests: Mapping[str, str]) -> Manifest:
    """Step 2."""
    try:
        manifest = load_manifest_bytes(_read_hashed(build_dir, MANIFEST, digests))
    except ValueError as exc:
        raise FolderMismatch(MANIFEST, str(exc)) from None
    outputs = {str(out["name"]): out for out in manifest["outputs"]}
    published = {name for name in entries if name not in TRUST_FILES}
    for name in sorted(set(outputs) | published):
        if name not in published:
            raise FolderMismatch(name, f"listed in {MANIFEST} outputs but missing from the folder")
        if name not in outputs:
            raise FolderMismatch(name, f"not listed in {MANIFEST} outputs")
        expected = str(outputs[name]["sha256"])
        if not digests_equal(expected, digests[name]):
            raise FolderMismatch(
                name, f"sha256 mismatch ({MANIFEST} says {expected}, file is {digests[name]})"
            )
        size = (build_dir / name).stat().st_size
        if size != outputs[name]["size"]:
            raise FolderMismatch(
                name, f"size mismatch ({MANIFEST} says {outputs[name]['size']} bytes, file is {size} bytes)"
            )
    log.debug("step 2: %d outputs match %s", len(outputs), MANIFEST)
    return manifest


def _check_sbom(build_dir: Path, digests: Mapping[str, str], image_name: str, image_digest: str) -> None:
    """Step 3a."""
    document = _parse_json(SBOM, _read_hashed(build_dir, SBOM, digests))
    if not isinstance(document, dict) or document.get("spdxVersion") != SPDX_VERSION:
        raise FolderMismatch(SBOM, f"not an {SPDX_VERSION} JSON document")
    root = root_package(document)
    if root is None:
        raise FolderMismatch(SBOM, f"no single package is DESCRIBED by {DOCUMENT_ID}")
    claimed = package_sha256(root)
    if claimed is None:
        raise FolderMismatch(SBOM, f"the root package {root.get('SPDXID')} has no SHA256 checksum")
    if not digests_equal(claimed, image_digest):
        raise FolderMismatch(
            SBOM,
            f"root package checksum {claimed} does not equal the image digest {image_digest} ({image_name})",
        )


def _check_provenance(
    build_dir: Path, digests: Mapping[str, str], manifest: Manifest, image_name: str, image_digest: str
) -> None:
    """Step 3b."""
    statement = _parse_json(PROVENANCE, _read_hashed(build_dir, PROVENANCE, digests))
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise FolderMismatch(PROVENANCE, f"not an in-toto Statement ({STATEMENT_TYPE})")
    if statement.get("predicateType") != SLSA_PROVENANCE_V1:
        raise FolderMismatch(PROVENANCE, f"predicateType is not {SLSA_PROVENANCE_V1}")
    predicate = statement.get("predicate")
    run = predicate.get("runDetails") if isinstance(predicate, dict) else None
    metadata = run.get("metadata") if isinstance(run, dict) else None
    invocation = metadata.get("invocationId") if isinstance(metadata, dict) else None
    if invocation != manifest["build_id"]:
        raise FolderMismatch(
            PROVENANCE,
            f"invocationId {invocation!r} is not the manifest's build_id {manifest['build_id']!r}",
        )
    subjects = _descriptors(PROVENANCE, statement.get("subject"), "subject")
    if image_name not in subjects:
        raise FolderMismatch(PROVENANCE, f"no subject names the image {image_name}")
    if not digests_equal(subjects[image_name], image_digest):
        raise FolderMismatch(
            PROVENANCE,
            f"subject {image_name} sha256 {subjects[image_name]} does not equal the image digest {image_digest}",
        )
    byproducts = _descriptors(
        PROVENANCE, run.get("byproducts", []) if isinstance(run, dict) else [], "byproduct"
    )
    for what, named in (("subject", subjects), ("byproduct", byproducts)):
        for name, claimed in sorted(named.items()):
            if name not in digests:
                raise FolderMismatch(PROVENANCE, f"{what} {name} is not in the folder")
            if not digests_equal(claimed, digests[name]):
                raise FolderMismatch(
                    PROVENANCE, f"{what} {name} sha256 {claimed} does not equal the file's {digests[name]}"
                )


def _descriptors(owner: str, items: object, what: str) -> dict[str, str]:
    """``[{name, digest: {sha256}}]`` as name -> sha256; anything malformed is ``owner``'s fault."""
    if not isinstance(items, list):
        raise FolderMismatch(owner, f"{what} is not a list")
    named: dict[str, str] = {}
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        digest = item.get("digest") if isinstance(item, dict) else None
        sha = digest.get("sha256") if isinstance(digest, dict) else None
        if not isinstance(name, str) or not is_sha256_hex(sha):
            raise FolderMismatch(owner, f"a {what} lacks a name or a sha256 digest")
        if name in named:
            raise FolderMismatch(owner, f"{what} {name} appears twice")
        named[name] = str(sha)
    return named


def _check_signature(
    build_dir: Path,
    entries: Mapping[str, str],
    digests: Mapping[str, str],
    manifest: Manifest,
    public_key: PublicKey,
) -> None:
    """Step 4."""
    kind = entries.get(SIGNATURE)
    if kind is None:
        raise FolderMismatch(SIGNATURE, "missing: the build was not signed")
    if kind != "file":
        raise FolderMismatch(SIGNATURE, f"is a {kind}, not a regular file")
    envelope = _parse_json(SIGNATURE, (build_dir / SIGNATURE).read_bytes())
    try:
        payload = verify_envelope(envelope, public_key, payload_type=IN_TOTO_PAYLOAD_TYPE)
    except VerificationError as exc:
        raise FolderMismatch(SIGNATURE, exc.message) from None
    statement = _parse_json(SIGNATURE, payload)
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise FolderMismatch(SIGNATURE, "the signed payload is not an in-toto Statement v1")
    if statement.get("predicateType") != ATTESTATION_TYPE:
        raise FolderMismatch(SIGNATURE, f"the signed statement's predicateType is not {ATTESTATION_TYPE}")
    predicate = statement.get("predicate")
    signed_build = predicate.get("buildId") if isinstance(predicate, dict) else None
    if signed_build != manifest["build_id"]:
        raise FolderMismatch(
            SIGNATURE, f"signs build {signed_build!r}, but {MANIFEST} is build {manifest['build_id']!r}"
        )
    subjects = _descriptors(SIGNATURE, statement.get("subject"), "subject")
    for name in sorted(set(subjects) | set(digests)):
        if name not in subjects:
            raise FolderMismatch(SIGNATURE, f"the signed statement does not cover {name}")
        if name not in digests:
            raise FolderMismatch(SIGNATURE, f"the signed statement names {name}, which is not in the folder")
        if not digests_equal(subjects[name], digests[name]):
            raise FolderMismatch(
                name, f"sha256 mismatch ({SIGNATURE} says {subjects[name]}, file is {digests[name]})"
            )
    log.debug("step 4: signature by %s covers %d files", key_id(public_key), len(subjects))
