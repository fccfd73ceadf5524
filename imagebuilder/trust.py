"""Write a build folder's trust outputs, after the build wrote the image, console.log and manifest.json
and before it publishes the folder (atomically, by renaming it into place).

Order: check the folder against the manifest, then write ``sbom.spdx.json``, ``provenance.intoto.json``,
``SHA256SUMS`` (every file of the folder except ``SHA256SUMS`` and ``signature.dsse.json``) and, when a
key is given, ``signature.dsse.json``. Each file is written through a temporary file and a rename.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

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
    dump_json,
    folder_entries,
    format_sha256sums,
    load_manifest_bytes,
    sha256_bytes,
    sha256_file,
    write_atomic,
)
from imagebuilder.errors import OutputError
from imagebuilder.provenance import make_provenance
from imagebuilder.sbom import make_sbom
from imagebuilder.sign import PrivateKey, load_private_key, sign_folder

log = logging.getLogger(__name__)


def write_trust_outputs(build_dir: Path, *, key: Path | None, created: str | None = None) -> None:
    """Write the SBOM, the provenance, ``SHA256SUMS`` and (with ``key``) the signature into ``build_dir``.

    ``created`` (``YYYY-MM-DDThh:mm:ssZ``) is the SBOM's creation time; by default the manifest's
    ``reproducible.source_date_epoch`` (every build of one lock has the same), else ``SOURCE_DATE_EPOCH`` when set,
    else now. The key is loaded first, so a bad key fails before anything is written. Trust
    outputs already in the folder are replaced; a stale signature is removed when no key is given.
    Raises OutputError when the folder does not match its manifest, KeyFileError for a bad key.
    """
    if not build_dir.is_dir():
        raise OutputError(f"{build_dir}: not a directory")
    private_key: PrivateKey | None = load_private_key(key) if key is not None else None
    manifest = _read_manifest(build_dir)
    digests = _check_outputs(build_dir, manifest)

    for name in (SBOM, PROVENANCE, SHA256SUMS, SIGNATURE):
        if (build_dir / name).exists():
            log.info("replacing the existing %s", name)
            (build_dir / name).unlink()

    sbom = dump_json(make_sbom(manifest, created=created or _created(manifest)))
    write_atomic(build_dir / SBOM, sbom)
    provenance = dump_json(make_provenance(manifest))
    write_atomic(build_dir / PROVENANCE, provenance)

    digests[MANIFEST] = sha256_file(build_dir / MANIFEST)
    digests[SBOM] = sha256_bytes(sbom)
    digests[PROVENANCE] = sha256_bytes(provenance)
    present = set(folder_entries(build_dir)) - NOT_IN_SHA256SUMS
    if present != set(digests):
        raise OutputError(f"{build_dir}: files appeared or vanished while the trust outputs were written")
    write_atomic(build_dir / SHA256SUMS, format_sha256sums(digests))

    if private_key is not None:
        sign_folder(build_dir, private_key, digests)
    log.info(
        "trust outputs written for %s (%d files, %s)",
        manifest["build_id"],
        len(digests),
        "signed" if private_key is not None else "unsigned",
    )


def _read_manifest(build_dir: Path) -> Manifest:
    try:
        return load_manifest_bytes((build_dir / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise OutputError(f"{MANIFEST}: missing from {build_dir}") from None
    except ValueError as exc:
        raise OutputError(f"{MANIFEST}: {exc}") from None


def _check_outputs(build_dir: Path, manifest: Manifest) -> dict[str, str]:
    """Hash every output once; each must be a regular file matching the manifest, and nothing else
    but the trust files may be in the folder. Returns name -> sha256 of the outputs."""
    entries = folder_entries(build_dir)
    outputs = {str(out["name"]): out for out in manifest["outputs"]}
    digests: dict[str, str] = {}
    for name in sorted(set(outputs) | {n for n in entries if n not in TRUST_FILES}):
        kind = entries.get(name)
        if kind is None:
            raise OutputError(f"{name}: listed in {MANIFEST} outputs but missing from the folder")
        if kind != "file":
            raise OutputError(f"{name}: is a {kind}; a build folder holds regular files only")
        if name not in outputs:
            raise OutputError(f"{name}: in the folder but not listed in {MANIFEST} outputs")
        path = build_dir / name
        actual, expected = sha256_file(path), str(outputs[name]["sha256"])
        if not digests_equal(expected, actual):
            raise OutputError(f"{name}: sha256 mismatch ({MANIFEST} says {expected}, file is {actual})")
        size = path.stat().st_size
        if size != outputs[name]["size"]:
            raise OutputError(
                f"{name}: size mismatch ({MANIFEST} says {outputs[name]['size']}, file is {size})"
            )
        digests[name] = actual
    for name in TRUST_FILES - {MANIFEST}:
        if entries.get(name, "file") != "file":
            raise OutputError(f"{name}: is a {entries[name]}; a build folder holds regular files only")
    return digests


def _created(manifest: Manifest) -> str:
    """The manifest's SOURCE_DATE_EPOCH (a reproducible build's), else the environment's, else now."""
    repro = manifest.get("reproducible")
    if isinstance(repro, dict) and isinstance(repro.get("source_date_epoch"), int):
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(repro["source_date_epoch"])))
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    try:
        seconds = int(epoch) if epoch else int(time.time())
    except ValueError:
        raise OutputError(f"SOURCE_DATE_EPOCH={epoch!r} is not a whole number of seconds") from None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
