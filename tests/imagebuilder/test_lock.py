"""``imagebuilder lock`` against the fixture payloads on a loopback server: what vouches for each input,
and every way an upstream file can fail verification."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuilder.cache import Cache
from imagebuilder.cli import main
from imagebuilder.definition import load_definition
from imagebuilder.errors import LockError, VerificationError
from imagebuilder.lock import FIRST_USE, check_lock, create_lock, load_lock
from imagebuilder.media import make_iso
from tests.support.payload_server import PUBLIC_KEY, PayloadServer

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]
BASE = "adduser\t3.134\nbase-files\t12.4\nlibc6\t2.36-9\n"
OVNK = "/ovn-kubernetes/v2.4.2"


@pytest.fixture(scope="module")
def tiny_iso(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("iso-tree")
    (tree / "casper").mkdir()
    (tree / "casper/minimal.manifest").write_text(BASE)
    (tree / "casper/vmlinuz").write_bytes(b"kernel")
    (tree / "casper/initrd").write_bytes(b"initrd")
    return make_iso(tree, tmp_path_factory.mktemp("iso") / "installer.iso", label="TINY")


def definition(tmp_path: Path, server: PayloadServer, iso: Path, **changes: Any) -> Path:
    url = server.url
    data: dict[str, Any] = {
        "name": "lock-test",
        "distro": "debian",
        "architecture": "amd64",
        "installer": {"iso": {"url": iso.as_uri(), "sha256": hashlib.sha256(iso.read_bytes()).hexdigest()},
                      "base_manifests": ["casper/minimal.manifest"]},
        "target": {"python": "3.11", "glibc": "2.36"},
        "kubernetes": {
            "installed": "1.36.3", "staged": ["1.37.2"],
            "repository": {"url": url + "/k8s/core:/stable:/v{minor}/deb/", "flat": True, "keyring": str(PUBLIC_KEY)},
        },
        "artifacts": [
            {"name": "ovn-kubernetes", "version": "2.4.2", "kind": "tarball",
             "urls": url + OVNK + "/ovn-kubernetes-2.4.2-linux-amd64.tar.gz",
             "checksums": {"url": url + OVNK + "/SHA256SUMS", "signature": url + OVNK + "/SHA256SUMS.asc",
                           "keyring": str(PUBLIC_KEY)},
             "destination": "/opt/nodetrust/staged/ovn-kubernetes/2.4.2/", "strip_components": 1},
            {"name": "spire-agent", "version": "1.14.1", "kind": "tarball",
             "urls": {"amd64": url + "/spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz"},
             "checksums": {"url": url + "/spire/v1.14.1/spire-1.14.1-linux-amd64-musl_sha256sum.txt"},
             "destination": "/opt/spire/1.14.1/"},
        ],
        "agent": {"source": str(REPO), "extras": []},
    }  # fmt: skip
    for path, value in changes.items():
        node: Any = data
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[last] = value
    out = tmp_path / "lock-test.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_a_lock_records_what_vouches_for_every_input(
    tmp_path: Path, payloads: PayloadServer, tiny_iso: Path
) -> None:
    path = definition(tmp_path, payloads, tiny_iso)
    defn = load_definition(path)
    lock = create_lock(defn, Cache(tmp_path / "cache"), tmp_path / "lock-test.lock.json")
    by_key = {i.key: i for i in lock.inputs}
    assert by_key["iso"].verified_by == "definition pin"
    assert (
        by_key["artifact/ovn-kubernetes"].verified_by == "SHA256SUMS signed by fixture-payload-signing.asc"
    )
    assert by_key["artifact/spire-agent"].verified_by.startswith(
        "spire-1.14.1-linux-amd64-musl_sha256sum.txt"
    )
    assert by_key["kubernetes/1.36.3/kubeadm"].role == "apt"
    assert (
        by_key["kubernetes/1.36.3/kubeadm"].verified_by
        == "InRelease of kubernetes-v1.36 signed by fixture-payload-signing.asc"
    )
    assert by_key["deb/cri-tools"].version == "1.36.0-1.1" and by_key["deb/kubernetes-cni"].role == "apt"
    staged = {k for k in by_key if k.startswith("kubernetes/1.37.2/")}
    assert staged == {f"kubernetes/1.37.2/{p}" for p in ("kubeadm", "kubelet", "kubectl", "cri-tools")}
    assert by_key["kubernetes/1.37.2/kubelet"].destination == "/opt/nodetrust/staged/kubernetes/1.37.2/"
    wheels = {i.name for i in lock.inputs if i.role == "wheelhouse"}
    assert {"cryptography", "protobuf", "pyyaml", "pip"} <= wheels
    assert all(len(i.sha256) == 64 and i.size > 0 for i in lock.inputs)
    assert lock.base_packages == {"adduser": "3.134", "base-files": "12.4", "libc6": "2.36-9"}
    assert lock.agent_requires and not any('extra == "dev"' in r for r in lock.agent_requires)
    check_lock(defn, lock)
    data = json.loads((tmp_path / "lock-test.lock.json").read_text())
    assert data["definition_sha256"] == defn.resolved_sha256
    assert [i["key"] for i in data["inputs"]] == sorted(i["key"] for i in data["inputs"])


def test_a_tampered_checksum_file_fails_its_signature(tmp_path: Path, payloads: PayloadServer, tiny_iso: Path,
                                                     payload_root: Path) -> None:  # fmt: skip
    sums = (payload_root / OVNK.lstrip("/") / "SHA256SUMS").read_text()
    payloads.tamper(OVNK + "/SHA256SUMS", sums.replace(sums[:8], "00000000").encode())
    defn = load_definition(definition(tmp_path, payloads, tiny_iso))
    with pytest.raises(
        VerificationError, match="ovn-kubernetes: SHA256SUMS: the OpenPGP signature does not verify"
    ):
        create_lock(defn, Cache(tmp_path / "cache"), tmp_path / "x.lock.json")
    assert not (tmp_path / "x.lock.json").exists()


def test_a_tampered_artifact_fails_its_checksum(
    tmp_path: Path, payloads: PayloadServer, tiny_iso: Path
) -> None:
    payloads.tamper("/spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz", b"evil")
    defn = load_definition(definition(tmp_path, payloads, tiny_iso))
    with pytest.raises(VerificationError, match="spire-agent: no source served the pinned content"):
        create_lock(defn, Cache(tmp_path / "cache"), tmp_path / "x.lock.json")


def test_a_pin_that_disagrees_with_upstream(tmp_path: Path, payloads: PayloadServer, tiny_iso: Path) -> None:
    path = definition(tmp_path, payloads, tiny_iso, **{"artifacts.0.sha256": "a" * 64})
    with pytest.raises(VerificationError, match=r"pins sha256 a{64} but SHA256SUMS says"):
        create_lock(load_definition(path), Cache(tmp_path / "cache"), tmp_path / "x.lock.json")


def test_a_tampered_apt_index_fails_its_signature(tmp_path: Path, payloads: PayloadServer, tiny_iso: Path,
                                                 payload_root: Path) -> None:  # fmt: skip
    repo = "/k8s/core:/stable:/v1.36/deb"
    signed = (payload_root / repo.lstrip("/") / "InRelease").read_text()
    payloads.tamper(repo + "/InRelease", signed.replace("Label: nodetrust", "Label: mallory").encode())
    with pytest.raises(VerificationError, match=r"apt repository kubernetes-v1\.36 .* does not verify"):
        create_lock(load_definition(definition(tmp_path, payloads, tiny_iso)), Cache(tmp_path / "c"),
                    tmp_path / "x.lock.json")  # fmt: skip


def test_an_unpinned_input_is_recorded_on_first_use(tmp_path: Path, payloads: PayloadServer, tiny_iso: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path = definition(tmp_path, payloads, tiny_iso, **{"installer.iso": {"url": tiny_iso.as_uri()}})
    lock = create_lock(load_definition(path), Cache(tmp_path / "cache"), tmp_path / "x.lock.json")
    assert lock.get("iso").verified_by == FIRST_USE
    assert "recorded on first use" in caplog.text


def test_build_refuses_a_stale_or_incomplete_lock(
    tmp_path: Path, payloads: PayloadServer, tiny_iso: Path
) -> None:
    path = definition(tmp_path, payloads, tiny_iso)
    lock = create_lock(load_definition(path), Cache(tmp_path / "cache"), tmp_path / "x.lock.json")
    (tmp_path / "other").mkdir()
    changed = load_definition(
        definition(tmp_path / "other", payloads, tiny_iso, **{"kubernetes.staged": []})
    )
    with pytest.raises(LockError, match=r"was made for another version") as caught:
        check_lock(changed, lock)
    assert "imagebuilder lock" in caught.value.hint
    data = json.loads((tmp_path / "x.lock.json").read_text())
    data["inputs"] = [i for i in data["inputs"] if i["key"] != "artifact/spire-agent"]
    (tmp_path / "y.lock.json").write_text(json.dumps(data))
    with pytest.raises(LockError, match="not locked: artifact/spire-agent"):
        check_lock(load_definition(path), load_lock(tmp_path / "y.lock.json"))
    with pytest.raises(LockError, match="no lock file"):
        load_lock(tmp_path / "missing.lock.json")
    (tmp_path / "z.lock.json").write_text("{}")
    with pytest.raises(LockError, match="not a valid lock file"):
        load_lock(tmp_path / "z.lock.json")


def test_the_lock_command(tmp_path: Path, payloads: PayloadServer, tiny_iso: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = definition(tmp_path, payloads, tiny_iso)
    assert main(["lock", str(path), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "inputs locked for lock-test (amd64)" in capsys.readouterr().out
    assert (tmp_path / "lock-test.lock.json").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: X\n")
    assert main(["lock", str(bad)]) == 2
    assert "problem(s)" in capsys.readouterr().err
