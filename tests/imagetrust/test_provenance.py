"""The in-toto Statement with its SLSA provenance v1 predicate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from imagebuilder.provenance import make_provenance
from tests.imagetrust.conftest import IMAGE, INPUTS, make_manifest


@pytest.fixture
def manifest(unsigned_build: Path) -> dict[str, Any]:
    return make_manifest(unsigned_build)


def test_statement_shape(manifest: dict[str, Any]) -> None:
    statement = make_provenance(manifest)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    assert set(statement["predicate"]) == {"buildDefinition", "runDetails"}
    assert (
        statement["predicate"]["buildDefinition"]["buildType"]
        == "https://nodetrust.dev/imagebuilder/build/v1"
    )


def test_the_image_is_a_subject_and_the_console_log_a_byproduct(manifest: dict[str, Any]) -> None:
    statement = make_provenance(manifest)
    digests = {o["name"]: o["sha256"] for o in manifest["outputs"]}
    assert statement["subject"] == [{"name": IMAGE, "digest": {"sha256": digests[IMAGE]}}]
    assert statement["predicate"]["runDetails"]["byproducts"] == [
        {"name": "console.log", "digest": {"sha256": digests["console.log"]}, "mediaType": "text/plain"}
    ]


def test_other_outputs_are_subjects_too(manifest: dict[str, Any]) -> None:
    manifest["outputs"].append(
        {
            "name": "autoinstall-user-data.yaml",
            "sha256": "ab" * 32,
            "size": 3,
            "media_type": "application/yaml",
        }
    )
    names = [s["name"] for s in make_provenance(manifest)["subject"]]
    assert names == ["autoinstall-user-data.yaml", IMAGE]


def test_every_input_is_a_resolved_dependency_with_its_digest(manifest: dict[str, Any]) -> None:
    deps = make_provenance(manifest)["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert len(deps) == len(INPUTS)
    assert {(d["name"], d["uri"], d["digest"]["sha256"]) for d in deps} == {
        (i["name"], i["url"], i["sha256"]) for i in INPUTS
    }
    for dep in deps:
        assert set(dep["digest"]) == {"sha256"}
    kubelet = [d for d in deps if d["name"] == "kubelet"]
    assert [d["annotations"]["version"] for d in kubelet] == ["1.35.3-1.1", "1.36.3-1.1"]
    iso = next(d for d in deps if d["name"] == "installer-iso")
    assert iso["annotations"] == {"kind": "iso", "version": "12.8.0", "size": 3213064192}


def test_parameters(manifest: dict[str, Any]) -> None:
    definition = make_provenance(manifest)["predicate"]["buildDefinition"]
    assert definition["externalParameters"] == {
        "definition": {
            "path": manifest["definition"]["path"],
            "digest": {"sha256": manifest["definition"]["sha256"]},
        },
        "lock": {"path": manifest["lock"]["path"], "digest": {"sha256": manifest["lock"]["sha256"]}},
    }
    assert definition["internalParameters"] == {"architecture": "amd64", "host": "ci-runner-7"}
    manifest["options"] = {"accelerator": "tcg", "memory_mib": 4096}
    internal = make_provenance(manifest)["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["options"] == {"accelerator": "tcg", "memory_mib": 4096}


def test_run_details(manifest: dict[str, Any]) -> None:
    run = make_provenance(manifest)["predicate"]["runDetails"]
    assert run["builder"]["id"] == "https://nodetrust.dev/imagebuilder@v1"
    assert run["builder"]["version"] == {
        "imagebuilder": "0.1.0",
        "libvirt": "9.0.0",
        "python": "3.11.2",
        "qemu-img": "7.2.22",
    }
    assert run["metadata"] == {
        "invocationId": manifest["build_id"],
        "startedOn": "2026-11-30T08:15:00Z",
        "finishedOn": "2026-11-30T08:41:10Z",
    }


def test_the_same_manifest_gives_the_same_bytes(manifest: dict[str, Any]) -> None:
    first = json.dumps(make_provenance(manifest), sort_keys=True)
    manifest["inputs"].reverse()
    assert json.dumps(make_provenance(manifest), sort_keys=True) == first
