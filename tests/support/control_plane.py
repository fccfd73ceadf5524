"""A real Kubernetes v1.36.3 control plane on one host, for the peer tests, the bench and ``make cluster``.

Public API::

    API_PORT = 6443
    class ControlPlane:
        work: Path; ns: NetNamespace; host_port: int; started_in_s: float
        @classmethod
        def start(cls, work: Path, *, port: int = 0, kubelet_config: dict | None = None,
                  version: str = "1.36.3", cert_sans: tuple[str, ...] = (),
                  endpoint_host: str = "127.0.0.1") -> ControlPlane
        def stop(self) -> None                       # API server first, waited for; then etcd
        host_url -> str                              # https://127.0.0.1:<host_port> (forwarded)
        endpoint -> str                              # <endpoint_host>:6443, inside ns (what kubeadm joins)
        ca_cert -> Path; pki -> Path
        admin_kubeconfig -> Path                     # system:masters, for the host
        ns_admin_kubeconfig -> Path                  # the same, for use inside ns
        kubectl(*args, input=None, check=True, kubeconfig=None) -> CompletedProcess[str]
        kubectl_json(*args, kubeconfig=None) -> Any
        kubeadm(*args, check=True) -> CompletedProcess[str]     # inside ns
        request(method, path, *, bearer=None, body=None) -> tuple[int, Any]    # (status, JSON body)
        whoami(bearer) -> tuple[int, Any]            # SelfSubjectReview: who a token authenticates as
        may(bearer, **resource_attributes) -> bool   # SelfSubjectAccessReview as that token
        wait_for(what, probe, timeout=60.0) -> T     # probe() until it returns a non-None value

etcd, kube-apiserver and kube-controller-manager run as plain processes (no kubelet, no static pods),
with the flags kubeadm's static-pod manifests give them, inside a network namespace of their own
(tests/support/netns.py); the API server binds 127.0.0.1:6443 there and advertises 10.255.255.1.
Certificates and kubeconfigs come from the real ``kubeadm init phase certs all`` / ``kubeconfig``;
bootstrap-token RBAC, ``cluster-info`` and the kubeadm and kubelet ConfigMaps from ``kubeadm init
phase bootstrap-token`` and ``upload-config all``. The controller manager runs every default controller
plus ``bootstrapsigner`` and ``tokencleaner``. ``start`` returns once the API server answers /readyz and
the BootstrapSigner has signed ``cluster-info`` for kubeadm's own token (which is then deleted, so the
tests find only their own tokens). The host reaches the API server through tests/support/nsforward.py
on 127.0.0.1:<host_port>; the serving certificate carries 127.0.0.1, so TLS verifies unchanged.

``version``: another release than the peers' v1.36.3 runs the same source linked again with that version
stamped (tests/support/kube_debs.py: kube-apiserver, kube-controller-manager, kubeadm and kubectl say that
version; the code is 1.36.3's), so a cluster "on 1.35.3" is one kubeadm and the kubelets see as 1.35.3.
``cert_sans``: more addresses in the serving certificate. ``endpoint_host``: the control plane's
endpoint (kubeadm's ``controlPlaneEndpoint``, which ``cluster-info`` names and every joining node then
talks to), 127.0.0.1 by default; another address is added to the namespace's ``lo`` and the API server
binds every address of the namespace (only ``lo``): the racked servers' gateway ``10.0.2.2``
(tests/support/rack.py), where they reach the namespace's loopback, is such an endpoint.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.support.netns import ADDRESS, NetNamespace
from tests.support.peers import KUBE_VERSION, ROOT, PeerError, binary, log_tail, run, spawn, stop

T = TypeVar("T")

API_PORT = 6443
_KUBEADM_TOKEN_ID = "kadmin"
_KUBEADM_TOKEN = f"{_KUBEADM_TOKEN_ID}.0123456789abcdef"
_START_TIMEOUT = 180.0

# What every joining node gets through the kubelet-config ConfigMap: a kubelet that runs without
# systemd (cgroupfs) on this cgroup v1 host, as real-peers.md 3.2-3.4 found it must be.
KUBELET_CONFIG: dict[str, Any] = {
    "apiVersion": "kubelet.config.k8s.io/v1beta1",
    "kind": "KubeletConfiguration",
    "cgroupDriver": "cgroupfs",
    "failCgroupV1": False,
    "cgroupsPerQOS": False,
    "enforceNodeAllocatable": ["none"],
    "failSwapOn": False,
    "address": "127.0.0.1",
    "healthzBindAddress": "127.0.0.1",
}


def _kubeadm_config(
    work: Path,
    kubelet_config: dict[str, Any],
    version: str = KUBE_VERSION,
    cert_sans: tuple[str, ...] = (),
    endpoint_host: str = "127.0.0.1",
) -> str:
    init = {
        "apiVersion": "kubeadm.k8s.io/v1beta4",
        "kind": "InitConfiguration",
        # A loopback address here means "the global address on lo": 10.255.255.1 in our namespace.
        "localAPIEndpoint": {"advertiseAddress": "127.0.0.1", "bindPort": API_PORT},
        "nodeRegistration": {"name": "cp-1", "criSocket": "unix:///var/run/containerd/containerd.sock"},
        "bootstrapTokens": [
            {
                "token": _KUBEADM_TOKEN,
                "ttl": "1h0m0s",
                "usages": ["signing", "authentication"],
                "groups": ["system:bootstrappers:kubeadm:default-node-token"],
            }
        ],
    }
    cluster = {
        "apiVersion": "kubeadm.k8s.io/v1beta4",
        "kind": "ClusterConfiguration",
        "kubernetesVersion": version,
        "controlPlaneEndpoint": f"{endpoint_host}:{API_PORT}",
        "certificatesDir": str(work / "pki"),
        "networking": {"serviceSubnet": "10.96.0.0/12", "dnsDomain": "cluster.local"},
        "apiServer": {"certSANs": sorted({"127.0.0.1", "localhost", endpoint_host, *cert_sans})},
        "etcd": {"local": {"dataDir": str(work / "etcd-data")}},
    }
    return yaml.safe_dump_all([init, cluster, kubelet_config], sort_keys=False)


def _etcd_argv(work: Path) -> list[str | Path]:
    p = work / "pki" / "etcd"
    return [
        binary("etcd"),
        "--name=cp-1",
        f"--data-dir={work / 'etcd-data'}",
        "--listen-client-urls=https://127.0.0.1:2379",
        "--advertise-client-urls=https://127.0.0.1:2379",
        "--listen-peer-urls=https://127.0.0.1:2380",
        "--initial-advertise-peer-urls=https://127.0.0.1:2380",
        "--initial-cluster=cp-1=https://127.0.0.1:2380",
        "--listen-metrics-urls=http://127.0.0.1:2381",
        f"--cert-file={p / 'server.crt'}",
        f"--key-file={p / 'server.key'}",
        "--client-cert-auth=true",
        f"--trusted-ca-file={p / 'ca.crt'}",
        f"--peer-cert-file={p / 'peer.crt'}",
        f"--peer-key-file={p / 'peer.key'}",
        "--peer-client-cert-auth=true",
        f"--peer-trusted-ca-file={p / 'ca.crt'}",
        "--snapshot-count=10000",
    ]


def _apiserver_argv(work: Path, bin_dir: Path, bind: str = "127.0.0.1") -> list[str | Path]:
    p = work / "pki"
    return [
        bin_dir / "kube-apiserver",
        f"--advertise-address={ADDRESS}",
        f"--bind-address={bind}",
        f"--secure-port={API_PORT}",
        "--allow-privileged=true",
        "--authorization-mode=Node,RBAC",
        f"--client-ca-file={p / 'ca.crt'}",
        "--enable-admission-plugins=NodeRestriction",
        "--enable-bootstrap-token-auth=true",
        f"--etcd-cafile={p / 'etcd' / 'ca.crt'}",
        f"--etcd-certfile={p / 'apiserver-etcd-client.crt'}",
        f"--etcd-keyfile={p / 'apiserver-etcd-client.key'}",
        "--etcd-servers=https://127.0.0.1:2379",
        f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
        f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
        "--requestheader-allowed-names=front-proxy-client",
        f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={p / 'sa.pub'}",
        f"--service-account-signing-key-file={p / 'sa.key'}",
        "--service-cluster-ip-range=10.96.0.0/12",
        f"--tls-cert-file={p / 'apiserver.crt'}",
        f"--tls-private-key-file={p / 'apiserver.key'}",
    ]


def _controller_manager_argv(work: Path, bin_dir: Path) -> list[str | Path]:
    p = work / "pki"
    conf = work / "kubeconfig" / "controller-manager.conf"
    return [
        bin_dir / "kube-controller-manager",
        "--bind-address=127.0.0.1",
        f"--kubeconfig={conf}",
        f"--authentication-kubeconfig={conf}",
        f"--authorization-kubeconfig={conf}",
        f"--client-ca-file={p / 'ca.crt'}",
        "--cluster-name=kubernetes",
        f"--cluster-signing-cert-file={p / 'ca.crt'}",
        f"--cluster-signing-key-file={p / 'ca.key'}",
        # `*` has csrapproving, csrsigning and the service-account token controller; these two are off by default.
        "--controllers=*,bootstrapsigner,tokencleaner",
        "--leader-elect=false",
        f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
        f"--root-ca-file={p / 'ca.crt'}",
        f"--service-account-private-key-file={p / 'sa.key'}",
        "--use-service-account-credentials=true",
    ]


def _kept(sent: Any, received: Any) -> bool:
    """``sent`` survived the round trip: equal, or for a mapping, each of its keys kept (defaults may join)."""
    if isinstance(sent, dict):
        return isinstance(received, dict) and all(_kept(v, received.get(k)) for k, v in sent.items())
    return bool(sent == received)


def _control_plane_binaries(version: str) -> Path:
    """The bin folder of kube-apiserver, kube-controller-manager, kubeadm and kubectl for ``version``."""
    if f"v{version}" == KUBE_VERSION:
        return binary("kubeadm").parent
    from tests.support.kube_debs import control_plane_binaries

    return control_plane_binaries(version)


class ControlPlane:
    def __init__(
        self,
        work: Path,
        ns: NetNamespace,
        version: str = KUBE_VERSION.removeprefix("v"),
        endpoint_host: str = "127.0.0.1",
    ) -> None:
        self.work = work
        self.ns = ns
        self.version = version
        self.endpoint_host = endpoint_host
        self.bin_dir = _control_plane_binaries(version)
        self.host_port = 0
        self.started_in_s = 0.0
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stopped = False

    # -- paths and addresses -------------------------------------------------------------------
    @property
    def pki(self) -> Path:
        return self.work / "pki"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def endpoint(self) -> str:
        return f"{self.endpoint_host}:{API_PORT}"

    @property
    def host_url(self) -> str:
        return f"https://127.0.0.1:{self.host_port}"

    @property
    def ns_admin_kubeconfig(self) -> Path:
        return self.work / "kubeconfig" / "super-admin.conf"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.work / "admin.conf"

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    # -- start and stop ------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        work: Path,
        *,
        port: int = 0,
        kubelet_config: dict[str, Any] | None = None,
        version: str = KUBE_VERSION.removeprefix("v"),
        cert_sans: tuple[str, ...] = (),
        endpoint_host: str = "127.0.0.1",
    ) -> ControlPlane:
        """Bring up a control plane under ``work`` (created 0700); the host side listens on ``port`` (0: any)."""
        begun = time.monotonic()
        work.mkdir(parents=True, exist_ok=True)
        work.chmod(0o700)
        (work / "logs").mkdir(exist_ok=True)
        binaries = _control_plane_binaries(version)  # PeerError naming `make peers` before anything starts
        del binaries
        ns = NetNamespace.create()
        cp = cls(work, ns, version, endpoint_host)
        try:
            cp._start(port, kubelet_config if kubelet_config is not None else KUBELET_CONFIG, cert_sans)
        except BaseException:
            cp.stop()
            raise
        cp.started_in_s = time.monotonic() - begun
        return cp

    def _start(self, port: int, kubelet_config: dict[str, Any], cert_sans: tuple[str, ...]) -> None:
        config = self.work / "kubeadm.yaml"
        host = self.endpoint_host
        config.write_text(_kubeadm_config(self.work, kubelet_config, f"v{self.version}", cert_sans, host))
        if (
            host != "127.0.0.1"
        ):  # the endpoint's address on the namespace's lo, where the API server binds too
            run(["ip", "addr", "add", f"{host}/32", "dev", "lo"], netns=self.ns.name)
        self.kubeadm("init", "phase", "certs", "all", f"--config={config}")
        for kind in ("super-admin", "controller-manager"):
            self.kubeadm(
                "init",
                "phase",
                "kubeconfig",
                kind,
                f"--config={config}",
                f"--kubeconfig-dir={self.work / 'kubeconfig'}",
            )
        # kubeadm writes the local advertise address into controller-manager.conf; the API server binds loopback.
        cm = self.work / "kubeconfig" / "controller-manager.conf"
        cm.write_text(
            cm.read_text().replace(f"https://{ADDRESS}:{API_PORT}", f"https://127.0.0.1:{API_PORT}")
        )
        self._start_forwarder(port)
        host = yaml.safe_load(self.ns_admin_kubeconfig.read_text())
        for entry in host["clusters"]:
            entry["cluster"]["server"] = self.host_url
        self.admin_kubeconfig.write_text(yaml.safe_dump(host))
        self.admin_kubeconfig.chmod(0o600)

        self._spawn("etcd", _etcd_argv(self.work))
        bind = "127.0.0.1" if self.endpoint_host == "127.0.0.1" else "0.0.0.0"
        self._spawn("kube-apiserver", _apiserver_argv(self.work, self.bin_dir, bind))
        self.wait_for("kube-apiserver /readyz", self._ready, timeout=_START_TIMEOUT)
        self._spawn("kube-controller-manager", _controller_manager_argv(self.work, self.bin_dir))
        k = f"--kubeconfig={self.ns_admin_kubeconfig}"
        self.kubeadm("init", "phase", "bootstrap-token", f"--config={config}", k)
        self.kubeadm("init", "phase", "upload-config", "all", f"--config={config}", k)
        self._check_kubelet_config(kubelet_config)
        # The BootstrapSigner signing cluster-info for kubeadm's token shows the controllers are running.
        self.wait_for(
            "the BootstrapSigner to sign cluster-info", lambda: self._jws(_KUBEADM_TOKEN_ID), _START_TIMEOUT
        )
        self.kubectl("-n", "kube-system", "delete", "secret", f"bootstrap-token-{_KUBEADM_TOKEN_ID}")
        self.wait_for(
            "the BootstrapSigner to drop kubeadm's token from cluster-info",
            lambda: True if self._jws(_KUBEADM_TOKEN_ID) is None else None,
            _START_TIMEOUT,
        )

    def _check_kubelet_config(self, sent: dict[str, Any]) -> None:
        """Fail closed when kubeadm's upload changed a setting every joining kubelet would get (defect 5)."""
        got = self.kubectl_json("-n", "kube-system", "get", "configmap", "kubelet-config")
        received = yaml.safe_load(got["data"]["kubelet"])
        lost = {k: (v, received.get(k)) for k, v in sent.items() if not _kept(v, received.get(k))}
        if lost:
            raise PeerError(
                "the KubeletConfiguration does not survive kubeadm's upload to the kubelet-config ConfigMap: "
                + "; ".join(f"{k}: sent {a!r}, the kubelet gets {b!r}" for k, (a, b) in sorted(lost.items()))
                + ' (an empty list is dropped and re-defaulted: say ["none"] for "nothing")'
            )

    def _start_forwarder(self, port: int) -> None:
        listener = socket.create_server(("127.0.0.1", port))
        try:
            self.host_port = listener.getsockname()[1]
            fd = listener.fileno()
            self._spawn(
                "forward",
                [sys.executable, "-m", "tests.support.nsforward", f"{fd}=127.0.0.1:{API_PORT}"],
                pass_fds=(fd,),
                env={"PYTHONPATH": str(ROOT)},
            )
        finally:
            listener.close()  # the forwarder holds its own copy

    def _spawn(
        self,
        name: str,
        argv: list[str | Path],
        *,
        pass_fds: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self._procs[name] = spawn(
            argv, log_path=self.log(name), netns=self.ns.name, pass_fds=pass_fds, env=env
        )

    def _check_running(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise PeerError(
                    f"{name} exited {proc.returncode}; the end of its log:\n{log_tail(self.log(name))}"
                )

    def _ready(self) -> bool | None:
        self._check_running()
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        conn = http.client.HTTPSConnection("127.0.0.1", self.host_port, context=ctx, timeout=5)
        try:
            conn.request("GET", "/readyz")
            return True if conn.getresponse().status == 200 else None
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def _jws(self, token_id: str) -> str | None:
        self._check_running()
        info = self.kubectl_json("-n", "kube-public", "get", "configmap", "cluster-info")
        value = info.get("data", {}).get(f"jws-kubeconfig-{token_id}")
        return value if isinstance(value, str) else None

    def stop(self) -> None:
        """Controller manager, then the API server (waited for: stopped together with etcd it hangs), then etcd."""
        if self._stopped:
            return
        self._stopped = True
        try:
            for name in ("kube-controller-manager", "kube-apiserver", "etcd", "forward"):
                proc = self._procs.pop(name, None)
                if proc is not None:
                    stop(proc, grace=20.0)
        finally:
            self.ns.delete()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -------------------------------------------------------------------------------
    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl on the host, through the forwarder."""
        kc = kubeconfig if kubeconfig is not None else self.admin_kubeconfig
        return run(
            [self.bin_dir / "kubectl", f"--kubeconfig={kc}", "--request-timeout=30s", *args],
            input=input,
            check=check,
            timeout=60,
        )

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def apply(self, manifest: str) -> None:
        self.kubectl("apply", "-f", "-", input=manifest)

    def kubeadm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The real kubeadm inside the control plane's namespace."""
        return run([self.bin_dir / "kubeadm", *args], netns=self.ns.name, check=check, timeout=120)

    def request(
        self, method: str, path: str, *, bearer: str | None = None, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """One HTTPS request to the API server as a bearer token (or anonymous); (status, decoded body)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        conn = http.client.HTTPSConnection("127.0.0.1", self.host_port, context=ctx, timeout=30)
        headers = {"Accept": "application/json"}
        if bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        return resp.status, json.loads(raw) if raw else None

    def whoami(self, bearer: str) -> tuple[int, Any]:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        return self.request(
            "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", bearer=bearer, body=review
        )

    def may(self, bearer: str, **attributes: str) -> bool:
        """Whether ``bearer`` may do what ``attributes`` (verb, resource, namespace, ...) describe."""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        status, answer = self.request(
            "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", bearer=bearer, body=review
        )
        if status != 201:
            raise PeerError(f"SelfSubjectAccessReview {attributes}: HTTP {status}: {answer}")
        return answer["status"].get("allowed") is True

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
        """Call ``probe`` until it returns something other than None; PeerError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise PeerError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.25)

    def describe(self) -> dict[str, str]:
        """What a person needs to use it: the kubeconfig, the API server's URL on the host, the CA."""
        return {
            "kubeconfig": str(self.admin_kubeconfig),
            "server": self.host_url,
            "ca_cert": str(self.ca_cert),
            "namespace": self.ns.name,
            "logs": str(self.work / "logs"),
        }
