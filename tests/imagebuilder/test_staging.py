"""The staging tree and the plan stage.sh follows."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import pytest

from imagebuilder.definition import load_definition
from imagebuilder.errors import BuildError, LockError
from imagebuilder.lock import LockedInput, plain_name
from imagebuilder.staging import (
    EXPORT_SERIAL,
    PROVISION_HOOK,
    StagedFile,
    base_tree,
    build_tree,
    check_archives,
    staged_files,
    tree_digest,
)

pytestmark = pytest.mark.subprocess  # dpkg-deb indexes the apt repository
REPO = Path(__file__).resolve().parents[2]


def _item(key: str, kind: str, role: str, path: Path, **extra: object) -> StagedFile:
    item = LockedInput(key=key, name=key.rsplit("/", 1)[-1], kind=kind, version="1", url="http://x/" + path.name,
                       sha256="0" * 64, size=path.stat().st_size, role=role, filename=path.name,
                       **extra)  # type: ignore[arg-type]  # fmt: skip
    return StagedFile(item, path)


def _images(payload_root: Path) -> list[StagedFile]:
    """The fixture definition's OCI archives, which its container runtime imports at build time."""
    found = {
        "pause-image": payload_root / "images/pause/3.10.2/pause-3.10.2-linux-amd64.tar",
        "kube-proxy-image": payload_root / "k8s-release/v1.36.3/bin/linux/amd64/kube-proxy.tar",
        "ovn-kubernetes-image": payload_root / "ovn-kubernetes/v2.4.2/ovn-kube-image-2.4.2-linux-amd64.tar",
    }
    return [_item(f"artifact/{name}", "oci-archive", "stage", path, destination=f"/opt/x/{name}.tar")
            for name, path in found.items()]  # fmt: skip


def test_the_plan(tmp_path: Path, payload_root: Path) -> None:
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    k8s = payload_root / "k8s/core:/stable:/v1.36/deb/amd64"
    k8s_next = payload_root / "k8s/core:/stable:/v1.37/deb/amd64"
    spire = payload_root / "spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz"
    files = [
        *(_item(f"kubernetes/1.36.3/{p.name.split('_')[0]}", "deb", "apt", p) for p in sorted(k8s.glob("kube*.deb"))),
        _item("deb/cri-tools", "deb", "apt", k8s / "cri-tools_1.36.0-1.1_amd64.deb"),
        _item("kubernetes/1.37.2/kubeadm", "deb", "stage", k8s_next / "kubeadm_1.37.2-1.1_amd64.deb",
              destination="/opt/nodetrust/staged/kubernetes/1.37.2/"),
        _item("artifact/spire-agent", "tarball", "stage", spire, destination="/opt/spire/1.14.1/", strip_components=1),
        _item("artifact/tool", "binary", "stage", spire, destination="/usr/local/bin/tool", mode="0755"),
        *_images(payload_root),
    ]  # fmt: skip
    wheel = tmp_path / "pip-26.3-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    tree = tmp_path / "tree"
    plan = build_tree(tree, defn, files, wheels=[wheel], pip_wheel=wheel.name,
                      agent_requirement="nodetrust[agent]==0.1.0", image_info={"build_id": "b1"})  # fmt: skip
    assert plan[0] == "apt\tkubeadm=1.36.3-1.1 kubelet=1.36.3-1.1 kubectl=1.36.3-1.1"
    assert plan[1] == "hold\tkubeadm kubelet kubectl"
    assert ("file\tstaged/1.37.2/kubeadm_1.37.2-1.1_amd64.deb\t/opt/nodetrust/staged/kubernetes/1.37.2/"
            "kubeadm_1.37.2-1.1_amd64.deb\t0644") in plan  # fmt: skip
    assert f"tarball\tfiles/spire-agent/{spire.name}\t/opt/spire/1.14.1/\t1" in plan
    assert f"file\tfiles/tool/{spire.name}\t/usr/local/bin/tool\t0755" in plan
    assert "dir\t/etc/nodeagent\t0700" in plan
    assert f"venv\t/opt/nodeagent/venv\tnodetrust[agent]==0.1.0\t{wheel.name}" in plan
    assert (
        "file\tunits/agent_systemd_nodeagent.service\t/usr/lib/systemd/system/nodeagent.service\t0644"
        in plan
    )
    assert "enable\tnodeagent.service\trequired" in plan
    assert "enable\tsystemd-time-wait-sync.service\toptional" in plan
    assert "user\tnodeadmin\tyes\t/bin/bash\tkeys/nodeadmin.keys" in plan
    # the node (imagebuilder.nodespec): its files, units and masks, then its images imported, not staged as files
    assert "file\tnode/00-90-nodetrust.conf\t/etc/modules-load.d/90-nodetrust.conf\t0644" in plan
    assert "mask\tswap.target" in plan and "enable\tcontainerd.service\trequired" in plan
    images = plan.index("images\tk8s.io\tnode/images.tsv\t/etc/containerd/config.toml")
    assert images > plan.index("enable\tnodeagent.service\trequired")
    assert images > max(
        i for i, line in enumerate(plan) if line.endswith("\t/etc/containerd/config.toml\t0644")
    )
    assert not [line for line in plan if "/opt/x/" in line]
    listed = (tree / "node/images.tsv").read_text().splitlines()
    assert listed[0] == "files/pause-image/pause-3.10.2-linux-amd64.tar\tregistry.k8s.io/pause:3.10.2"
    assert (tree / "files/pause-image/pause-3.10.2-linux-amd64.tar").is_file()
    assert not [e for e in staged_files(defn, files) if e["path"].startswith("/opt/x/")]
    # the measured boot chain (imagebuilder.bootmeasure) after everything that changes /boot
    assert plan[-5:] == ["sshd\tno", "bootloader\t/etc/nodetrust/boot.json", "report", "generalise", "trim"]
    assert (tree / "plan.tsv").read_text() == "\n".join(plan) + "\n"
    assert (tree / "stage.sh").read_text() == (REPO / "cloud-init/stage.sh").read_text()
    packages = (tree / "apt/Packages").read_text()
    assert "Package: kubeadm" in packages and "Filename: ./kubeadm_1.36.3-1.1_amd64.deb" in packages
    assert (tree / "apt/Release").read_text().count("Packages") == 4
    assert json.loads((tree / "info/image.json").read_text()) == {"build_id": "b1"}
    assert (tree / "keys/nodeadmin.keys").read_text().startswith("ssh-ed25519 ")
    for line in plan:
        assert all(line.split("\t")), line


def test_the_base_plan_and_what_moves_its_digest(tmp_path: Path, payload_root: Path) -> None:
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    k8s = payload_root / "k8s/core:/stable:/v1.36/deb/amd64"
    fapi = _item("deb/libtss2-fapi1", "deb", "apt", k8s / "cri-tools_1.36.0-1.1_amd64.deb")
    kubeadm = _item("kubernetes/1.36.3/kubeadm", "deb", "apt", k8s / "kubeadm_1.36.3-1.1_amd64.deb")
    files = [fapi, kubeadm, *_images(payload_root)]
    base_keys = {"deb/libtss2-fapi1"}
    pip = tmp_path / "pip-26.3-py3-none-any.whl"
    pip.write_bytes(b"pip wheel")
    plan = base_tree(tmp_path / "base", defn, files, base_keys, pip_wheel=pip)
    assert plan == [
        "apt\tlibtss2-fapi1",
        f"pip\t{pip.name}",
        f"file\tprovision-init\t{PROVISION_HOOK}\t0755",
        f"export\t{EXPORT_SERIAL}",
        "report",
        "trim",
    ]
    assert (tmp_path / "base/provision-init").read_text() == (
        REPO / "cloud-init/provision-init.sh"
    ).read_text()
    assert (tmp_path / "base/apt/cri-tools_1.36.0-1.1_amd64.deb").exists()
    assert not (
        tmp_path / "base/apt/kubeadm_1.36.3-1.1_amd64.deb"
    ).exists()  # Kubernetes goes to the staging plan
    first = tree_digest(tmp_path / "base")
    # the same inputs give the same digest; a different deb in the base gives another one
    assert (tmp_path / "base/wheels" / pip.name).read_bytes() == b"pip wheel"
    base_tree(tmp_path / "again", defn, files, base_keys, pip_wheel=pip)
    assert tree_digest(tmp_path / "again") == first
    other = _item("deb/libtss2-fapi1", "deb", "apt", k8s / "kubectl_1.36.3-1.1_amd64.deb")
    base_tree(tmp_path / "other", defn, [other, kubeadm], base_keys, pip_wheel=pip)
    assert tree_digest(tmp_path / "other") != first
    # another pip is another base (the base compiles it); a base plan without one has no pip entry
    other_pip = tmp_path / "pip-26.4-py3-none-any.whl"
    other_pip.write_bytes(b"another pip wheel")
    base_tree(tmp_path / "other-pip", defn, files, base_keys, pip_wheel=other_pip)
    assert tree_digest(tmp_path / "other-pip") != first
    assert not [
        line for line in base_tree(tmp_path / "no-pip", defn, files, base_keys) if line.startswith("pip")
    ]
    # the staging medium leaves the base's debs out
    wheel = tmp_path / "pip-26.3-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    staging_plan = build_tree(tmp_path / "staging", defn, files, wheels=[wheel], pip_wheel=wheel.name,
                              agent_requirement="nodetrust[agent]==0.1.0", image_info={}, base_keys=base_keys)  # fmt: skip
    assert not (tmp_path / "staging/apt/cri-tools_1.36.0-1.1_amd64.deb").exists()
    assert (tmp_path / "staging/apt/kubeadm_1.36.3-1.1_amd64.deb").exists()
    assert not [line for line in staging_plan if line.startswith("export")]
    assert not (tmp_path / "staging/provision-init").exists()


def _tarball(tmp_path: Path, members: list[tarfile.TarInfo]) -> StagedFile:
    path = tmp_path / "artifact.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for member in members:
            data = b"content\n" if member.isfile() else b""
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data) if data else None)
    return _item("artifact/tool", "tarball", "stage", path, destination="/opt/tool/1.0/", strip_components=1)


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o755
    return info


def test_a_well_formed_artifact_tarball_passes_and_is_listed(tmp_path: Path) -> None:
    staged = _tarball(tmp_path, [_member("tool-1.0", tarfile.DIRTYPE), _member("tool-1.0/bin/tool"),
                                 _member("tool-1.0/bin/t", tarfile.SYMTYPE, "tool"),
                                 _member("tool-1.0/bin/again", tarfile.LNKTYPE, "tool-1.0/bin/tool")])  # fmt: skip
    check_archives([staged])
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    listed = {e["path"]: e for e in staged_files(defn, [staged])}
    assert listed["/opt/tool/1.0/bin/tool"]["mode"] == "0755"
    assert listed["/opt/tool/1.0/bin/t"] == {
        "group": "tool 1",
        "path": "/opt/tool/1.0/bin/t",
        "link": "tool",
    }


EVIL_MEMBERS = [
    ([_member("/etc/cron.d/evil")], "'/etc/cron.d/evil' has an absolute name"),
    ([_member("tool-1.0/../../../etc/shadow")], "has a .. component"),
    ([_member("tool-1.0/dev/sda", tarfile.CHRTYPE)], "is a device or a FIFO"),
    ([_member("tool-1.0/pipe", tarfile.FIFOTYPE)], "is a device or a FIFO"),
    ([_member("tool-1.0/shadow", tarfile.LNKTYPE, "/etc/shadow")], "is a hard link to '/etc/shadow', outside the archive"),
    ([_member("tool-1.0/etc", tarfile.SYMTYPE, "/etc"), _member("tool-1.0/etc/cron.d/evil")],
     "lies under the symbolic link tool-1.0/etc (extracting it would write through the link)"),
    ([_member("tool-1.0/bin/tool\nfile\tx")], "has a control character in its name"),
]  # fmt: skip


@pytest.mark.parametrize(("members", "why"), EVIL_MEMBERS, ids=[str(i) for i in range(len(EVIL_MEMBERS))])
def test_an_artifact_tarball_that_could_write_outside_its_destination_is_refused(
    tmp_path: Path, members: list[tarfile.TarInfo], why: str
) -> None:
    staged = _tarball(tmp_path, members)
    with pytest.raises(BuildError) as caught:
        check_archives([staged])
    assert caught.value.message.startswith("tool: artifact.tar.gz: member ") and why in caught.value.message


def test_lock_fields_never_become_paths_outside_the_staging_tree(tmp_path: Path, payload_root: Path) -> None:
    deb = next(payload_root.glob("k8s/core:/stable:/v1.37/deb/amd64/kubeadm_*.deb"))
    bad = _item("kubernetes/1.37.2/kubeadm", "deb", "stage", deb, destination="/opt/k/")
    bad = StagedFile(dataclasses.replace(bad.item, filename="../../../escaped.deb"), deb)
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    with pytest.raises(LockError, match=r"'\.\./\.\./\.\./escaped\.deb' is not a plain file name"):
        build_tree(tmp_path / "tree", defn, [bad], wheels=[], pip_wheel="pip-1-py3-none-any.whl",
                   agent_requirement="nodetrust==0.1.0", image_info={})  # fmt: skip
    assert not list(tmp_path.rglob("escaped.deb"))
    assert plain_name("kubeadm_1.37.2-1.1_amd64.deb") == "kubeadm_1.37.2-1.1_amd64.deb"
    for name in ("..", ".", "a/b", "-rf", "x\n", ""):
        with pytest.raises(LockError):
            plain_name(name)


def test_an_agent_unit_that_is_a_link_to_a_host_file_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "agent-source"
    (source / "agent/systemd").mkdir(parents=True)
    secret = tmp_path / "host-secret"
    secret.write_text("not a unit\n")
    (source / "agent/systemd/nodeagent.service").symlink_to(secret)
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    defn = dataclasses.replace(defn, agent=dataclasses.replace(defn.agent, source=source))
    with pytest.raises(BuildError, match=r"nodeagent\.service is a symbolic link or lies outside"):
        staged_files(defn, [])
    with pytest.raises(BuildError, match="is a symbolic link"):
        build_tree(tmp_path / "tree", defn, [], wheels=[], pip_wheel="pip-1-py3-none-any.whl",
                   agent_requirement="nodetrust==0.1.0", image_info={})  # fmt: skip
    assert not list((tmp_path / "tree").rglob("*nodeagent.service"))
