"""The join broker's configuration: the cluster, the token policy and the node pools.

Validated at start, with errors that name the key::

    join_listen: 0.0.0.0:8082        # the Join API (mutual TLS with agent SVIDs)
    cluster:
      api_server_endpoint: 10.0.0.10:6443
      ca_cert: /etc/nodeserver/cluster-ca.crt   # the cluster CA; its pin is computed
      # or: ca_cert_hashes: ["sha256:<64 hex>"]
      kubernetes_version: v1.36.3
    join:
      token_ttl: 15m                 # bootstrap-token lifetime
      clock_skew: 5m                 # join requests must be this fresh
    token_backend: {type: file, directory: /var/lib/nodeserver/tokens}
    pools:
      hgx-h200:
        profile: {preset: nvke, gpu: {model: NVIDIA H200, count: 8}}   # a pool profile (gpu-checks.md)
        # or: profile_file: pools/hgx-h200.yaml
        kubernetes_version: v1.36.3  # optional override of cluster.kubernetes_version
        extra_groups: [system:bootstrappers:nodetrust:hgx-h200]
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from protocol.errors import PolicyError
from protocol.policy import PoolPolicy, policy_from_mapping, preset
from server.config import parse_duration
from server.errors import ConfigError

_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_VERSION_RE = re.compile(r"^v\d+\.\d+\.\d+$")
_GROUP_RE = re.compile(r"\Asystem:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9]\Z")
_POOL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DEFAULT_GROUP = "system:bootstrappers:kubeadm:default-node-token"


@dataclass(frozen=True)
class Pool:
    name: str
    policy: PoolPolicy
    kubernetes_version: str
    api_server_endpoint: str
    extra_groups: tuple[str, ...]


@dataclass(frozen=True)
class JoinSettings:
    api_server_endpoint: str
    ca_cert_hashes: tuple[str, ...]
    kubernetes_version: str
    token_ttl: dt.timedelta
    clock_skew: dt.timedelta
    pools: dict[str, Pool]
    token_backend: Mapping[str, Any]
    # Per-agent limits (docs/join.md, "Limits"): a repeated request within token_reuse_window gets
    # the same live token back; at most joins_per_agent tokens are minted per join_window; the
    # joins history keeps joins_retention.
    token_reuse_window: dt.timedelta = dt.timedelta(minutes=2)
    joins_per_agent: int = 10
    join_window: dt.timedelta = dt.timedelta(hours=1)
    joins_retention: dt.timedelta = dt.timedelta(days=30)


def ca_cert_hash(pem_or_der: bytes) -> str:
    """``sha256:<hex>`` of a CA certificate's SubjectPublicKeyInfo, as kubeadm pins it."""
    try:
        cert = (
            x509.load_pem_x509_certificate(pem_or_der)
            if b"-----BEGIN" in pem_or_der
            else x509.load_der_x509_certificate(pem_or_der)
        )
    except ValueError as exc:
        raise ConfigError(f"cluster.ca_cert is not an X.509 certificate: {exc}") from exc
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _only(doc: Mapping[str, Any], key: str, allowed: set[str]) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ConfigError(
            f"{key}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(allowed))}"
        )


def _endpoint(value: Any, key: str) -> str:
    if not isinstance(value, str) or not re.match(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$", value):
        raise ConfigError(f"{key}: expected HOST:PORT of the Kubernetes API server, got {value!r}")
    return value


def _version(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _VERSION_RE.match(value):
        raise ConfigError(f"{key}: expected a Kubernetes version like v1.36.3, got {value!r}")
    return value


def _groups(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(g, str) and _GROUP_RE.match(g) for g in value):
        raise ConfigError(f"{key}: expected a list of system:bootstrappers:<name> groups, got {value!r}")
    return tuple(value)


def _policy(name: str, spec: Mapping[str, Any], base_dir: Path | None) -> PoolPolicy:
    key = f"pools.{name}"
    if ("profile" in spec) == ("profile_file" in spec):
        raise ConfigError(
            f"{key}: give exactly one of profile (a mapping or a preset name) and profile_file"
        )
    if "profile_file" in spec:
        path = Path(spec["profile_file"])
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{key}.profile_file: cannot read {path}: {exc}") from exc
    else:
        doc = spec["profile"]
    try:
        if isinstance(doc, str):
            return preset(doc)
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{key}.profile: expected a pool profile mapping or a preset name")
        return policy_from_mapping({"name": name, **doc})
    except (PolicyError, KeyError, ValueError) as exc:
        raise ConfigError(f"{key}.profile: {exc}") from exc


def join_settings(extra: Mapping[str, Any], *, base_dir: Path | None = None) -> JoinSettings | None:
    """The join configuration from the server config's extra sections; None when no pool is set."""
    if "pools" not in extra:
        for k in ("cluster", "join", "token_backend"):
            if k in extra:
                raise ConfigError(f"{k} is set but no pools are: add a pools section, or remove {k}")
        return None
    cluster = _mapping(extra.get("cluster"), "cluster")
    _only(cluster, "cluster", {"api_server_endpoint", "ca_cert", "ca_cert_hashes", "kubernetes_version"})
    endpoint = _endpoint(cluster.get("api_server_endpoint"), "cluster.api_server_endpoint")
    hashes: list[str] = []
    if "ca_cert" in cluster:
        path = Path(str(cluster["ca_cert"]))
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            hashes.append(ca_cert_hash(path.read_bytes()))
        except OSError as exc:
            raise ConfigError(f"cluster.ca_cert: cannot read {path}: {exc.strerror}") from exc
    for i, h in enumerate(cluster.get("ca_cert_hashes", [])):
        if not isinstance(h, str) or not _HASH_RE.match(h):
            raise ConfigError(f"cluster.ca_cert_hashes[{i}]: expected sha256:<64 lowercase hex>, got {h!r}")
        hashes.append(h)
    if not hashes:
        raise ConfigError(
            "cluster: set ca_cert (the cluster CA file) or ca_cert_hashes; joins without a CA pin are refused"
        )
    version = _version(cluster.get("kubernetes_version"), "cluster.kubernetes_version")
    join = _mapping(extra.get("join", {}), "join")
    _only(
        join,
        "join",
        {
            "token_ttl",
            "clock_skew",
            "token_reuse_window",
            "joins_per_agent",
            "join_window",
            "joins_retention",
        },
    )
    ttl = parse_duration(join.get("token_ttl", "15m"), "join.token_ttl")
    if not dt.timedelta(minutes=1) <= ttl <= dt.timedelta(hours=24):
        raise ConfigError("join.token_ttl: must be between 1m and 24h (short is the point)")
    skew = parse_duration(join.get("clock_skew", "5m"), "join.clock_skew")
    limits: dict[str, Any] = {}
    for key in ("token_reuse_window", "join_window", "joins_retention"):
        if key in join:
            limits[key] = parse_duration(join[key], f"join.{key}")
    if "joins_per_agent" in join:
        n = join["joins_per_agent"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10_000:
            raise ConfigError(f"join.joins_per_agent: expected an integer 1..10000, got {n!r}")
        limits["joins_per_agent"] = n
    backend = _mapping(extra.get("token_backend"), "token_backend")
    pools_doc = _mapping(extra["pools"], "pools")
    if not pools_doc:
        raise ConfigError("pools: define at least one pool")
    pools: dict[str, Pool] = {}
    for name, raw in pools_doc.items():
        if not isinstance(name, str) or not _POOL_RE.match(name):
            raise ConfigError(f"pools: {name!r} is not a valid pool name (lowercase letters, digits, '-')")
        spec = _mapping(raw, f"pools.{name}")
        _only(
            spec,
            f"pools.{name}",
            {"profile", "profile_file", "kubernetes_version", "api_server_endpoint", "extra_groups"},
        )
        pools[name] = Pool(
            name=name,
            policy=_policy(name, spec, base_dir),
            kubernetes_version=_version(
                spec.get("kubernetes_version", version), f"pools.{name}.kubernetes_version"
            ),
            api_server_endpoint=_endpoint(
                spec.get("api_server_endpoint", endpoint), f"pools.{name}.api_server_endpoint"
            ),
            extra_groups=_groups(spec.get("extra_groups", [DEFAULT_GROUP]), f"pools.{name}.extra_groups"),
        )
    return JoinSettings(
        api_server_endpoint=endpoint,
        ca_cert_hashes=tuple(dict.fromkeys(hashes)),
        kubernetes_version=version,
        token_ttl=ttl,
        clock_skew=skew,
        pools=pools,
        token_backend=backend,
        **limits,
    )
