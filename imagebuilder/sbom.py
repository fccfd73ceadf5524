"""The image's SBOM: an SPDX 2.3 JSON document made from the build manifest alone.

The image is the described root package (with its sha256). It CONTAINS every Debian package that
``dpkg-query`` found in the installed target (``packages``) and every input staged into it (``inputs``
with a ``destination``); an input that was only used to build it (the installer ISO) is its
BUILD_TOOL_OF. The output is a function of the manifest: for a reproducible build (its manifest has
``reproducible``) ``documentNamespace`` is derived from the lock's digest and ``builtDate`` is
``SOURCE_DATE_EPOCH``, so every build of one lock has the same SBOM; for a manifest without it the
namespace is unique per call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Mapping
from importlib import resources
from typing import Any
from urllib.parse import quote, urlsplit

from imagebuilder.buildfolder import check_manifest, image_output, sorted_by
from imagebuilder.errors import OutputError
from imagebuilder.reproducible import iso_time, sbom_namespace_uuid

log = logging.getLogger(__name__)

SPDX_VERSION = "SPDX-2.3"
NAMESPACE_BASE = "https://nodetrust.dev/spdx/"
IMAGE_ID = "SPDXRef-Image"
DOCUMENT_ID = "SPDXRef-DOCUMENT"
NOASSERTION = "NOASSERTION"
SCHEMA_FILE = "spdx-2.3-subset.schema.json"

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_CREATED = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_MAINTAINER = re.compile(r"\s*(?P<name>[^<>]+?)\s*<(?P<email>[^<>\s]+)>\s*")
# SPDX 2.3 clause 7.7: a network URL, optionally with a VCS prefix (the schema holds the same pattern).
_DOWNLOAD_LOCATION = re.compile(r"((git|hg|svn|bzr)\+)?(https?|ftp|sftp|ssh|git)://\S+")
_PURPOSE = {
    "iso": "INSTALL",
    "deb": "INSTALL",
    "wheel": "LIBRARY",
    "binary": "APPLICATION",
    "tarball": "ARCHIVE",
    "archive": "ARCHIVE",
    "oci-image": "CONTAINER",
    "image": "CONTAINER",
}


def make_sbom(
    manifest: Mapping[str, Any],
    *,
    created: str,
    distro: str | None = None,
    namespace_uuid: uuid.UUID | None = None,
) -> dict[str, Any]:
    """The SPDX 2.3 document for the build that ``manifest`` describes.

    ``created`` is the creation time, ``YYYY-MM-DDThh:mm:ssZ``. ``distro`` is the purl namespace of the
    installed packages (``pkg:deb/<distro>/...``); it defaults to the manifest's ``distro`` key, then to
    ``ubuntu``. ``namespace_uuid`` sets the UUID in ``documentNamespace``; by default it is the lock's
    (:func:`imagebuilder.reproducible.sbom_namespace_uuid`) for a reproducible build, else random.
    """
    try:
        checked = check_manifest(dict(manifest))
    except ValueError as exc:
        raise OutputError(f"manifest.json: {exc}") from None
    if _CREATED.fullmatch(created) is None:
        raise ValueError(f"created must be YYYY-MM-DDThh:mm:ssZ (UTC), not {created!r}")
    namespace = distro or str(checked.get("distro", "ubuntu"))
    build_id = str(checked["build_id"])
    image = image_output(checked)
    ids: set[str] = {DOCUMENT_ID, IMAGE_ID}
    built = str(checked["finished_at"])
    repro = checked.get("reproducible")
    if isinstance(repro, Mapping) and isinstance(repro.get("source_date_epoch"), int):
        built = iso_time(int(repro["source_date_epoch"]))
        if namespace_uuid is None:
            namespace_uuid = sbom_namespace_uuid(str(checked["lock"]["sha256"]))

    root: dict[str, Any] = {
        "SPDXID": IMAGE_ID,
        "name": str(checked["name"]),
        "versionInfo": build_id,
        "packageFileName": str(image["name"]),
        "checksums": [_sha256(str(image["sha256"]))],
        "builtDate": built,
        "primaryPackagePurpose": "OPERATING-SYSTEM",
        "comment": f"QCOW2 node image built by {checked['builder']['id']} {checked['builder']['version']}",
        **_unknowns(),
    }
    packages: list[dict[str, Any]] = [root]
    relationships: list[dict[str, str]] = [_rel(DOCUMENT_ID, "DESCRIBES", IMAGE_ID)]

    for item in sorted_by(checked["inputs"], "name", "version", "sha256", "url"):
        pkg = _input_package(item, ids)
        packages.append(pkg)
        if item.get("destination"):
            relationships.append(_rel(IMAGE_ID, "CONTAINS", pkg["SPDXID"]))
        else:
            relationships.append(_rel(pkg["SPDXID"], "BUILD_TOOL_OF", IMAGE_ID))

    for item in sorted_by(checked["packages"], "name", "architecture", "version"):
        pkg = _deb_package(item, namespace, ids)
        packages.append(pkg)
        relationships.append(_rel(IMAGE_ID, "CONTAINS", pkg["SPDXID"]))

    tool_version = str(checked["builder"]["version"])
    document = {
        "spdxVersion": SPDX_VERSION,
        "dataLicense": "CC0-1.0",
        "SPDXID": DOCUMENT_ID,
        "name": build_id,
        "documentNamespace": f"{NAMESPACE_BASE}{build_id}-{namespace_uuid or uuid.uuid4()}",
        "creationInfo": {
            "created": created,
            "creators": [f"Tool: nodetrust-imagebuilder-{tool_version}"],
        },
        "packages": packages,
        "relationships": relationships,
    }
    log.debug("SBOM for %s: %d packages, %d relationships", build_id, len(packages), len(relationships))
    return document


def sbom_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of the SPDX 2.3 subset :func:`make_sbom` emits
    (``imagebuilder/schemas/spdx-2.3-subset.schema.json``)."""
    text = resources.files("imagebuilder.schemas").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def deb_purl(distro: str, name: str, version: str, architecture: str) -> str:
    """``pkg:deb/<distro>/<name>@<version>?arch=<arch>``, percent-encoded as the purl spec says: the
    ``:`` of an epoch and ``.-_~`` stay as they are, anything else (``+``) is encoded (``%2B``)."""
    return f"pkg:deb/{distro}/{_purl_part(name)}@{_purl_part(version)}?arch={_purl_part(architecture)}"


def pypi_purl(name: str, version: str) -> str:
    normalized = re.sub(r"[-_.]+", "-", name).lower()
    return f"pkg:pypi/{_purl_part(normalized)}@{_purl_part(version)}"


def root_package(document: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The package the document DESCRIBES, or None when there is not exactly one."""
    described = [
        rel.get("relatedSpdxElement")
        for rel in document.get("relationships", [])
        if isinstance(rel, Mapping)
        and rel.get("spdxElementId") == DOCUMENT_ID
        and rel.get("relationshipType") == "DESCRIBES"
    ]
    if len(described) != 1:
        return None
    for pkg in document.get("packages", []):
        if isinstance(pkg, Mapping) and pkg.get("SPDXID") == described[0]:
            return pkg
    return None


def package_sha256(package: Mapping[str, Any]) -> str | None:
    """The SHA256 checksum of an SPDX package, or None."""
    for checksum in package.get("checksums", []):
        if isinstance(checksum, Mapping) and checksum.get("algorithm") == "SHA256":
            value = checksum.get("checksumValue")
            return value if isinstance(value, str) else None
    return None


def _purl_part(value: str) -> str:
    return quote(value, safe=":")


def _sha256(hexdigest: str) -> dict[str, str]:
    return {"algorithm": "SHA256", "checksumValue": hexdigest}


def _rel(element: str, kind: str, related: str) -> dict[str, str]:
    return {"spdxElementId": element, "relationshipType": kind, "relatedSpdxElement": related}


def _unknowns() -> dict[str, Any]:
    return {
        "supplier": NOASSERTION,
        "downloadLocation": NOASSERTION,
        "filesAnalyzed": False,
        "licenseConcluded": NOASSERTION,
        "licenseDeclared": NOASSERTION,
        "copyrightText": NOASSERTION,
    }


def _unique_id(prefix: str, parts: tuple[str, ...], ids: set[str], *, salt: str) -> str:
    """``SPDXRef-<prefix>-<parts>`` with characters outside ``[A-Za-z0-9.-]`` replaced by ``-``; when two
    elements would share an identifier, the later one gets a short digest of ``salt`` (its full identity)."""
    base = "SPDXRef-" + "-".join([prefix, *(_ID_UNSAFE.sub("-", p).strip("-") or "x" for p in parts)])
    candidate = base
    if candidate in ids:
        candidate = f"{base}-{hashlib.sha256(salt.encode('utf-8')).hexdigest()[:12]}"
    counter = 2
    while candidate in ids:
        candidate = f"{base}-{counter}"
        counter += 1
    ids.add(candidate)
    return candidate


def _deb_package(item: Mapping[str, Any], distro: str, ids: set[str]) -> dict[str, Any]:
    name, version, arch = str(item["name"]), str(item["version"]), str(item["architecture"])
    pkg: dict[str, Any] = {
        "SPDXID": _unique_id("deb", (name, arch), ids, salt=f"{name}\0{version}\0{arch}"),
        "name": name,
        "versionInfo": version,
        "externalRefs": [_purl_ref(deb_purl(distro, name, version, arch))],
        **_unknowns(),
    }
    maintainer = item.get("maintainer")
    if isinstance(maintainer, str) and (match := _MAINTAINER.fullmatch(maintainer)):
        pkg["supplier"] = f"Organization: {match['name']} ({match['email']})"
    return pkg


def _input_package(item: Mapping[str, Any], ids: set[str]) -> dict[str, Any]:
    name, url, kind = str(item["name"]), str(item.get("url", "")), str(item.get("kind", ""))
    version = item.get("version")
    parts = (name, version) if isinstance(version, str) and version else (name,)
    pkg: dict[str, Any] = {
        "SPDXID": _unique_id("Input", parts, ids, salt=f"{name}\0{version}\0{url}\0{item['sha256']}"),
        "name": name,
        "checksums": [_sha256(str(item["sha256"]))],
        **_unknowns(),
    }
    if isinstance(version, str) and version:
        pkg["versionInfo"] = version
    if _DOWNLOAD_LOCATION.fullmatch(url):
        pkg["downloadLocation"] = url
    elif url:
        # SPDX download locations are network URLs; a local file: source is recorded, not asserted.
        pkg["sourceInfo"] = f"fetched from {url}"
    filename = urlsplit(url).path.rsplit("/", 1)[-1]
    if filename:
        pkg["packageFileName"] = filename
    if kind in _PURPOSE:
        pkg["primaryPackagePurpose"] = _PURPOSE[kind]
    if kind == "wheel" and isinstance(version, str) and version:
        pkg["externalRefs"] = [_purl_ref(pypi_purl(name, version))]
    destination = item.get("destination")
    notes = [f"input kind {kind}" if kind else "input"]
    if isinstance(destination, str) and destination:
        notes.append(f"staged at {destination}")
    pkg["comment"] = "; ".join(notes)
    return pkg


def _purl_ref(purl: str) -> dict[str, str]:
    return {"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": purl}
