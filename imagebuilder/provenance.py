"""The build's provenance: an in-toto Statement v1 with an SLSA provenance v1 predicate, from the
build manifest alone (deterministic: the same manifest gives the same bytes).

* ``subject``: every output of the manifest except logs (``*.log``), with its sha256; the image is one.
* ``buildDefinition.externalParameters``: the definition and lock files (path and sha256): what the
  person who started the build chose.
* ``buildDefinition.internalParameters``: what the builder chose: the architecture, the build host and
  the manifest's ``options`` object when the build records one.
* ``buildDefinition.resolvedDependencies``: every input with its URI and sha256 (kind, version,
  destination and size as annotations).
* ``runDetails``: the builder id and versions (the builder's and every tool's), the build id as
  ``invocationId``, start and finish times, and the logs (``console.log``) as byproducts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from imagebuilder.buildfolder import check_manifest, image_output, sorted_by
from imagebuilder.errors import OutputError

log = logging.getLogger(__name__)

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://nodetrust.dev/imagebuilder/build/v1"

_ANNOTATED = ("kind", "version", "destination", "size")


def is_byproduct(output: Mapping[str, Any]) -> bool:
    """Logs are byproducts, not subjects: SLSA's "needed for debugging, not the output of the build"."""
    return str(output.get("name", "")).endswith(".log")


def make_provenance(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The in-toto Statement (SLSA provenance v1) for the build that ``manifest`` describes."""
    try:
        checked = check_manifest(dict(manifest))
    except ValueError as exc:
        raise OutputError(f"manifest.json: {exc}") from None
    image_output(checked)
    outputs = sorted_by(checked["outputs"], "name")
    subjects = [_descriptor(out) for out in outputs if not is_byproduct(out)]
    byproducts = [_descriptor(out, media_type=True) for out in outputs if is_byproduct(out)]

    builder = checked["builder"]
    versions = {str(k): str(v) for k, v in sorted(dict(checked.get("tools") or {}).items())}
    versions["imagebuilder"] = str(builder["version"])
    internal: dict[str, Any] = {}
    for key, value in (("architecture", checked.get("architecture")), ("host", builder.get("host"))):
        if isinstance(value, str) and value:
            internal[key] = value
    options = checked.get("options")
    if isinstance(options, Mapping):
        internal["options"] = dict(options)

    statement = {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": SLSA_PROVENANCE_V1,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "definition": _file_ref(checked["definition"]),
                    "lock": _file_ref(checked["lock"]),
                },
                "internalParameters": internal,
                "resolvedDependencies": [
                    _dependency(item) for item in sorted_by(checked["inputs"], "name", "url", "sha256")
                ],
            },
            "runDetails": {
                "builder": {"id": str(builder["id"]), "version": versions},
                "metadata": {
                    "invocationId": str(checked["build_id"]),
                    "startedOn": str(checked["started_at"]),
                    "finishedOn": str(checked["finished_at"]),
                },
                "byproducts": byproducts,
            },
        },
    }
    log.debug(
        "provenance for %s: %d subjects, %d dependencies",
        checked["build_id"],
        len(subjects),
        len(checked["inputs"]),
    )
    return statement


def _descriptor(output: Mapping[str, Any], *, media_type: bool = False) -> dict[str, Any]:
    descriptor: dict[str, Any] = {"name": str(output["name"]), "digest": {"sha256": str(output["sha256"])}}
    if media_type and isinstance(output.get("media_type"), str):
        descriptor["mediaType"] = output["media_type"]
    return descriptor


def _file_ref(ref: Mapping[str, Any]) -> dict[str, Any]:
    return {"path": str(ref["path"]), "digest": {"sha256": str(ref["sha256"])}}


def _dependency(item: Mapping[str, Any]) -> dict[str, Any]:
    dependency: dict[str, Any] = {"name": str(item["name"]), "digest": {"sha256": str(item["sha256"])}}
    if item.get("url"):
        dependency["uri"] = str(item["url"])
    annotations = {key: item[key] for key in _ANNOTATED if item.get(key) not in (None, "")}
    if annotations:
        dependency["annotations"] = annotations
    return dependency
