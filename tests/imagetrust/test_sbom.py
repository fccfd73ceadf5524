"""The SPDX 2.3 SBOM: valid against our schema, complete, deterministic, with correct purls."""

from __future__ import annotations

import copy
import json
import random
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from imagebuilder.errors import OutputError
from imagebuilder.sbom import deb_purl, make_sbom, pypi_purl, root_package, sbom_schema
from tests.imagetrust.conftest import IMAGE, INPUTS, PACKAGES, make_manifest

CREATED = "2026-11-30T08:42:00Z"
FIXED = uuid.UUID("00000000-0000-4000-8000-000000000001")


@pytest.fixture
def manifest(unsigned_build: Path) -> dict[str, Any]:
    return make_manifest(unsigned_build)


@pytest.fixture
def validator() -> jsonschema.Draft7Validator:
    schema = sbom_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _by_id(sbom: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["SPDXID"]: p for p in sbom["packages"]}


def test_the_sbom_validates_against_the_schema(
    manifest: dict[str, Any], validator: jsonschema.Draft7Validator
) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    errors = sorted(validator.iter_errors(sbom), key=str)
    assert errors == []
    # What the schema cannot say: identifiers are unique and every relationship points at one.
    ids = [p["SPDXID"] for p in sbom["packages"]]
    assert len(ids) == len(set(ids))
    for rel in sbom["relationships"]:
        assert rel["spdxElementId"] in {*ids, "SPDXRef-DOCUMENT"}
        assert rel["relatedSpdxElement"] in ids


def test_document_fields(manifest: dict[str, Any]) -> None:
    sbom = make_sbom(manifest, created=CREATED, namespace_uuid=FIXED)
    assert sbom["spdxVersion"] == "SPDX-2.3"
    assert sbom["dataLicense"] == "CC0-1.0"
    assert sbom["SPDXID"] == "SPDXRef-DOCUMENT"
    assert sbom["name"] == manifest["build_id"]
    assert sbom["documentNamespace"] == f"https://nodetrust.dev/spdx/{manifest['build_id']}-{FIXED}"
    assert sbom["creationInfo"] == {"created": CREATED, "creators": ["Tool: nodetrust-imagebuilder-0.1.0"]}


def test_the_image_is_the_described_root_package_with_its_digest(manifest: dict[str, Any]) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    root = root_package(sbom)
    assert root is not None
    image = next(o for o in manifest["outputs"] if o["name"] == IMAGE)
    assert root["SPDXID"] == "SPDXRef-Image"
    assert root["packageFileName"] == IMAGE
    assert root["checksums"] == [{"algorithm": "SHA256", "checksumValue": image["sha256"]}]
    assert sbom["packages"][0] is root
    assert sbom["relationships"][0] == {
        "spdxElementId": "SPDXRef-DOCUMENT",
        "relationshipType": "DESCRIBES",
        "relatedSpdxElement": "SPDXRef-Image",
    }


def test_every_installed_package_is_contained_with_its_purl(manifest: dict[str, Any]) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    contained = {
        r["relatedSpdxElement"]
        for r in sbom["relationships"]
        if r["spdxElementId"] == "SPDXRef-Image" and r["relationshipType"] == "CONTAINS"
    }
    found = {}
    for pkg in sbom["packages"]:
        refs = pkg.get("externalRefs", [])
        if refs and refs[0]["referenceLocator"].startswith("pkg:deb/"):
            assert pkg["SPDXID"] in contained
            assert pkg["supplier"] in {
                "NOASSERTION",
                "Organization: GNU Libc Maintainers (debian-glibc@lists.debian.org)",
            }
            assert pkg["downloadLocation"] == "NOASSERTION"
            assert pkg["licenseConcluded"] == pkg["licenseDeclared"] == "NOASSERTION"
            found[refs[0]["referenceLocator"]] = (pkg["name"], pkg["versionInfo"])
    assert found == {
        "pkg:deb/debian/openssh-server@1:9.2p1-2%2Bdeb12u3?arch=amd64": (
            "openssh-server",
            "1:9.2p1-2+deb12u3",
        ),
        "pkg:deb/debian/libstdc%2B%2B6@12.2.0-14?arch=amd64": ("libstdc++6", "12.2.0-14"),
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u7?arch=amd64": ("libc6", "2.36-9+deb12u7"),
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u7?arch=i386": ("libc6", "2.36-9+deb12u7"),
        "pkg:deb/debian/tzdata@2024a-0%2Bdeb12u1?arch=all": ("tzdata", "2024a-0+deb12u1"),
    }
    assert len(found) == len(PACKAGES)
    ids = _by_id(sbom)
    assert "SPDXRef-deb-libstdc-6-amd64" in ids  # '+' is outside [A-Za-z0-9.-]
    tzdata = next(p for p in sbom["packages"] if p["name"] == "tzdata")
    assert tzdata["supplier"] == "Organization: GNU Libc Maintainers (debian-glibc@lists.debian.org)"


def test_every_input_is_a_package_with_its_digest_and_source(manifest: dict[str, Any]) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    inputs = {
        (p["name"], p.get("versionInfo"), p["checksums"][0]["checksumValue"]): p
        for p in sbom["packages"]
        if p["SPDXID"].startswith("SPDXRef-Input-")
    }
    assert set(inputs) == {(i["name"], i["version"], i["sha256"]) for i in INPUTS}
    rels = {
        (r["spdxElementId"], r["relationshipType"], r["relatedSpdxElement"]) for r in sbom["relationships"]
    }
    for item in INPUTS:
        pkg = inputs[(item["name"], item["version"], item["sha256"])]
        assert pkg["checksums"] == [{"algorithm": "SHA256", "checksumValue": item["sha256"]}]
        if item["url"].startswith("https://"):
            assert pkg["downloadLocation"] == item["url"]
        else:  # file: is not a network download location; it is recorded, not asserted
            assert pkg["downloadLocation"] == "NOASSERTION"
            assert pkg["sourceInfo"] == f"fetched from {item['url']}"
        if item["destination"]:
            assert ("SPDXRef-Image", "CONTAINS", pkg["SPDXID"]) in rels
            assert item["destination"] in pkg["comment"]
        else:
            assert (pkg["SPDXID"], "BUILD_TOOL_OF", "SPDXRef-Image") in rels
    wheel = next(p for p in inputs.values() if p["name"] == "nodeagent")
    assert wheel["externalRefs"][0]["referenceLocator"] == "pkg:pypi/nodeagent@0.1.0"


def test_ordering_is_deterministic(manifest: dict[str, Any]) -> None:
    first = make_sbom(manifest, created=CREATED, namespace_uuid=FIXED)
    shuffled = copy.deepcopy(manifest)
    random.Random(7).shuffle(shuffled["packages"])
    random.Random(7).shuffle(shuffled["inputs"])
    assert shuffled["packages"] != manifest["packages"]
    second = make_sbom(shuffled, created=CREATED, namespace_uuid=FIXED)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    names = [p["name"] for p in first["packages"][1 + len(INPUTS) :]]
    assert names == sorted(names)


def test_the_namespace_is_unique_per_document(manifest: dict[str, Any]) -> None:
    namespaces = {make_sbom(manifest, created=CREATED)["documentNamespace"] for _ in range(3)}
    assert len(namespaces) == 3
    for ns in namespaces:
        assert ns.startswith(f"https://nodetrust.dev/spdx/{manifest['build_id']}-")
        uuid.UUID(ns.rsplit(f"{manifest['build_id']}-", 1)[1])


def test_distro_defaults_to_ubuntu_and_can_be_overridden(manifest: dict[str, Any]) -> None:
    del manifest["distro"]
    locators = [
        ref["referenceLocator"]
        for p in make_sbom(manifest, created=CREATED)["packages"]
        for ref in p.get("externalRefs", [])
    ]
    assert "pkg:deb/ubuntu/libc6@2.36-9%2Bdeb12u7?arch=i386" in locators
    overridden = make_sbom(manifest, created=CREATED, distro="debian")
    assert any(
        ref["referenceLocator"] == "pkg:deb/debian/libc6@2.36-9%2Bdeb12u7?arch=i386"
        for p in overridden["packages"]
        for ref in p.get("externalRefs", [])
    )


def test_purl_encoding() -> None:
    assert deb_purl("ubuntu", "openssh-server", "1:9.6p1-3ubuntu13", "amd64") == (
        "pkg:deb/ubuntu/openssh-server@1:9.6p1-3ubuntu13?arch=amd64"
    )
    assert deb_purl("ubuntu", "libstdc++6", "14-20240412~24.04", "amd64") == (
        "pkg:deb/ubuntu/libstdc%2B%2B6@14-20240412~24.04?arch=amd64"
    )
    assert pypi_purl("Node_Agent", "0.1.0") == "pkg:pypi/node-agent@0.1.0"


def test_colliding_identifiers_stay_unique(
    manifest: dict[str, Any], validator: jsonschema.Draft7Validator
) -> None:
    manifest["packages"] = [
        {"name": "a+b", "version": "1", "architecture": "amd64"},
        {"name": "a.b", "version": "1", "architecture": "amd64"},
        {"name": "a-b", "version": "1", "architecture": "amd64"},
        {"name": "a_b", "version": "1", "architecture": "amd64"},
    ]
    sbom = make_sbom(manifest, created=CREATED)
    ids = [p["SPDXID"] for p in sbom["packages"]]
    assert len(ids) == len(set(ids))
    assert list(validator.iter_errors(sbom)) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("packages", 1, "SPDXID"), "SPDXRef-Input_iso"),
        (("packages", 1, "SPDXID"), "SPDXRef-"),
        (("packages", 0, "checksums", 0, "algorithm"), "SHA-256"),
        (("packages", 0, "checksums", 0, "checksumValue"), "abc"),
        (("packages", 0, "checksums", 0, "checksumValue"), "A" * 64),
        (("packages", 0, "filesAnalyzed"), True),
        (("packages", 0, "downloadLocation"), "file:/tmp/x"),
        (("packages", 0, "supplier"), "ACME"),
        (("packages", 0, "primaryPackagePurpose"), "DISK"),
        (("creationInfo", "created"), "2026-11-30 08:42:00"),
        (("creationInfo", "creators"), []),
        (("creationInfo", "creators", 0), "nodetrust"),
        (("documentNamespace",), "https://nodetrust.dev/spdx/x#y"),
        (("spdxVersion",), "SPDX-2.2"),
        (("relationships", 0, "relationshipType"), "HAS"),
        (("packages", 6, "externalRefs", 0, "referenceLocator"), "deb/libc6"),
    ],
)
def test_the_schema_rejects_what_spdx_forbids(
    manifest: dict[str, Any], validator: jsonschema.Draft7Validator, path: tuple[Any, ...], value: object
) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    target: Any = sbom
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert not validator.is_valid(sbom)


@pytest.mark.parametrize("field", ["SPDXID", "name", "downloadLocation", "filesAnalyzed"])
def test_the_schema_requires_package_fields(
    manifest: dict[str, Any], validator: jsonschema.Draft7Validator, field: str
) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    del sbom["packages"][0][field]
    assert not validator.is_valid(sbom)


def test_the_schema_rejects_fields_it_does_not_know(
    manifest: dict[str, Any], validator: jsonschema.Draft7Validator
) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    sbom["packages"][0]["licenceConcluded"] = "NOASSERTION"  # misspelt
    assert not validator.is_valid(sbom)


def test_bad_inputs_are_refused(manifest: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="YYYY-MM-DDThh:mm:ssZ"):
        make_sbom(manifest, created="2026-11-30T08:42:00+00:00")
    broken = copy.deepcopy(manifest)
    broken["packages"][0].pop("architecture")
    with pytest.raises(OutputError, match=r"manifest.json: packages\[0\].architecture"):
        make_sbom(broken, created=CREATED)
    broken = copy.deepcopy(manifest)
    broken["outputs"][0].update(name="node.raw", media_type="application/octet-stream")
    with pytest.raises(OutputError, match="exactly one image"):
        make_sbom(broken, created=CREATED)
