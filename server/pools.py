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
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from protocol.errors import PolicyError
from protocol.policy import PRESETS, PROFILE, PoolPolicy, policy_from_mapping, preset
from protocol.settings import (
    Ctx,
    Kind,
    Setting,
    SettingError,
    Table,
    boolean,
    duration,
    integer,
    list_of,
    mapping_of,
    optional,
    path,
    raw,
    section,
    text,
)
from server.errors import ConfigError
from server.measured_boot import MeasuredBoot, measured_boot_kind

_HASH = r"sha256:[0-9a-f]{64}"
_VERSION = r"v[0-9]+\.[0-9]+\.[0-9]+"
_GROUP = r"system:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9]"
_POOL_NAME = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_ENDPOINT = r"[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}"
DEFAULT_GROUP = "system:bootstrappers:kubeadm:default-node-token"
MAX_FILE_BYTES = 1024 * 1024  # a CA certificate or a pool profile file larger than this is refused


@dataclass(frozen=True)
class Pool:
    name: str
    policy: PoolPolicy
    kubernetes_version: str
    api_server_endpoint: str
    extra_groups: tuple[str, ...]
    measured_boot: MeasuredBoot | None = None  # None: the pool does not check what the node booted
    require_enrolment: bool = False


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


_JOIN_DEFAULT: dict[str, Any] = {f.name: f.default for f in fields(JoinSettings)}
_ENDPOINT_KIND = text("HOST:PORT of the Kubernetes API server", pattern=_ENDPOINT, metavar="HOST:PORT")
_VERSION_KIND = text("a Kubernetes version like v1.36.3", pattern=_VERSION, metavar="VERSION")

CLUSTER = Table(
    "cluster",
    (
        Setting(
            "api_server_endpoint",
            _ENDPOINT_KIND,
            "HOST:PORT of the workload cluster's API server, as kubeadm join dials it",
            required=True,
        ),
        Setting("ca_cert", path(), "the cluster CA certificate (PEM or DER); its sha256 pin is computed"),
        Setting(
            "ca_cert_hashes",
            list_of(text("sha256:<64 lowercase hex>", pattern=_HASH), "a list of sha256:<hex> pins"),
            "CA pins given directly (several allowed, for a CA rotation); with ca_cert, both count",
            (),
        ),
        Setting(
            "kubernetes_version",
            _VERSION_KIND,
            "the Kubernetes version nodes join with (a pool may override it)",
            required=True,
        ),
    ),
    flags=False,
)
JOIN = Table(
    "join",
    (
        Setting(
            "token_ttl",
            duration("1m", "24h"),
            "bootstrap-token lifetime (short is the point)",
            dt.timedelta(minutes=15),
        ),
        Setting("clock_skew", duration(), "a join request must be this fresh", dt.timedelta(minutes=5)),
        Setting(
            "token_reuse_window",
            duration(),
            "a repeated request within this gets the same live token back",
            _JOIN_DEFAULT["token_reuse_window"],
        ),
        Setting(
            "joins_per_agent",
            integer(1, 10_000),
            "tokens minted per agent within join_window, at most",
            _JOIN_DEFAULT["joins_per_agent"],
        ),
        Setting("join_window", duration(), "the window of joins_per_agent", _JOIN_DEFAULT["join_window"]),
        Setting(
            "joins_retention",
            duration(),
            "how long the joins history is kept",
            _JOIN_DEFAULT["joins_retention"],
        ),
    ),
    flags=False,
)
_PROFILE_KIND = Kind(
    "profile",
    "a pool profile mapping or a preset name",
    "PROFILE",
    {"anyOf": [{"type": "string", "enum": sorted(PRESETS)}, PROFILE.json_schema()]},
    lambda value, ctx: value,  # policy_from_mapping checks it, naming pools.<name>.profile
)
POOL = Table(
    "pools.<name>",
    (
        Setting("profile", _PROFILE_KIND, "a pool profile (docs/gpu-checks.md) or a preset name"),
        Setting(
            "profile_file", path(), "or: a pool profile file (relative: from the configuration's folder)"
        ),
        Setting(
            "kubernetes_version",
            _VERSION_KIND,
            "this pool's Kubernetes version",
            default_text="cluster.kubernetes_version",
        ),
        Setting(
            "api_server_endpoint",
            _ENDPOINT_KIND,
            "this pool's API server",
            default_text="cluster.api_server_endpoint",
        ),
        Setting(
            "extra_groups",
            list_of(
                text("system:bootstrappers:<name>", pattern=_GROUP),
                "a list of system:bootstrappers:<name> groups",
            ),
            "the token's extra groups (system:bootstrappers:kubeadm:default-node-token is always added: kubeadm join needs it)",
            (DEFAULT_GROUP,),
        ),
        Setting(
            "measured_boot",
            optional(measured_boot_kind()),
            "admit only nodes whose TPM quote and event log match one of these releases (attestation.md)",
            None,
        ),
        Setting(
            "require_enrolment",
            boolean(),
            "admit only machines enrolled with `nodeserver enrol` (by EK hash), as their enrolled name",
            False,
        ),
    ),
    flags=False,
)
POOLS = mapping_of(
    _POOL_NAME, "a valid pool name (lowercase letters, digits, '-')", section(POOL), min_items=1, item="pool"
)
# token_backend is validated by server.tokens.backend.open_backend; this is its shape for editors.
_TOKEN_BACKEND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"enum": ["file", "kubernetes"]},
        "directory": {"type": "string"},
        "kubeconfig": {"type": "string"},
        "context": {"type": "string"},
        "namespace": {"type": "string"},
        "timeout": duration().schema,
    },
    "required": ["type"],
    "additionalProperties": False,
}
SECTION_KINDS: Mapping[str, Kind] = {
    "cluster": raw(CLUSTER.expected, CLUSTER.json_schema(), name="section"),
    "join": raw(JOIN.expected, JOIN.json_schema(), name="section"),
    "token_backend": raw(
        "a mapping such as {type: file, directory: PATH}", _TOKEN_BACKEND_SCHEMA, name="section"
    ),
    "pools": raw(POOLS.expected, POOLS.schema, name="section"),
}
"""The join broker's sections of the server configuration: checked for their type when the file
is read, and in full by :func:`join_settings`."""


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


def _read(path: Path, key: str) -> bytes:
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{key}: {path} is larger than {MAX_FILE_BYTES} bytes")
    return data


def _policy(name: str, spec: Mapping[str, Any]) -> PoolPolicy:
    key = f"pools.{name}"
    if (spec["profile"] is None) == (spec["profile_file"] is None):
        raise ConfigError(
            f"{key}: give exactly one of profile (a mapping or a preset name) and profile_file"
        )
    if spec["profile_file"] is not None:
        path = spec["profile_file"]
        try:
            doc = yaml.safe_load(_read(path, f"{key}.profile_file"))
        except (yaml.YAMLError, ValueError, RecursionError) as exc:
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
    ctx = Ctx(base_dir=base_dir)
    if "cluster" not in extra:
        raise ConfigError(
            "cluster is required with pools: api_server_endpoint, kubernetes_version and the CA "
            "(ca_cert or ca_cert_hashes); see docs/join.md"
        )
    if "token_backend" not in extra:
        raise ConfigError("token_backend is required with pools: see docs/join-backends.md")
    try:
        cluster = CLUSTER.parse(extra["cluster"], ctx.at("cluster"))
        join = JOIN.parse(extra.get("join", {}), ctx.at("join"))
        backend = SECTION_KINDS["token_backend"].parse(extra["token_backend"], ctx.at("token_backend"))
        pools_doc = POOLS.parse(extra["pools"], ctx.at("pools"))
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    hashes: list[str] = []
    if cluster["ca_cert"] is not None:
        hashes.append(ca_cert_hash(_read(cluster["ca_cert"], "cluster.ca_cert")))
    hashes.extend(cluster["ca_cert_hashes"])
    if not hashes:
        raise ConfigError(
            "cluster: set ca_cert (the cluster CA file) or ca_cert_hashes; joins without a CA pin are refused"
        )
    pools = {
        name: Pool(
            name=name,
            policy=_policy(name, spec),
            kubernetes_version=spec["kubernetes_version"] or cluster["kubernetes_version"],
            api_server_endpoint=spec["api_server_endpoint"] or cluster["api_server_endpoint"],
            extra_groups=spec["extra_groups"],
            measured_boot=spec["measured_boot"],
            require_enrolment=spec["require_enrolment"],
        )
        for name, spec in pools_doc.items()
    }
    return JoinSettings(
        api_server_endpoint=cluster["api_server_endpoint"],
        ca_cert_hashes=tuple(dict.fromkeys(hashes)),
        kubernetes_version=cluster["kubernetes_version"],
        pools=pools,
        token_backend=backend,
        **join,
    )
