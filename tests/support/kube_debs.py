"""The fixture's Kubernetes packages, built from the real peers: kubeadm, kubelet, kubectl, cri-tools, kubernetes-cni.

Public API::

    KUBE_PEER_VERSION = "1.36.3"
    kube_binaries(version: str) -> Path          # a bin folder with kubeadm, kubelet and kubectl for version
    control_plane_binaries(version: str) -> Path # ... and kube-apiserver, kube-controller-manager (make cluster)
    crictl_binary(version: str) -> Path          # crictl for cri-tools version (e.g. "1.36.0")
    package_files(package, version, *, real) -> dict[str, Content]   # path -> bytes, a host file (Path) or a Link

What the binaries are, exactly:

* **Kubernetes 1.36.3**: the kubeadm, kubelet and kubectl that ``make peers`` builds from
  k8s.io/kubernetes v1.36.3 (``interop/kube``), byte for byte.
* **Kubernetes 1.34.2, 1.35.3 and 1.37.2**: only v1.36.3 source is served by the Go module proxy here,
  so these are **the same v1.36.3 source linked again with the other version stamped** (the ``-X``
  version variables of ``k8s.io/component-base/version`` and ``k8s.io/client-go/pkg/version``, as
  ``interop/kube/peer.conf`` stamps v1.36.3): ``kubelet --version`` prints ``Kubernetes v1.35.3`` and
  ``kubeadm version -o short`` ``v1.35.3``, while the code is 1.36.3's. What the tests prove with them
  is the image's version switch (the right package installed and held, its binaries the ones that run),
  not Kubernetes 1.35's behaviour.
* **cri-tools 1.36.0**: crictl built from sigs.k8s.io/cri-tools v1.36.0 (``interop/critools``); the other
  minors' cri-tools packages (1.34.0, 1.35.0, 1.37.0) carry that source stamped with their version.
* **kubernetes-cni 1.7.1**: the CNI plugins of the image's distribution (Debian's
  containernetworking-plugins, in ``/usr/lib/cni``) under ``/opt/cni/bin``, as symbolic links: the
  package depends on containernetworking-plugins instead of shipping upstream's plugin tarball, which
  cannot be downloaded here.

The layout is the upstream packages' (kubernetes/release ``cmd/krel/templates/latest``): ``/usr/bin/<tool>``,
``kubelet.service`` in ``/usr/lib/systemd/system`` with ``/etc/default/kubelet`` and the empty
``/var/lib/kubelet`` and ``/etc/kubernetes/manifests``, kubeadm's systemd drop-in
``/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf``. The packages' dependencies are those of
the fixture's stand-ins (kubeadm depends on kubelet, kubectl and cri-tools, as pkgs.k8s.io's 1.28-1.31
packages did; since 1.32 upstream's kubeadm depends on nothing), so a definition resolves the same
closure whichever kind the payload server serves. Stamped builds are cached in the machine's peer cache
(``$NODETRUST_CACHE/peers/kube-stamped-*``, ``critools-stamped-*``), keyed on the build they re-link
(:func:`tests.support.peers.relink`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.peers import bin_dir, relink

KUBE_PEER_VERSION = "1.36.3"
CRI_TOOLS_PEER_VERSION = "1.36.0"
BUILD_DATE = "2026-07-22T18:07:38Z"  # interop/kube/peer.conf's, so a stamped build is as reproducible
KUBE_TOOLS = ("kubeadm", "kubelet", "kubectl")
CNI_PLUGINS = ("bandwidth", "bridge", "dhcp", "firewall", "host-device", "host-local", "ipvlan", "loopback",
               "macvlan", "portmap", "ptp", "sbr", "static", "tuning", "vlan", "vrf")  # fmt: skip

KUBELET_SERVICE = """[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""

KUBEADM_DROPIN = "".join(
    (
        "# Note: This dropin only works with kubeadm and kubelet v1.11+\n",
        "[Service]\n",
        'Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf'
        ' --kubeconfig=/etc/kubernetes/kubelet.conf"\n',
        'Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"\n',
        '# This is a file that "kubeadm init" and "kubeadm join" generates at runtime, populating the'
        " KUBELET_KUBEADM_ARGS variable dynamically\n",
        "EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env\n",
        "# This is a file that the user can use for overrides of the kubelet args as a last resort. Preferably,"
        " the user should use\n",
        "# the .NodeRegistration.KubeletExtraArgs object in the configuration files instead. KUBELET_EXTRA_ARGS"
        " should be sourced from this file.\n",
        "EnvironmentFile=-/etc/default/kubelet\n",
        "ExecStart=\n",
        "ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS"
        " $KUBELET_EXTRA_ARGS\n",
    )
)


@dataclass(frozen=True)
class Link:
    """A symbolic link in a package, to ``target``."""

    target: str


Content = bytes | Path | Link  # bytes: the file's content; Path: a host file copied; Link: a symbolic link


def _stamp_flags(version: str) -> str:
    major, minor, _ = version.split(".")
    flags = "-s -w"
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += (f" -X {pkg}.gitVersion=v{version} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor}"
                  f" -X {pkg}.gitTreeState=clean -X {pkg}.buildDate={BUILD_DATE}")  # fmt: skip
    return flags


def _stamped(
    module: str, kind: str, version: str, tools: tuple[str, ...], flags: str, check: list[str]
) -> Path:
    """``tools`` of ``interop/<module>`` linked again with ``flags`` (CGO off), cached: :func:`relink`."""
    return relink(module, kind, version, tools, flags, check)


def kube_binaries(version: str) -> Path:
    """kubeadm, kubelet and kubectl for ``version``: the peers' own for 1.36.3, else the stamped re-link."""
    if version == KUBE_PEER_VERSION:
        return bin_dir("kube")
    return _stamped(
        "kube",
        "kube-stamped",
        version,
        KUBE_TOOLS,
        _stamp_flags(version),
        ["kubeadm", "version", "-o", "short"],
    )


def control_plane_binaries(version: str) -> Path:
    """kube-apiserver, kube-controller-manager, kubeadm and kubectl for ``version`` (a stamped re-link unless
    it is the peers' own 1.36.3): a control plane that says ``version`` (tests/support/control_plane.py)."""
    if version == KUBE_PEER_VERSION:
        return bin_dir("kube")
    return _stamped(
        "kube",
        "kube-cp-stamped",
        version,
        ("kube-apiserver", "kube-controller-manager", *KUBE_TOOLS),
        _stamp_flags(version),
        ["kubeadm", "version", "-o", "short"],
    )


def crictl_binary(version: str) -> Path:
    """crictl for cri-tools ``version``: the peer build for 1.36.0, else that source stamped with ``version``."""
    if version == CRI_TOOLS_PEER_VERSION:
        return bin_dir("critools") / "crictl"
    flags = f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v{version}"
    return (
        _stamped("critools", "critools-stamped", version, ("crictl",), flags, ["crictl", "--version"])
        / "crictl"
    )


def package_files(package: str, version: str, *, real: bool, standin: bytes = b"") -> dict[str, Content]:
    """The files of fixture package ``package`` at upstream ``version`` (``1.36.3``, ``1.36.0``, ``1.7.1``).

    ``real``: the binaries above; otherwise ``standin`` (a script that says it is a stand-in) in their place,
    for the fast tests, which must not need ``make peers``. Everything else is the same either way.
    """
    if package in KUBE_TOOLS:
        binary: Content = (kube_binaries(version) / package) if real else standin
        files: dict[str, Content] = {f"/usr/bin/{package}": binary}
        if package == "kubelet":
            files |= {
                "/usr/lib/systemd/system/kubelet.service": KUBELET_SERVICE.encode(),
                "/etc/default/kubelet": b"KUBELET_EXTRA_ARGS=\n",
                "/var/lib/kubelet/.kubelet-keep": b"",
                "/etc/kubernetes/manifests/.kubelet-keep": b"",
            }
        if package == "kubeadm":
            files["/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"] = KUBEADM_DROPIN.encode()
        return files
    if package == "cri-tools":
        return {"/usr/bin/crictl": crictl_binary(version) if real else standin}
    if package == "kubernetes-cni":
        if not real:
            return {"/opt/cni/bin/bridge": standin}
        return {f"/opt/cni/bin/{p}": Link(f"/usr/lib/cni/{p}") for p in CNI_PLUGINS}
    raise ValueError(f"not a fixture Kubernetes package: {package}")
