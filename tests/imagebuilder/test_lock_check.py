"""A lock is a file the build did not write: its fields are checked before any becomes a path (issue 11).

One real lock of a small definition (made once, against the fixture payloads on a loopback server) is
edited the ways a hand-edited or foreign lock could be: a digest that is a host path, a file name that
leaves the staging tree, entries the definition never asked for, entries it needs removed. Each must
be refused by name, and nothing on the host may change.
"""

from __future__ import annotations

import hashlib
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuilder.build import Build, BuildOptions
from imagebuilder.cache import Cache
from imagebuilder.cli import main
from imagebuilder.closure import apt_closures
from imagebuilder.definition import load_definition
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.lock import check_lock, create_lock, load_lock
from imagebuilder.staging import StagedFile
from tests.imagebuilder.conftest import Locked

pytestmark = pytest.mark.subprocess


def _input(data: dict[str, Any], key: str) -> dict[str, Any]:
    found: dict[str, Any] = next(i for i in data["inputs"] if i["key"] == key)
    return found


def test_the_lock_as_written_passes(locked: Locked) -> None:
    check_lock(load_definition(locked.definition), load_lock(locked.lock))


def test_a_digest_that_is_a_host_path_is_refused_and_deletes_nothing(locked: Locked, tmp_path: Path) -> None:
    """Before: the cache entry of a "digest" /x/victim was /x/victim itself, which the build hashed, found
    corrupt and deleted."""
    victim = tmp_path / "victim.txt"
    victim.write_text("an operator's file\n")
    data = locked.edited()
    _input(data, "artifact/spire-agent")["sha256"] = str(victim)
    lock = locked.write(tmp_path, data)
    with pytest.raises(LockError) as caught:
        load_lock(lock)
    assert "not a valid lock file" in caught.value.message
    index = data["inputs"].index(_input(data, "artifact/spire-agent"))
    assert f"inputs[{index}].sha256: '{victim}' does not match" in caught.value.message
    assert "lock.schema.json" in caught.value.hint
    out, work = tmp_path / "out", tmp_path / "work"
    rc = main(["build", str(locked.definition), "--lock", str(lock), "--cache-dir", str(tmp_path / "cache"),
               "--out", str(out), "--work-dir", str(work)])  # fmt: skip
    assert rc == 3  # LockError
    assert victim.read_text() == "an operator's file\n"
    assert not out.exists() and not list(tmp_path.glob("cache/**/victim*"))
    # the cache itself takes nothing but a digest as a name, whoever calls it
    with pytest.raises(VerificationError, match="is not a sha256 digest"):
        Cache(tmp_path / "cache").entry(str(victim))
    with pytest.raises(VerificationError, match="is not a sha256 digest"):
        Cache(tmp_path / "cache").lookup("A" * 64)


BAD_FIELDS = [
    ("filename", "../../outside.deb", "filename: '../../outside.deb' does not match"),
    ("filename", "kubeadm.deb\n", "filename: 'kubeadm.deb\\n' does not match"),  # ^...$ would accept it
    ("filename", ".hidden", "filename: '.hidden' does not match"),
    ("name", "../x", "name: '../x' does not match"),
    ("destination", "/opt/../etc/cron.d/", "destination: '/opt/../etc/cron.d/' should not be valid"),
    ("destination", "/opt/x\tfile\tprovision-init\t/etc/rc.local", "destination"),
    ("key", "kubernetes/1.37.2/../../../etc", "key: 'kubernetes/1.37.2/../../../etc' does not match"),
    ("sha256", "a" * 64 + "\n", "sha256"),
    ("strip_components", -1, "strip_components: -1 is less than the minimum of 0"),
    ("mode", "4755\n", "mode"),
    ("url", "file:///etc/shadow\nhttps://x", "url"),
    ("surprise", "x", "Additional properties are not allowed ('surprise' was unexpected)"),
]


@pytest.mark.parametrize(
    ("field", "value", "expected"), BAD_FIELDS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_FIELDS)]
)
def test_lock_fields_that_would_become_paths_or_plan_lines_are_refused(
    locked: Locked, tmp_path: Path, field: str, value: object, expected: str
) -> None:
    data = locked.edited()
    entry = _input(data, "kubernetes/1.37.2/kubeadm")
    entry[field] = value
    index = data["inputs"].index(entry)
    with pytest.raises(LockError) as caught:
        load_lock(locked.write(tmp_path, data))
    assert f"inputs[{index}]" in caught.value.message and expected in caught.value.message, (
        caught.value.message
    )


def test_an_oversized_or_malformed_lock_is_refused_before_use(locked: Locked, tmp_path: Path) -> None:
    huge = tmp_path / "huge.lock.json"
    with huge.open("wb") as fh:
        fh.truncate((64 << 20) + 1)
    with pytest.raises(LockError, match="larger than 64 MiB"):
        load_lock(huge)
    (tmp_path / "list.lock.json").write_text("[1, 2]")
    with pytest.raises(LockError, match="schema is 'list'"):
        load_lock(tmp_path / "list.lock.json")
    data = locked.edited()
    data["inputs"] = "everything"
    with pytest.raises(LockError, match="inputs: 'everything' is not of type 'array'"):
        load_lock(locked.write(tmp_path, data))


def test_inputs_the_definition_never_asked_for_are_refused_by_name(locked: Locked, tmp_path: Path) -> None:
    data = locked.edited()
    spire = _input(data, "artifact/spire-agent")
    evil = {**spire, "key": "artifact/evil", "name": "evil", "destination": "/etc/cron.d/"}
    unstaged = {**_input(data, "kubernetes/1.37.2/kubeadm"), "key": "kubernetes/1.99.0/kubeadm"}
    unasked_sdist = {**_input(data, "wheel/pyyaml"), "key": "sdist/pyyaml", "kind": "sdist", "role": "sdist",
                     "destination": ""}  # fmt: skip
    data["inputs"] += [evil, unstaged, unasked_sdist]
    spire["destination"] = "/etc/systemd/system/"
    data["inputs"] = [i for i in data["inputs"] if i["key"] != "kubernetes/1.37.2/kubelet"]
    defn = load_definition(locked.definition)
    with pytest.raises(LockError) as caught:
        check_lock(defn, load_lock(locked.write(tmp_path, data)))
    message = caught.value.message
    assert "not locked: kubernetes/1.37.2/kubelet" in message
    assert "not implied by the definition: artifact/evil, kubernetes/1.99.0/kubeadm, sdist/pyyaml" in message
    assert (
        "artifact/spire-agent: destination is '/etc/systemd/system/', the definition implies '/opt/spire/1.14.1/'"
        in message
    )
    assert "imagebuilder lock" in caught.value.hint


def test_what_else_a_lock_entry_must_agree_on(locked: Locked, tmp_path: Path) -> None:
    data = locked.edited()
    _input(data, "artifact/ovn-kubernetes")["strip_components"] = 0
    _input(data, "artifact/ovn-kubernetes")["mirrors"] = ["file:///etc/"]
    _input(data, "kubernetes/1.37.2/kubectl")["role"] = "apt"
    _input(data, "deb/cri-tools")["name"] = "kubelet"
    with pytest.raises(LockError) as caught:
        check_lock(load_definition(locked.definition), load_lock(locked.write(tmp_path, data)))
    message = caught.value.message
    assert "artifact/ovn-kubernetes: strip_components is 0, the definition implies 1" in message
    assert "artifact/ovn-kubernetes: mirrors is ('file:///etc/',), the definition implies ()" in message
    assert "kubernetes/1.37.2/kubectl: role is 'apt', the definition implies 'stage'" in message
    assert "deb/cri-tools: name is 'kubelet', the key names 'cri-tools'" in message


def _fetched(locked: Locked, data: dict[str, Any], tmp_path: Path) -> tuple[Build, list[StagedFile]]:
    lock = locked.write(tmp_path, data)
    built = Build(BuildOptions(definition=locked.definition, out=tmp_path / "out", cache_dir=locked.cache,
                               lock=lock, work_root=tmp_path / "work"))  # fmt: skip
    built.check()
    return built, built.fetch()


def test_a_deb_that_no_closure_needs_is_refused_by_name(
    locked: Locked, tmp_path: Path, payload_root: Path
) -> None:
    built, files = _fetched(locked, locked.edited(), tmp_path)
    assert (
        apt_closures(built.defn, files, built.lock.base_packages) == set()
    )  # no `packages`: nothing in the base
    # a deb the definition never asked for, with a correct digest: fetched, but never staged
    deb = next(payload_root.glob("extras/deb/**/nodetrust-fixture-hangs_*.deb"))
    data = locked.edited()
    data["inputs"].append(
        {**_input(data, "deb/cri-tools"), "key": "deb/nodetrust-fixture-hangs", "name": "nodetrust-fixture-hangs",
         "url": locked.server.url + "/" + deb.relative_to(payload_root).as_posix(), "filename": deb.name,
         "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(), "size": deb.stat().st_size, "version": "1.0"}
    )  # fmt: skip
    built, files = _fetched(locked, data, tmp_path)
    with pytest.raises(LockError) as caught:
        apt_closures(built.defn, files, built.lock.base_packages)
    assert caught.value.message == (
        "the lock holds debs that nothing in the definition needs: deb/nodetrust-fixture-hangs"
    )


def test_a_deb_that_is_another_package_than_its_entry_says_is_refused(
    locked: Locked, tmp_path: Path
) -> None:
    data = locked.edited()
    data["inputs"].append({**_input(data, "kubernetes/1.37.2/cri-tools"), "key": "kubernetes/1.37.2/kubernetes-cni",
                           "name": "kubernetes-cni", "filename": "kubernetes-cni_1.37.0-1.1_amd64.deb"})  # fmt: skip
    built, files = _fetched(locked, data, tmp_path)
    with pytest.raises(
        LockError, match=r"kubernetes/1\.37\.2/kubernetes-cni: the deb is package 'cri-tools'"
    ):
        apt_closures(built.defn, files, built.lock.base_packages)


def test_a_wheel_the_agent_does_not_install_is_refused_by_name(locked: Locked, tmp_path: Path) -> None:
    data = locked.edited()
    twin = {**_input(data, "wheel/pyyaml"), "key": "wheel/left-pad", "name": "left-pad"}
    data["inputs"].append(twin)
    with pytest.raises(
        LockError, match=r"wheel/left-pad, wheel/pyyaml: the same file 'pyyaml-.*' in wheels/"
    ):
        check_lock(load_definition(locked.definition), load_lock(locked.write(tmp_path, data)))
    twin["filename"] = "left_pad-1.0-py3-none-any.whl"
    built, files = _fetched(locked, data, tmp_path)
    work = tmp_path / "wheelhouse"
    work.mkdir()
    with pytest.raises(
        LockError, match=r"^the lock holds wheels that the agent does not install: wheel/left-pad$"
    ):
        built.wheelhouse(work, files)
    shutil.rmtree(work)


def test_imagebuilder_lock_never_writes_a_lock_a_build_would_refuse(locked: Locked, tmp_path: Path) -> None:
    """The lock's file names come from upstream (URLs, indexes): one that is not a plain name stops the
    lock before anything is written."""
    odd = tmp_path / "spire\nagent.tar.gz"  # a file name with a newline, served as file:// (%0A)
    odd.write_bytes(b"not really a tarball")
    data = yaml.safe_load(locked.definition.read_text())
    spire = data["artifacts"][1]
    spire.pop("checksums")
    spire["urls"] = "file://" + urllib.parse.quote(str(odd))
    spire["sha256"] = hashlib.sha256(odd.read_bytes()).hexdigest()
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(LockError) as caught:
        create_lock(load_definition(path), Cache(locked.cache), tmp_path / "odd.lock.json")
    assert "filename: 'spire\\nagent.tar.gz' does not match" in caught.value.message
    assert "nothing was written" in caught.value.hint
    assert list(tmp_path.glob("*odd.lock.json*")) == []
