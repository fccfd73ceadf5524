"""The cloud-init a release carries: node-pool (worker) and control-plane user-data, rendered and checked.

* **worker** (a node-pool release): ``write_files`` only. The node agent's configuration
  (``/etc/nodeagent/config.yaml``: server, join server, trust domain, bundle path, pool, and the
  node name when the release fixes one), its trust bundle (``/etc/nodeagent/bundle.pem``), the pool's
  profile when the release carries one (``/etc/nodeagent/pool.yaml``: the node's own checks judge what
  the server will, e.g. the kubelet skew against the pool's control plane) and the time servers
  (where the image's time client reads them: ``/etc/systemd/timesyncd.conf.d/50-nodetrust.conf`` for
  systemd-timesyncd, ``/etc/chrony/sources.d/50-nodetrust.sources`` for chrony; the image applies them
  when written). Nothing is installed, nothing
  is run: the image already holds the agent, and the agent joins the node.
* **control-plane-init**: the first control-plane node. ``write_files`` a kubeadm
  ``InitConfiguration`` + ``ClusterConfiguration`` (``kubeadm.k8s.io/v1beta4``) with the release's
  Kubernetes version, then ``runcmd`` ``kubeadm init --config ... --upload-certs``.
* **control-plane-join**: the other control-plane nodes. ``write_files`` a ``JoinConfiguration``
  (v1beta4) with ``controlPlane`` and file discovery (``/etc/kubernetes/discovery.conf``, which
  carries the cluster CA and a bootstrap token and is handed over out of band: a release holds no
  secret), then ``runcmd`` waits for that file and runs ``kubeadm join --config ...``.

Every document is checked twice: by our own rules here (shape, v1beta4 kinds and fields, the version,
the worker writes only configuration) and by cloud-init's own schema validation
(:func:`validate_schema`: ``cloud-init schema -c FILE`` from the cloud-init on PATH, or from Debian's
cloud-init package unpacked into the cache).
"""

from __future__ import annotations

import ipaddress
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from imagebuilder import nodespec
from imagebuilder.errors import BuildError
from imagebuilder.run import run

KUBEADM_API = "kubeadm.k8s.io/v1beta4"
AGENT_CONFIG = "/etc/nodeagent/config.yaml"
AGENT_BUNDLE = "/etc/nodeagent/bundle.pem"
AGENT_POOL_PROFILE = "/etc/nodeagent/pool.yaml"
TIMESYNCD = nodespec.RELEASE_TIME_SERVERS["systemd-timesyncd"]
INIT_CONFIG = "/etc/kubernetes/kubeadm-init.yaml"
JOIN_CONFIG = "/etc/kubernetes/kubeadm-join-control-plane.yaml"
DISCOVERY = "/etc/kubernetes/discovery.conf"
CLOUD_INIT_DEB_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "cloud-init-deb"
_VERSION = re.compile(r"1\.[0-9]{1,3}\.[0-9]{1,3}")
_HOSTPORT = re.compile(r"[A-Za-z0-9.-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SETTING = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CONFIG_PATH = re.compile(r"/etc(/[A-Za-z0-9._@+-]{1,128}){1,8}")
MAX_FILE_BYTES = 64 << 10  # one configuration file a release writes (--file)
MAX_FILES_BYTES = 512 << 10  # all of them together
# What the release writes itself: --file may not replace them, --agent-setting may not set these keys.
RELEASE_SETTINGS = frozenset({"server", "join_server", "trust_domain", "pool", "bundle", "node_name"})


@dataclass(frozen=True)
class PoolConfig:
    """What a node of the pool needs to find and trust its servers."""

    server: str  # attestation server HOST:PORT
    trust_domain: str
    pool: str
    bundle_pem: str
    join_server: str = ""
    node_name: str = ""
    ntp: tuple[str, ...] = ()
    profile: str = ""  # the pool profile (YAML, as gpu-checks.md describes), for the node's own checks
    # more of the agent's settings (docs/settings.md, nodeagent), written into its configuration file
    agent_settings: Mapping[str, Any] = field(default_factory=dict)
    # site configuration files (path under /etc, UTF-8 text), written 0644 root:root: a CNI
    # configuration, containerd's registry hosts, the SPIRE agent's configuration and bundle
    files: tuple[tuple[str, str], ...] = ()

    def check(self) -> None:
        for what, value in (("server", self.server), ("join_server", self.join_server)):
            if value and _HOSTPORT.fullmatch(value) is None:
                raise BuildError(f"--{what.replace('_', '-')} {value!r} is not HOST:PORT")
        if not self.server or not self.trust_domain or not self.pool:
            raise BuildError("a node-pool release needs --server, --trust-domain and --pool")
        if _NAME.fullmatch(self.pool) is None:
            raise BuildError(f"--pool {self.pool!r} is not a lower-case DNS label")
        if "-----BEGIN CERTIFICATE-----" not in self.bundle_pem:
            raise BuildError("--bundle is not a PEM certificate bundle")
        for server in self.ntp:
            if not re.fullmatch(r"[A-Za-z0-9.:-]{1,253}", server):
                raise BuildError(f"--ntp {server!r} is not a host name or address")
        if self.profile:
            from protocol.errors import ProtocolError
            from protocol.policy import policy_from_mapping

            try:
                loaded = yaml.safe_load(self.profile)
                if not isinstance(loaded, dict):
                    raise ValueError("a YAML mapping is expected")
                policy_from_mapping(loaded)
            except (yaml.YAMLError, ProtocolError, ValueError) as exc:
                raise BuildError(f"--pool-profile: not a pool profile: {exc}") from exc
        self._check_settings()
        self._check_files()

    def _check_settings(self) -> None:
        for key, value in self.agent_settings.items():
            if _SETTING.fullmatch(key) is None:
                raise BuildError(
                    f"--agent-setting {key!r}: not a setting name (docs/settings.md, nodeagent)"
                )
            if key in RELEASE_SETTINGS:
                raise BuildError(
                    f"--agent-setting {key}: the release sets it from its own option",
                    hint=f"use --{key.replace('_', '-')}" if key != "bundle" else "use --bundle",
                )
            if not isinstance(value, (str, int, float, bool)) or (
                isinstance(value, str) and len(value) > 4096
            ):
                raise BuildError(
                    f"--agent-setting {key}: a string, number or boolean of at most 4096 characters"
                )

    def _check_files(self) -> None:
        ours = {AGENT_CONFIG, AGENT_BUNDLE, AGENT_POOL_PROFILE, *nodespec.RELEASE_TIME_SERVERS.values()}
        seen: set[str] = set()
        total = 0
        for path, content in self.files:
            if _CONFIG_PATH.fullmatch(path) is None or any(p in (".", "..") for p in path.split("/")):
                raise BuildError(
                    f"--file {path}: the destination must be an absolute path under /etc (letters, digits, ._@+-)",
                    hint="a node-pool release writes configuration only",
                )
            if path in ours:
                raise BuildError(f"--file {path}: the release writes that file itself")
            if path in seen:
                raise BuildError(f"--file {path}: given twice")
            seen.add(path)
            size = len(content.encode())
            total += size
            if size > MAX_FILE_BYTES:
                raise BuildError(
                    f"--file {path}: {size} bytes; a configuration file is at most {MAX_FILE_BYTES}"
                )
            if total > MAX_FILES_BYTES:
                raise BuildError(f"--file: more than {MAX_FILES_BYTES} bytes of files in all")
            if "\0" in content:
                raise BuildError(f"--file {path}: not text (a NUL byte)")


@dataclass(frozen=True)
class ControlPlane:
    endpoint: str  # HOST:PORT of the API server (a load balancer), controlPlaneEndpoint
    kubernetes_version: str
    pod_subnet: str = "10.244.0.0/16"
    service_subnet: str = "10.96.0.0/12"
    cri_socket: str = "unix:///run/containerd/containerd.sock"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if _HOSTPORT.fullmatch(self.endpoint) is None:
            raise BuildError(f"--control-plane-endpoint {self.endpoint!r} is not HOST:PORT")
        if _VERSION.fullmatch(self.kubernetes_version) is None:
            raise BuildError(f"Kubernetes version {self.kubernetes_version!r} is not 1.MINOR.PATCH")
        for subnet in (self.pod_subnet, self.service_subnet):
            try:
                ipaddress.ip_network(subnet)
            except ValueError:
                raise BuildError(f"{subnet!r} is not a subnet (CIDR)") from None


def _doc(body: Mapping[str, Any]) -> str:
    return "#cloud-config\n" + yaml.safe_dump(dict(body), sort_keys=False, default_flow_style=False)


def worker_user_data(pool: PoolConfig, time_client: str = nodespec.DEFAULT_TIME_CLIENT) -> str:
    """The node pool's user-data; ``time_client`` (the image's, from its manifest) decides where the time
    servers go (:func:`imagebuilder.nodespec.time_servers_file`)."""
    pool.check()
    agent: dict[str, Any] = {"server": pool.server, "trust_domain": pool.trust_domain, "pool": pool.pool,
                             "bundle": AGENT_BUNDLE}  # fmt: skip
    if pool.join_server:
        agent["join_server"] = pool.join_server
    if pool.node_name:
        agent["node_name"] = pool.node_name
    agent.update(pool.agent_settings)
    files = [
        {
            "path": AGENT_CONFIG,
            "permissions": "0644",
            "owner": "root:root",
            "content": yaml.safe_dump(agent, sort_keys=True),
        },
        {"path": AGENT_BUNDLE, "permissions": "0644", "owner": "root:root", "content": pool.bundle_pem},
    ]
    if pool.profile:
        files.append(
            {
                "path": AGENT_POOL_PROFILE,
                "permissions": "0644",
                "owner": "root:root",
                "content": pool.profile,
            }
        )
    if pool.ntp:
        path, content = nodespec.time_servers_file(time_client, list(pool.ntp))
        files.append({"path": path, "permissions": "0644", "owner": "root:root", "content": content})
    files += [{"path": p, "permissions": "0644", "owner": "root:root", "content": c} for p, c in pool.files]
    return _doc({"write_files": files})


def kubeadm_init_documents(cp: ControlPlane) -> list[dict[str, Any]]:
    cp.check()
    return [
        {
            "apiVersion": KUBEADM_API,
            "kind": "InitConfiguration",
            "nodeRegistration": {"criSocket": cp.cri_socket},
        },
        {
            "apiVersion": KUBEADM_API,
            "kind": "ClusterConfiguration",
            "kubernetesVersion": f"v{cp.kubernetes_version}",
            "controlPlaneEndpoint": cp.endpoint,
            "networking": {"podSubnet": cp.pod_subnet, "serviceSubnet": cp.service_subnet},
        },
    ]


def kubeadm_join_document(cp: ControlPlane) -> dict[str, Any]:
    cp.check()
    return {
        "apiVersion": KUBEADM_API,
        "kind": "JoinConfiguration",
        "nodeRegistration": {"criSocket": cp.cri_socket},
        "discovery": {"file": {"kubeConfigPath": DISCOVERY}},
        "controlPlane": {"localAPIEndpoint": {"bindPort": int(cp.endpoint.rsplit(":", 1)[1])}},
    }


def control_plane_init_user_data(cp: ControlPlane) -> str:
    content = yaml.safe_dump_all(kubeadm_init_documents(cp), sort_keys=False)
    return _doc({
        "write_files": [{"path": INIT_CONFIG, "permissions": "0600", "owner": "root:root", "content": content}],
        "runcmd": [["kubeadm", "init", "--config", INIT_CONFIG, "--upload-certs"]],
    })  # fmt: skip


def control_plane_join_user_data(cp: ControlPlane) -> str:
    content = yaml.safe_dump(kubeadm_join_document(cp), sort_keys=False)
    wait = f"while [ ! -s {DISCOVERY} ]; do echo 'nodetrust: waiting for {DISCOVERY} (out of band)'; sleep 10; done"
    return _doc({
        "write_files": [{"path": JOIN_CONFIG, "permissions": "0600", "owner": "root:root", "content": content}],
        "runcmd": [["sh", "-c", wait], ["kubeadm", "join", "--config", JOIN_CONFIG]],
    })  # fmt: skip


# -- checks -----------------------------------------------------------------------------------------------


def check_worker(text: str) -> None:
    """Our rule for node-pool releases: cloud-config that only writes files (no packages, no commands)."""
    doc = _parse(text, "worker")
    extra = sorted(set(doc) - {"write_files"})
    if extra:
        raise BuildError(
            f"worker cloud-init: {', '.join(extra)}: a node-pool release only writes configuration"
        )
    paths = [f.get("path") for f in doc.get("write_files", []) if isinstance(f, dict)]
    if AGENT_CONFIG not in paths:
        raise BuildError(f"worker cloud-init does not write {AGENT_CONFIG}")


def check_kubeadm(documents: Sequence[Mapping[str, Any]], kinds: Sequence[str], version: str = "") -> None:
    """Our v1beta4 checks: the kinds in order, the API version, the Kubernetes version."""
    if [d.get("kind") for d in documents] != list(kinds):
        raise BuildError(
            f"kubeadm configuration: kinds {[d.get('kind') for d in documents]}, expected {list(kinds)}"
        )
    for d in documents:
        if d.get("apiVersion") != KUBEADM_API:
            raise BuildError(f"kubeadm {d.get('kind')}: apiVersion must be {KUBEADM_API}")
        if d.get("kind") == "ClusterConfiguration" and d.get("kubernetesVersion") != f"v{version}":
            raise BuildError(f"kubeadm ClusterConfiguration: kubernetesVersion is not v{version}")


def _parse(text: str, what: str) -> dict[str, Any]:
    if not text.startswith("#cloud-config\n"):
        raise BuildError(f"{what} cloud-init does not start with #cloud-config")
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise BuildError(f"{what} cloud-init is not a mapping")
    return doc


def cloud_init_command() -> list[str]:
    """How to run cloud-init's own ``schema`` command: the one on PATH, else Debian's package from the cache."""
    found = shutil.which("cloud-init")
    if found:
        return [found]
    root = CLOUD_INIT_DEB_CACHE / "root" / "usr" / "lib" / "python3" / "dist-packages"
    if not root.is_dir():
        raise BuildError(
            "cloud-init is not installed, so the release's cloud-init cannot be validated",
            hint="apt-get install cloud-init, or run scripts/cloud-init-schema.sh once (unpacks Debian's "
            "cloud-init into .cache/cloud-init-deb without installing its services)",
        )
    return ["/usr/bin/python3", "-m", "cloudinit.cmd.main"]


def validate_schema(path: Path) -> None:
    """``cloud-init schema -c PATH``: cloud-init's own validation; BuildError with its output if invalid."""
    argv = [*cloud_init_command(), "schema", "-c", str(path)]
    env = {}
    if argv[0] == "/usr/bin/python3":
        env["PYTHONPATH"] = str(CLOUD_INIT_DEB_CACHE / "root" / "usr" / "lib" / "python3" / "dist-packages")
    result = run(argv, check=False, env=env, timeout=120)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode("utf-8", errors="replace").strip()
        raise BuildError(f"{path.name}: cloud-init's schema validation refuses it:\n{output}")


def validate_kubeadm(path: Path, kubeadm: str | None) -> None:
    """``kubeadm config validate`` when a kubeadm binary is given (the release command's --kubeadm)."""
    if not kubeadm:
        return
    result = run([kubeadm, "config", "validate", "--config", str(path)], check=False, timeout=120)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode("utf-8", errors="replace").strip()
        raise BuildError(f"{path.name}: kubeadm config validate refuses it:\n{output}")
