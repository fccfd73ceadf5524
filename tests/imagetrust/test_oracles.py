"""The ecosystem's own verifiers as second opinions on the SBOM, the provenance and the signature.

Our schema (imagebuilder/schemas/spdx-2.3-subset.schema.json) and our verify step were written by
us; these tests hold the same outputs to the reference implementations:

* the SBOM to spdx-tools (SPDX's own parser and full validator) and its package URLs to
  packageurl-python (the purl reference implementation), which must read back exactly the name,
  version and architecture the manifest gave and write the same canonical string;
* the provenance to in-toto-attestation's Statement and SLSA provenance v1 protobuf models, parsed
  with unknown fields refused (a misspelt field fails instead of being dropped);
* signature.dsse.json to securesystemslib's DSSE envelope verification, for both key kinds.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
from in_toto_attestation.v1.statement import Statement
from packageurl import PackageURL
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError as SslibVerificationError
from securesystemslib.signer import SSlibKey
from spdx_tools.spdx.parser.parse_anything import parse_file
from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

from imagebuilder.provenance import make_provenance
from imagebuilder.sbom import make_sbom
from imagebuilder.sign import key_id, load_public_key
from imagebuilder.trust import write_trust_outputs
from tests.imagetrust.conftest import BUILD_ID, KeyFiles, make_manifest

CREATED = "2026-11-30T08:42:00Z"
# Names, versions and architectures that exercise the purl encoding: epochs, '+', '~', '.', '-'.
TRICKY_PACKAGES: list[dict[str, Any]] = [
    {"name": "g++-12", "version": "12.2.0-14+deb12u1", "architecture": "amd64"},
    {"name": "libc6.1", "version": "1:2.36~rc1+dfsg-9", "architecture": "arm64"},
    {"name": "python3-ruamel.yaml", "version": "0.17.21-1", "architecture": "all"},
]
TRICKY_WHEELS: list[dict[str, Any]] = [
    {
        "name": "Foo_Bar.baz",
        "kind": "wheel",
        "version": "1.0.post1+local.7",
        "url": "https://files.example/Foo_Bar.baz-1.0.post1+local.7-py3-none-any.whl",
        "sha256": "cd" * 32,
        "size": 15,
        "destination": "/opt/nodeagent",
    }
]


@pytest.fixture
def manifest(unsigned_build: Path) -> dict[str, Any]:
    doc = make_manifest(unsigned_build)
    doc["packages"] += copy.deepcopy(TRICKY_PACKAGES)
    doc["inputs"] += copy.deepcopy(TRICKY_WHEELS)
    return doc


# --- SBOM ---------------------------------------------------------------------------------------


def test_spdx_tools_parses_and_fully_validates_the_sbom(manifest: dict[str, Any], tmp_path: Path) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    path = tmp_path / "sbom.spdx.json"
    path.write_text(json.dumps(sbom))
    document = parse_file(str(path))
    problems = [message.validation_message for message in validate_full_spdx_document(document)]
    assert problems == []
    assert document.creation_info.spdx_version == "SPDX-2.3"
    assert len(document.packages) == len(sbom["packages"])
    assert {p.spdx_id for p in document.packages} == {p["SPDXID"] for p in sbom["packages"]}
    described = [r for r in document.relationships if r.relationship_type.name == "DESCRIBES"]
    assert [(r.spdx_element_id, r.related_spdx_element_id) for r in described] == [
        ("SPDXRef-DOCUMENT", "SPDXRef-Image")
    ]


def test_spdx_tools_would_catch_a_broken_sbom(manifest: dict[str, Any], tmp_path: Path) -> None:
    """The oracle can fail: a relationship to an element that does not exist is reported."""
    sbom = make_sbom(manifest, created=CREATED)
    sbom["relationships"].append(
        {"spdxElementId": "SPDXRef-Image", "relationshipType": "CONTAINS", "relatedSpdxElement": "SPDXRef-x"}
    )
    path = tmp_path / "sbom.spdx.json"
    path.write_text(json.dumps(sbom))
    problems = [m.validation_message for m in validate_full_spdx_document(parse_file(str(path)))]
    assert any("SPDXRef-x" in problem for problem in problems), problems


def test_every_purl_reads_back_with_packageurl_python(manifest: dict[str, Any]) -> None:
    sbom = make_sbom(manifest, created=CREATED)
    debs = {(p["name"], p["version"], p["architecture"]) for p in manifest["packages"]}
    wheels = {(i["name"], i["version"]) for i in manifest["inputs"] if i["kind"] == "wheel"}
    seen_debs, seen_wheels = set(), set()
    for package in sbom["packages"]:
        for ref in package.get("externalRefs", []):
            assert ref["referenceType"] == "purl"
            purl = PackageURL.from_string(ref["referenceLocator"])
            assert purl.to_string() == ref["referenceLocator"]  # already in canonical form
            if purl.type == "deb":
                assert purl.namespace == manifest["distro"]
                assert isinstance(purl.qualifiers, dict)
                seen_debs.add((purl.name, purl.version, purl.qualifiers["arch"]))
                assert (package["name"], package["versionInfo"]) == (purl.name, purl.version)
            else:
                assert purl.type == "pypi"
                seen_wheels.add((package["name"], purl.version))
                assert purl.name == "foo-bar-baz" or purl.name == package["name"].lower()
    assert seen_debs == debs
    assert seen_wheels == wheels


# --- provenance ---------------------------------------------------------------------------------


def _parse_statement(document: dict[str, Any]) -> statement_pb2.Statement:
    message = json_format.ParseDict(document, statement_pb2.Statement())
    wrapped = Statement.copy_from_pb(message)
    wrapped.validate()
    for subject in message.subject:
        ResourceDescriptor.copy_from_pb(subject).validate()
    return message


def test_the_provenance_parses_as_in_toto_statement_and_slsa_provenance_v1(manifest: dict[str, Any]) -> None:
    document = make_provenance(manifest)
    statement = _parse_statement(document)
    assert statement.predicate_type == "https://slsa.dev/provenance/v1"
    provenance = json_format.ParseDict(document["predicate"], provenance_pb2.Provenance())
    definition, run = provenance.build_definition, provenance.run_details
    assert definition.build_type == "https://nodetrust.dev/imagebuilder/build/v1"
    assert len(definition.resolved_dependencies) == len(manifest["inputs"])
    for dependency in definition.resolved_dependencies:
        ResourceDescriptor.copy_from_pb(dependency).validate()
        assert set(dependency.digest) == {"sha256"}
    assert run.metadata.invocation_id == manifest["build_id"]
    assert run.metadata.started_on.ToJsonString() == manifest["started_at"]
    assert run.metadata.finished_on.ToJsonString() == manifest["finished_at"]
    assert dict(run.builder.version)["imagebuilder"] == manifest["builder"]["version"]
    assert [b.name for b in run.byproducts] == ["console.log"]


@pytest.mark.parametrize(
    "where",
    ["statement", "predicate", "buildDefinition", "runDetails", "metadata", "subject"],
)
def test_an_unknown_provenance_field_is_refused(manifest: dict[str, Any], where: str) -> None:
    document = make_provenance(manifest)
    predicate = document["predicate"]
    target = {
        "statement": document,
        "predicate": predicate,
        "buildDefinition": predicate["buildDefinition"],
        "runDetails": predicate["runDetails"],
        "metadata": predicate["runDetails"]["metadata"],
        "subject": document["subject"][0],
    }[where]
    target["unexpectedField"] = "x"
    with pytest.raises(json_format.ParseError, match="unexpectedField"):
        _parse_statement(document)
        json_format.ParseDict(predicate, provenance_pb2.Provenance())


# --- DSSE ---------------------------------------------------------------------------------------


@pytest.fixture
def signed(unsigned_build: Path, keys: KeyFiles) -> Path:
    write_trust_outputs(unsigned_build, key=keys[0])
    return unsigned_build


def _sslib_key(keys: KeyFiles) -> SSlibKey:
    public = load_public_key(keys[1])
    return SSlibKey.from_crypto(public, keyid=key_id(public))


def test_securesystemslib_verifies_the_signature(signed: Path, keys: KeyFiles) -> None:
    envelope = Envelope.from_dict(json.loads((signed / "signature.dsse.json").read_text()))
    assert envelope.payload_type == "application/vnd.in-toto+json"
    accepted = envelope.verify([_sslib_key(keys)], 1)
    assert list(accepted) == [key_id(load_public_key(keys[1]))]
    statement = _parse_statement(json.loads(envelope.payload))
    assert statement.predicate_type == "https://nodetrust.dev/image-attestation/v1"
    assert {s.name for s in statement.subject} >= {"SHA256SUMS", "manifest.json", "sbom.spdx.json"}
    assert statement.predicate["buildId"] == BUILD_ID


def test_securesystemslib_refuses_a_changed_payload(signed: Path, keys: KeyFiles) -> None:
    document = json.loads((signed / "signature.dsse.json").read_text())
    payload = json.loads(base64.b64decode(document["payload"]))
    payload["predicate"]["buildId"] = "another-build"
    document["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    with pytest.raises(SslibVerificationError):
        Envelope.from_dict(document).verify([_sslib_key(keys)], 1)


def test_securesystemslib_refuses_another_key(signed: Path, make_keys: Any, key_kind: str) -> None:
    other = make_keys(key_kind, "other")
    envelope = Envelope.from_dict(json.loads((signed / "signature.dsse.json").read_text()))
    public = load_public_key(other[1])
    wrong_key_same_id = SSlibKey.from_crypto(public, keyid=envelope.signatures.popitem()[0])
    envelope = Envelope.from_dict(json.loads((signed / "signature.dsse.json").read_text()))
    with pytest.raises(SslibVerificationError):
        envelope.verify([wrong_key_same_id], 1)
