"""The control plane fixture itself: pinned versions, kubeadm's phases, anonymous discovery, the namespace."""

from __future__ import annotations

import base64
import http.client
import json
import ssl

import yaml

from tests.support.control_plane import ControlPlane
from tests.support.netns import ADDRESS
from tests.support.peers import KUBE_VERSION, binary, run


def test_the_peers_are_the_pinned_versions(control_plane: ControlPlane) -> None:
    assert run([binary("kubeadm"), "version", "-o", "short"]).stdout.strip() == KUBE_VERSION
    client = json.loads(run([binary("kubectl"), "version", "--client", "-o", "json"]).stdout)
    assert client["clientVersion"]["gitVersion"] == KUBE_VERSION
    assert client["clientVersion"]["gitTreeState"] == "clean"
    for name in ("kube-apiserver", "kube-controller-manager", "kubelet"):
        assert run([binary(name), "--version"]).stdout.strip() == f"Kubernetes {KUBE_VERSION}"
    assert run([binary("etcd"), "--version"]).stdout.splitlines()[0] == "etcd Version: 3.6.8"
    server = control_plane.kubectl_json("version")["serverVersion"]
    assert server["gitVersion"] == KUBE_VERSION


def test_cluster_info_is_public_and_names_the_endpoint_and_ca(control_plane: ControlPlane) -> None:
    """What kubeadm's token discovery reads, fetched with no credentials at all."""
    ctx = ssl.create_default_context(cafile=str(control_plane.ca_cert))
    conn = http.client.HTTPSConnection("127.0.0.1", control_plane.host_port, context=ctx, timeout=30)
    try:
        conn.request("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info")
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, body
    kubeconfig = yaml.safe_load(body["data"]["kubeconfig"])
    cluster = kubeconfig["clusters"][0]["cluster"]
    assert cluster["server"] == f"https://{control_plane.endpoint}"
    assert base64.b64decode(cluster["certificate-authority-data"]) == control_plane.ca_cert.read_bytes()
    # kubeadm's own token was signed (proving the BootstrapSigner runs) and then deleted before any test.
    assert "jws-kubeconfig-kadmin" not in body["data"]


def test_kubeadm_and_kubelet_configmaps_were_uploaded(control_plane: ControlPlane) -> None:
    kubeadm = control_plane.kubectl_json("-n", "kube-system", "get", "configmap", "kubeadm-config")
    cluster = yaml.safe_load(kubeadm["data"]["ClusterConfiguration"])
    assert cluster["kubernetesVersion"] == KUBE_VERSION
    assert cluster["controlPlaneEndpoint"] == control_plane.endpoint
    kubelet = control_plane.kubectl_json("-n", "kube-system", "get", "configmap", "kubelet-config")
    config = yaml.safe_load(kubelet["data"]["kubelet"])
    assert config["kind"] == "KubeletConfiguration"
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["enforceNodeAllocatable"] == ["none"]


def test_the_api_server_advertises_the_namespace_address(control_plane: ControlPlane) -> None:
    endpoints = control_plane.kubectl_json(
        "-n", "default", "get", "endpointslices", "-l", "kubernetes.io/service-name=kubernetes"
    )
    addresses = [a for item in endpoints["items"] for e in item["endpoints"] for a in e["addresses"]]
    assert addresses == [ADDRESS]
    # ... and binds only loopback inside its namespace: the address itself does not answer.
    probe = run(
        [binary("kubectl"), f"--kubeconfig={control_plane.ns_admin_kubeconfig}", f"--server=https://{ADDRESS}:6443",
         "--request-timeout=5s", "get", "--raw", "/readyz"],
        netns=control_plane.ns.name,
        check=False,
    )  # fmt: skip
    assert probe.returncode != 0
    inside = run(
        [binary("kubectl"), f"--kubeconfig={control_plane.ns_admin_kubeconfig}", "get", "--raw", "/readyz"],
        netns=control_plane.ns.name,
    )
    assert inside.stdout.strip() == "ok"
