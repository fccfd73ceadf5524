"""The definition's host, container_runtime and gpu keys: what they render, what they refuse, what the boot test gets."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuilder import nodespec
from imagebuilder.definition import load_definition, validate
from imagebuilder.errors import DefinitionError

REPO = Path(__file__).resolve().parents[2]
ENV = {"IMAGEBUILDER_FIXTURE_ISO": "/tmp/installer.iso"}


def minimal(**extra: Any) -> dict[str, Any]:
    return {
        "name": "node",
        "architecture": "amd64",
        "installer": {"iso": {"url": "https://example.invalid/x.iso", "sha256": "a" * 64}},
        "target": {"python": "3.12", "glibc": "2.39"},
        "agent": {"source": "."},
        **extra,
    }


def image(name: str, kind: str = "oci-archive") -> dict[str, Any]:
    return {"name": name, "version": "1", "kind": kind, "urls": "https://example.invalid/x.tar",
            "sha256": "b" * 64, "destination": f"/opt/x/{name}.tar"}  # fmt: skip


RUNTIME = {
    "sandbox_image": "registry.k8s.io/pause:3.10.2",
    "images": [{"artifact": "pause", "ref": "registry.k8s.io/pause:3.10.2"}],
}


def load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "def.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_definition(path, environ={})


def test_the_fixture_example_is_a_kubernetes_gpu_node() -> None:
    defn = load_definition(REPO / "examples/fixture-node.yaml", environ=ENV)
    names = [p.name for p in defn.packages]
    # the runtime's, the time client's and the GPU stack's packages join the lock's package requests
    for wanted in ("containerd", "runc", "containernetworking-plugins", "systemd-timesyncd",
                   "openvswitch-switch", "linux-modules-nvidia-570-server-standin-amd64",
                   "nvidia-fabricmanager-570-standin", "datacenter-gpu-manager-4-core-standin"):  # fmt: skip
        assert wanted in names
    assert len(names) == len(set(names))
    rendered = nodespec.render(defn.node)
    files = {f.path: f.content.decode() for f in rendered.files}
    assert files[nodespec.MODULES_FILE].splitlines()[-2:] == ["overlay", "br_netfilter"]
    assert files[nodespec.SYSCTL_FILE].splitlines()[-3:] == [
        "net.bridge.bridge-nf-call-ip6tables = 1", "net.bridge.bridge-nf-call-iptables = 1", "net.ipv4.ip_forward = 1"
    ]  # fmt: skip
    assert "SystemMaxUse=1G\n" in files[nodespec.JOURNALD_FILE]
    assert (
        "FallbackNTP=\n" in files[nodespec.TIMESYNCD_FILE]
    )  # no compiled-in pool servers: the release's only
    assert files[nodespec.CRICTL_CONFIG].endswith(
        "runtime-endpoint: unix:///run/containerd/containerd.sock\n"
        "image-endpoint: unix:///run/containerd/containerd.sock\ntimeout: 10\n"
    )
    assert rendered.mask == ("swap.target",)
    assert {"containerd.service", "systemd-timesyncd.service", "nodetrust-time-servers.path", "kubelet.service",
            "nvidia-persistenced.service",
            "nvidia-fabricmanager.service", "nvidia-dcgm.service"} <= set(rendered.enable)  # fmt: skip
    assert [i.ref for i in rendered.images] == [
        "registry.k8s.io/pause:3.10.2",
        "registry.k8s.io/kube-proxy:v1.36.3",
        "ghcr.io/ovn-kubernetes/ovn-kubernetes/ovn-kube-ubuntu:v2.4.2",
    ]


def test_containerd_is_configured_for_kubernetes() -> None:
    defn = load_definition(REPO / "examples/fixture-node.yaml", environ=ENV)
    assert defn.node.runtime is not None
    config = tomllib.loads(nodespec.containerd_config(defn.node.runtime, defn.node.gpu))
    assert config["version"] == 2 and "disabled_plugins" not in config  # CRI enabled
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10.2"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True
    assert runtimes["nvidia"]["options"] == {
        "BinaryName": "/usr/bin/nvidia-container-runtime",
        "SystemdCgroup": True,
    }
    assert cri["containerd"]["default_runtime_name"] == "runc"  # GPU pods ask for nvidia (a RuntimeClass)
    assert cri["registry"] == {
        "config_path": "/etc/containerd/certs.d"
    }  # mirrors and credentials per release
    assert cri["cni"] == {"bin_dir": "/opt/cni/bin", "conf_dir": "/etc/cni/net.d"}
    assert "enable_cdi" not in cri


def test_cdi_mode_and_the_default_runtime(tmp_path: Path) -> None:
    data = minimal(
        artifacts=[image("pause")],
        container_runtime=RUNTIME,
        gpu={"driver": {"packages": ["drv"], "kernel_modules_package": "mods"},
             "container_toolkit": {"packages": ["tk"], "mode": "cdi", "units": ["nvidia-cdi-refresh.path"]}},
    )  # fmt: skip
    defn = load(tmp_path, data)
    cri = tomllib.loads(nodespec.containerd_config(defn.node.runtime, defn.node.gpu))["plugins"][
        "io.containerd.grpc.v1.cri"
    ]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert "nvidia" not in cri["containerd"]["runtimes"]
    assert "nvidia-cdi-refresh.path" in nodespec.render(defn.node).enable
    data["gpu"]["container_toolkit"] = {"packages": ["tk"], "mode": "runtime", "default_runtime": True}
    cri = tomllib.loads(
        nodespec.containerd_config(load(tmp_path, data).node.runtime, load(tmp_path, data).node.gpu)
    )
    assert cri["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"container_runtime": {**RUNTIME, "images": [{"artifact": "nope", "ref": "x/y:1"}]}},
         "container_runtime.images[0]: no artifact named 'nope'"),
        ({"artifacts": [image("pause", "tarball")]}, "artifact pause is a tarball, not an oci-archive"),
        ({"container_runtime": {**RUNTIME, "sandbox_image": "registry.k8s.io/pause:9"}},
         "the sandbox image registry.k8s.io/pause:9 is not among the imported images"),
        ({"host": {"units": {"enable": ["a.service"], "mask": ["a.service"]}}}, "a.service both enabled and masked"),
        ({"host": {"sysctls": {"net.ipv4.ip_forward": 1},
                   "files": [{"path": "/etc/sysctl.d/90-nodetrust.conf", "content": "x"}]}},
         "/etc/sysctl.d/90-nodetrust.conf is also written by the builder"),
        ({"host": {"files": [{"path": "/etc/x", "content": "a"}, {"path": "/etc/x", "content": "b"}]}},
         "host.files: paths must be unique; repeated: /etc/x"),
        ({"gpu": {"driver": {"packages": ["drv"], "kernel_modules_package": "mods"},
                  "container_toolkit": {"packages": ["tk"]}}, "container_runtime": None},
         "gpu.container_toolkit needs container_runtime"),
    ],
)  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    data = minimal(artifacts=[image("pause")], container_runtime=RUNTIME)
    for key, value in change.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    with pytest.raises(DefinitionError) as err:
        load(tmp_path, data)
    assert message in err.value.message


@pytest.mark.parametrize(
    ("host", "path"),
    [
        ({"sysctls": {"net.ipv4.ip_forward": "1\nkernel.x = 2"}}, "host.sysctls"),
        ({"kernel_modules": ["overlay;reboot"]}, "host.kernel_modules[0]"),
        ({"units": {"enable": ["../../etc/passwd"]}}, "host.units.enable[0]"),
        ({"files": [{"path": "relative/x", "content": "x"}]}, "host.files[0].path"),
        ({"files": [{"path": "/etc/x", "content": "x", "owner": "root:root\nx"}]}, "host.files[0].owner"),
        ({"files": [{"path": "/etc/x"}]}, "host.files[0]"),
        ({"swapp": False}, "host"),
        ({"time_sync": {"client": "ntpd"}}, "host.time_sync.client"),
    ],
)
def test_the_schema_refuses_what_would_become_a_script(host: dict[str, Any], path: str) -> None:
    problems = validate(minimal(host=host))
    assert problems and any(p.startswith(path) for p in problems), problems


def test_the_plan_lines_and_the_files_on_the_medium(tmp_path: Path) -> None:
    data = minimal(
        artifacts=[image("pause")],
        container_runtime=RUNTIME,
        host={"swap": False, "kernel_modules": ["overlay"],
              "files": [{"path": "/etc/nodetrust/motd", "content": "hi\n", "mode": "0640", "owner": "nodeadmin:adm"}],
              "units": {"mask": ["apt-daily.timer"]}},
    )  # fmt: skip
    defn = load(tmp_path, data)
    tree = tmp_path / "tree"
    lines = nodespec.plan_lines(nodespec.render(defn.node), tree, image_files={"pause": "files/pause/x.tar"})
    files = [line.split("\t") for line in lines if line.startswith("file\t")]
    assert [f[2] for f in files] == [
        nodespec.MODULES_FILE, "/etc/nodetrust/motd", nodespec.CONTAINERD_CONFIG, nodespec.CRICTL_CONFIG
    ]  # fmt: skip
    for _, rel, _dest, _mode in files:
        assert (tree / rel).is_file()
    assert (tree / files[1][1]).read_text() == "hi\n" and files[1][3] == "0640"
    assert "owner\t/etc/nodetrust/motd\tnodeadmin:adm" in lines
    assert lines.index("owner\t/etc/nodetrust/motd\tnodeadmin:adm") > lines.index("\t".join(files[1]))
    assert [x for x in lines if x.startswith("mask\t")] == ["mask\tswap.target", "mask\tapt-daily.timer"]
    assert "enable\tcontainerd.service\trequired" in lines
    assert lines[-1] == "images\tk8s.io\tnode/images.tsv\t/etc/containerd/config.toml"
    assert (tree / "node/images.tsv").read_text() == "files/pause/x.tar\tregistry.k8s.io/pause:3.10.2\n"
    assert ("dir\t/etc/containerd/certs.d\t0755") in lines


def test_what_the_boot_test_is_told() -> None:
    defn = load_definition(REPO / "examples/fixture-node.yaml", environ=ENV)
    expect = nodespec.expectations(defn.node)
    assert expect["host"]["sysctls"] == {
        "net.bridge.bridge-nf-call-ip6tables": "1", "net.bridge.bridge-nf-call-iptables": "1", "net.ipv4.ip_forward": "1"
    }  # fmt: skip
    assert expect["host"]["swap"] is False and expect["host"]["cgroup"] == "v2"
    assert expect["host"]["time_sync"] == {
        "client": "systemd-timesyncd",
        "unit": "systemd-timesyncd.service",
        "release_file": "/etc/systemd/timesyncd.conf.d/50-nodetrust.conf",
    }
    runtime = expect["container_runtime"]
    assert runtime["socket"] == "/run/containerd/containerd.sock" and runtime["namespace"] == "k8s.io"
    assert len(runtime["images"]) == 3
    gpu = expect["gpu"]
    assert gpu["modules"] == ["nvidia", "nvidia_uvm", "nvidia_modeset"]
    assert gpu["kernel_modules_package"] == "linux-modules-nvidia-570-server-standin-amd64"
    assert gpu["toolkit_mode"] == "runtime"
    assert {f["path"] for f in expect["files"]} >= {nodespec.CONTAINERD_CONFIG, nodespec.SYSCTL_FILE}
    assert all(len(f["sha256"]) == 64 and f["owner"] == "root:root" for f in expect["files"])
    assert nodespec.expectations(nodespec.NodeSpec()) == {}


def test_the_image_watches_the_file_the_release_writes() -> None:
    """The node-pool release's cloud-init writes the time servers where the image's path unit looks."""
    from imagebuilder.release.cloudinit import TIMESYNCD

    assert nodespec.RELEASE_TIME_SERVERS["systemd-timesyncd"] == TIMESYNCD
