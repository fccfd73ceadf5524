"""``imagebuilder rebuild``'s comparison: what must repeat (reprocheck), what differs inside an image (imagediff),
and the report and exit status of the command (without a VM: the build is the VM tier's)."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from imagebuilder import imagediff, reprocheck, reproducible
from imagebuilder.commands import rebuild
from imagebuilder.errors import BuildError, LockError
from tests.imagebuilder import sealkit
from tests.imagebuilder.sealkit import Member

MANIFEST: dict[str, Any] = {
    "build_id": "fixture-node-20261101T000000Z-3f3f3f",
    "name": "fixture-node",
    "started_at": "2026-12-07T01:00:00Z",
    "finished_at": "2026-12-07T01:20:00Z",
    "builder": {"id": "https://nodetrust.dev/imagebuilder@v1", "version": "0.1.0", "host": "ci-1"},
    "definition": {"path": "/tmp/a/fixture-node.yaml", "sha256": "1" * 64, "resolved_sha256": "2" * 64},
    "lock": {"path": "/tmp/a/fixture-node.lock.json", "sha256": "3" * 64},
    "inputs": [
        {"name": "iso", "sha256": "4" * 64, "version": ""},
        {"name": "kubelet", "sha256": "5" * 64, "version": "1.36.3"},
    ],
    "outputs": [
        {
            "name": "fixture-node.qcow2",
            "sha256": "6" * 64,
            "size": 10,
            "media_type": "application/x-qemu-disk",
        },
        {"name": "console.log", "sha256": "7" * 64, "size": 5, "media_type": "text/plain"},
        {"name": "boot-test.json", "sha256": "8" * 64, "size": 5, "media_type": "application/json"},
    ],
    "packages": [{"name": "bash", "version": "5.2", "architecture": "amd64"}],
    "phases": [{"name": "check", "started_at": "2026-12-07T01:00:00Z", "duration_s": 0.2}],
    "tools": {"qemu-img": "7.2.22", "mke2fs": "mke2fs 1.47.0 (5-Feb-2023)"},
    "accelerator": {"name": "tcg", "why": "probe"},
    "installer": {"ran": True, "events": 40},
    "build_path": "full",
    "base": {"key": "9" * 64, "sha256": "a" * 64, "created_at": "2026-12-07T01:05:00Z"},
    "agent": {
        "venv": "/opt/nodeagent/venv",
        "source": {"commit": "abc", "modified": [], "untracked_left_out": 3},
    },
    "reproducible": {"source_date_epoch": 1793491200},
}


def _rerun(**changes: Any) -> dict[str, Any]:
    """The same build on another machine at another time: only the run's record differs."""
    other = copy.deepcopy(MANIFEST)
    other.update(started_at="2026-12-08T09:00:00Z", finished_at="2026-12-08T09:31:00Z", build_path="incremental",
                 accelerator={"name": "kvm", "why": "probe"}, installer={"ran": False, "events": 0})  # fmt: skip
    other["builder"]["host"] = "laptop"
    other["definition"]["path"] = other["lock"]["path"] = "/home/me/x"
    other["tools"] = {"qemu-img": "8.2.2", "mke2fs": "mke2fs 1.47.0 (5-Feb-2023)"}
    other["phases"][0]["duration_s"] = 9.9
    other["base"] = {"key": "9" * 64, "sha256": "b" * 64}
    other["agent"]["source"]["untracked_left_out"] = 0
    for out in other["outputs"]:
        if out["name"] != "fixture-node.qcow2":
            out["sha256"] = "c" * 64
    other.update(changes)
    return other


def test_two_runs_of_one_build_compare_equal_except_the_run_record() -> None:
    assert reprocheck.comparable_manifest(MANIFEST) == reprocheck.comparable_manifest(_rerun())
    names = [o["name"] for o in reprocheck.comparable_manifest(MANIFEST)["outputs"]]
    assert names == ["fixture-node.qcow2"]
    assert "builder" in reprocheck.comparable_manifest(MANIFEST)  # its id and version stay


def test_a_content_difference_is_named_by_its_json_path() -> None:
    rerun = _rerun()
    rerun["outputs"][0]["sha256"] = "d" * 64
    rerun["packages"][0]["version"] = "5.3"
    rerun["inputs"].append({"name": "extra", "sha256": "e" * 64})
    found = reprocheck.differences(
        reprocheck.comparable_manifest(MANIFEST), reprocheck.comparable_manifest(rerun)
    )
    assert [f.path for f in found] == [
        "inputs[extra]",
        "outputs[fixture-node.qcow2].sha256",
        "packages[bash].version",
    ]
    assert found[1].describe().startswith("outputs[fixture-node.qcow2].sha256: '6666")
    assert found[0].to_json()["published"] is None


def test_the_provenance_keeps_the_builders_own_version() -> None:
    statement = {
        "subject": [{"name": "fixture-node.qcow2", "digest": {"sha256": "6" * 64}}, {"name": "boot-test.json"}],
        "predicate": {
            "buildDefinition": {"internalParameters": {"host": "a", "architecture": "amd64"},
                                "externalParameters": {"lock": {"path": "/x", "digest": {"sha256": "3" * 64}}}},
            "runDetails": {"builder": {"id": "b", "version": {"imagebuilder": "0.1.0", "qemu-img": "7.2"}},
                           "metadata": {"invocationId": "id", "startedOn": "t1", "finishedOn": "t2"},
                           "byproducts": [{"name": "console.log"}]},
        },
    }  # fmt: skip
    other = json.loads(json.dumps(statement))
    other["predicate"]["runDetails"]["builder"]["version"] = {"imagebuilder": "0.1.0", "qemu-img": "8.2"}
    other["predicate"]["runDetails"]["metadata"].update(startedOn="t3", finishedOn="t4")
    other["predicate"]["buildDefinition"]["internalParameters"]["host"] = "b"
    other["predicate"]["buildDefinition"]["externalParameters"]["lock"]["path"] = "/y"
    assert reprocheck.comparable_provenance(statement) == reprocheck.comparable_provenance(other)
    other["predicate"]["runDetails"]["builder"]["version"]["imagebuilder"] = "0.2.0"
    assert [d.path for d in reprocheck.differences(reprocheck.comparable_provenance(statement),
                                                   reprocheck.comparable_provenance(other))] == [
        "predicate.runDetails.builder.version.imagebuilder"]  # fmt: skip


def test_tool_versions_that_differ_are_listed() -> None:
    assert [d.describe() for d in reprocheck.tool_differences(MANIFEST, _rerun())] == [
        "tools.qemu-img: '7.2.22' -> '8.2.2'"
    ]


# -- inside the image --------------------------------------------------------------------------------------------


def _qcow2(tmp: Path, root: list[Member], *, lock: str = "5e") -> Path:
    ident = reproducible.identity(lock * 32, "2026-11-01T00:00:00Z")
    return sealkit.qcow2_disk(root + sealkit.esp_members(0.0), ident, tmp)


@pytest.mark.subprocess
def test_the_image_diff_names_the_table_the_metadata_and_each_file(tmp_path: Path) -> None:
    if shutil.which("qemu-img") is None:
        pytest.fail("qemu-img is missing (apt-get install qemu-utils)")
    pyc = b"\x6f\x0d\x0d\x0a" + bytes(4) + b"AAAAAAAA" + b"code"
    base = [
        *sealkit.root_members(0.0),
        Member("root/etc/x.pyc", data=pyc),
        Member("root/etc/gone", data=b"1"),
    ]
    published = _qcow2(tmp_path / "a", base)
    changed = [m for m in base if m.name != "root/etc/gone"]
    changed = [Member(m.name, data=b"\x6f\x0d\x0d\x0a" + bytes(4) + b"BBBBBBBB" + b"code") if m.name.endswith(".pyc")
               else Member(m.name, m.kind, m.data, 0o600, m.uid, m.gid, m.mtime, m.target, m.major, m.minor, m.pax)
               if m.name == "root/etc/shadow" else m for m in changed]  # fmt: skip
    changed.append(Member("root/etc/new", data=b"2"))
    rebuilt = _qcow2(tmp_path / "b", changed, lock="5f")
    diff = imagediff.diff_images(published, rebuilt, tmp_path / "diff")
    assert any(p.startswith("id: ") for p in diff.partition_table)
    assert any(p.startswith("partition 1 uuid") for p in diff.partition_table)
    assert any(f.startswith("root Filesystem UUID: ") for f in diff.file_systems)
    assert any(f.startswith("ESP UUID: ") for f in diff.file_systems)
    by_path = {(f.path, f.change): f.detail for f in diff.files}
    assert ("/etc/gone", "only in published") in by_path
    assert ("/etc/new", "only in rebuilt") in by_path
    assert by_path[("/etc/shadow", "mode")] == "0640 -> 0600"
    assert by_path[("/etc/x.pyc", "content")].startswith(".pyc header only")
    assert "partition table" in diff.summary and "content" in diff.summary
    assert "/etc/new: only in rebuilt" in diff.render()
    assert not (tmp_path / "diff").exists()


@pytest.mark.subprocess
def test_a_file_on_one_side_only_is_named_before_a_flood_of_mtimes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VM tier's rebuild differed in the mtime of every file its installer wrote and in one inode: the
    report listed 500 mtimes and stopped, and the one file never showed. Every file is compared and counted;
    the list holds each kind up to a limit, what is there before its metadata."""
    monkeypatch.setattr(imagediff, "MAX_FILES", 2)
    files = [Member(f"root/etc/f{i}", data=b"same") for i in range(5)]
    published = _qcow2(tmp_path / "a", [*sealkit.root_members(0.0), *files])
    later = [Member(m.name, data=m.data, mtime=1_700_000_000) for m in files]
    rebuilt = _qcow2(
        tmp_path / "b", [*sealkit.root_members(0.0), *later, Member("root/etc/zz-extra", data=b"x")]
    )
    diff = imagediff.diff_images(published, rebuilt, tmp_path / "diff")
    assert diff.files[0].to_json() == {"tree": "root", "path": "/etc/zz-extra", "change": "only in rebuilt",
                                       "detail": ""}  # fmt: skip
    assert [f.change for f in diff.files[1:]] == ["mtime", "mtime"]
    assert diff.to_json()["counts"] == {"only in rebuilt": 1, "mtime": 5}
    assert "files: 6 changes (1 only in rebuilt, 5 mtime)" in diff.summary
    assert diff.notes == ["not listed (counted): 3 more mtime"]
    assert not [f for f in diff.file_systems if "DEVNAME" in f]  # the probe's own path is no difference


@pytest.mark.subprocess
def test_the_same_files_in_another_layout_say_so(tmp_path: Path) -> None:
    published = _qcow2(tmp_path / "a", sealkit.root_members(0.0))
    rebuilt = _qcow2(tmp_path / "b", sealkit.root_members(0.0), lock="5f")
    diff = imagediff.diff_images(published, rebuilt, tmp_path / "diff")
    assert diff.files == [] and diff.files_compared > 20
    assert "none of" in diff.summary and "block placement" in diff.summary


# -- the command --------------------------------------------------------------------------------------------------


def _folder(tmp: Path, manifest: dict[str, Any], image: bytes = b"QFI\xfbimage") -> Path:
    tmp.mkdir(parents=True)
    (tmp / "fixture-node.qcow2").write_bytes(image)
    manifest = copy.deepcopy(manifest)

    manifest["outputs"][0]["sha256"] = hashlib.sha256(image).hexdigest()
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    (tmp / "sbom.spdx.json").write_text('{"sbom": 1}')
    return tmp


def test_the_report_of_a_reproduced_build(tmp_path: Path) -> None:
    published = rebuild.read_published(_folder(tmp_path / "pub", MANIFEST))
    report = rebuild.compare(published, _folder(tmp_path / "re", _rerun()), tmp_path / "work")
    assert report["same"] and report["image"]["same"]
    assert report["identical_files"] == {"sbom.spdx.json": True}
    assert report["differences"] == {"manifest": []}
    assert report["tools"] == [{"path": "tools.qemu-img", "published": "7.2.22", "rebuilt": "8.2.2"}]
    assert rebuild.render(report).endswith("REPRODUCED: the same image")


def test_the_report_names_a_difference_in_the_manifest(tmp_path: Path) -> None:
    published = rebuild.read_published(_folder(tmp_path / "pub", MANIFEST))
    rerun = _rerun(packages=[{"name": "bash", "version": "5.3", "architecture": "amd64"}])
    report = rebuild.compare(published, _folder(tmp_path / "re", rerun), tmp_path / "work")
    assert not report["same"]
    assert report["differences"]["manifest"] == [
        {"path": "packages[bash].version", "published": "5.2", "rebuilt": "5.3"}
    ]
    assert "NOT REPRODUCED" in rebuild.render(report)


def test_rebuild_refuses_a_definition_or_lock_that_is_not_the_builds(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "pub", MANIFEST)
    (tmp_path / "d.yaml").write_text("name: x\n")
    (tmp_path / "l.json").write_text("{}")
    args = type("Args", (), {"definition": tmp_path / "d.yaml", "lock": tmp_path / "l.json"})()
    with pytest.raises(LockError, match="is not the definition the published build used"):
        rebuild._inputs(args, rebuild.read_published(folder))


def test_rebuild_refuses_a_folder_that_is_neither(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="neither a build folder"):
        rebuild.read_published(tmp_path)
