"""The agent's configuration, layered from several sources.

Precedence, lowest first (a later source overrides an earlier one, key by key):

1. built-in defaults;
2. ``/etc/nodeagent/config.yaml``;
3. ``/etc/nodeagent/config.d/*.yaml``, in lexical order;
4. the kernel command line: ``nodeagent.<key>=<value>`` (``-`` and ``_`` are the same), so an
   iPXE script can point a netbooted node at its server: ``nodeagent.server=10.0.0.5:8081``;
5. the environment: ``NODEAGENT_<KEY>`` (upper case), e.g. ``NODEAGENT_POOL=hgx-h200``;
6. command-line flags of ``nodeagent run`` / ``nodeagent attest``.

Every key is listed in :data:`SETTINGS` with its type and help; unknown keys in a file are
refused with the file and key named, unknown ``nodeagent.*`` kernel parameters and environment
variables are refused too (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from agent.errors import ConfigError

CONFIG_DIR = Path("/etc/nodeagent")
CMDLINE = Path("/proc/cmdline")
ENV_PREFIX = "NODEAGENT_"
CMDLINE_PREFIX = "nodeagent."


@dataclass(frozen=True)
class Setting:
    key: str
    kind: type
    help: str


@dataclass(frozen=True)
class AgentConfig:
    server: str = ""  # attestation server HOST:PORT
    join_server: str = ""  # join broker HOST:PORT; default: the server's host, port 8082
    trust_domain: str = ""
    bundle: str = "/etc/nodeagent/bundle.pem"
    tcti: str = "device:/dev/tpmrm0"
    ek_alg: str = "rsa"
    require_ek_cert: bool = False
    pool: str = ""
    # A preset name or a YAML file for the local checks; default: /etc/nodeagent/pool.yaml, else the pool name.
    pool_profile: str = ""
    node_name: str = ""  # default: the host name
    state_dir: str = "/var/lib/nodeagent"
    kubeadm: str = "kubeadm"
    cri_socket: str = "unix:///run/containerd/containerd.sock"
    join_config: str = "/run/nodeagent/kubeadm-join.yaml"
    retry_initial_s: float = 5.0
    retry_max_s: float = 300.0
    deadline_s: float = 1500.0  # give up (exit non-zero, systemd restarts) after this long
    reattest_before_s: float = 600.0  # re-attest when the SVID has less than this left
    timeout_s: float = 60.0  # per network exchange

    @property
    def join_address(self) -> str:
        if self.join_server:
            return self.join_server
        host = self.server.rpartition(":")[0] or self.server
        return f"{host}:8082" if host else ""

    @property
    def effective_node_name(self) -> str:
        return (self.node_name or socket.gethostname()).lower()

    def missing_for_join(self) -> list[str]:
        return [k for k in ("server", "trust_domain", "pool") if not getattr(self, k)]


SETTINGS: tuple[Setting, ...] = (
    Setting("server", str, "attestation server HOST:PORT (SPIRE Agent API)"),
    Setting("join_server", str, "join broker HOST:PORT (default: the server's host, port 8082)"),
    Setting("trust_domain", str, "trust domain, e.g. example.org"),
    Setting("bundle", str, "bootstrap trust bundle (PEM CA certificates, from `nodeserver bundle`)"),
    Setting("tcti", str, "TPM access, tpm2-tools syntax (device:/dev/tpmrm0)"),
    Setting("ek_alg", str, "EK algorithm: rsa or ecc"),
    Setting("require_ek_cert", bool, "fail when the TPM has no EK certificate in NV"),
    Setting("pool", str, "the node pool to join, as configured on the server"),
    Setting("pool_profile", str, "pool profile for the local checks: a preset name or a YAML file"),
    Setting("node_name", str, "Kubernetes node name (default: the host name)"),
    Setting("state_dir", str, "where the SVID, its key and the lifecycle state are kept"),
    Setting("kubeadm", str, "kubeadm executable"),
    Setting("cri_socket", str, "container runtime socket for kubeadm"),
    Setting("join_config", str, "where the JoinConfiguration is written (0600) while kubeadm runs"),
    Setting("retry_initial_s", float, "first retry delay after a transient failure, seconds"),
    Setting("retry_max_s", float, "longest retry delay, seconds"),
    Setting("deadline_s", float, "give up after this many seconds (systemd restarts the unit)"),
    Setting("reattest_before_s", float, "re-attest when the SVID expires within this many seconds"),
    Setting("timeout_s", float, "timeout of each network exchange, seconds"),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def _normalise(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _coerce(key: str, value: Any, source: str) -> Any:
    setting = _BY_KEY.get(key)
    if setting is None:
        raise ConfigError(
            f"{source}: unknown setting {key!r}",
            hint="known settings: " + ", ".join(sorted(_BY_KEY)),
        )
    if setting.kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if setting.kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be a number of seconds, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: {key} must be a number of seconds, got {value!r}") from None
        if number <= 0:
            raise ConfigError(f"{source}: {key} must be positive")
        return number
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be a string, got {type(value).__name__}")
    return str(value)


def _from_file(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    return {_normalise(k): _coerce(_normalise(k), v, str(path)) for k, v in doc.items()}


def parse_cmdline(text: str) -> dict[str, Any]:
    """``nodeagent.<key>=<value>`` parameters of a kernel command line."""
    out: dict[str, Any] = {}
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"kernel command line: {exc}") from exc
    for word in words:
        if not word.startswith(CMDLINE_PREFIX):
            continue
        key, sep, value = word[len(CMDLINE_PREFIX) :].partition("=")
        if not sep:
            raise ConfigError(f"kernel command line: {word!r} has no value (use {word}=VALUE)")
        key = _normalise(key)
        out[key] = _coerce(key, value, "kernel command line")
    return out


def parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _IGNORED_ENV:
            continue
        key = _normalise(name[len(ENV_PREFIX) :])
        out[key] = _coerce(key, value, f"environment {name}")
    return out


# Variables with the prefix that are not settings (test hooks, the CLI's own conveniences).
_IGNORED_ENV = {"NODEAGENT_FAULT_KILL_AFTER"}


def load_config(
    *,
    config_dir: Path = CONFIG_DIR,
    cmdline_path: Path | None = CMDLINE,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[AgentConfig, dict[str, str]]:
    """Build the configuration; also return, for each key set, the source that set it."""
    layers: list[tuple[str, dict[str, Any]]] = []
    main = config_dir / "config.yaml"
    if main.exists():
        layers.append((str(main), _from_file(main)))
    drop_ins = config_dir / "config.d"
    if drop_ins.is_dir():
        for path in sorted(drop_ins.glob("*.yaml")):
            layers.append((str(path), _from_file(path)))
    if cmdline_path is not None and cmdline_path.exists():
        layers.append(("kernel command line", parse_cmdline(cmdline_path.read_text())))
    layers.append(("environment", parse_env(os.environ if env is None else env)))
    if overrides:
        layers.append(
            (
                "command line",
                {k: _coerce(k, v, "command line") for k, v in overrides.items() if v is not None},
            )
        )
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, layer in layers:
        for key, value in layer.items():
            values[key] = value
            origin[key] = source
    config = replace(AgentConfig(), **values)
    if config.ek_alg not in ("rsa", "ecc"):
        raise ConfigError(f"ek_alg must be rsa or ecc, got {config.ek_alg!r} (from {origin.get('ek_alg')})")
    for key in ("server", "join_server"):
        value = getattr(config, key)
        if value and (":" not in value or not value.rpartition(":")[2].isdigit()):
            raise ConfigError(f"{key} must be HOST:PORT, got {value!r} (from {origin.get(key)})")
    return config, origin


def describe(config: AgentConfig, origin: Mapping[str, str]) -> Sequence[tuple[str, str, str]]:
    """(key, value, source) rows for ``nodeagent status --config``."""
    return [(s.key, str(getattr(config, s.key)), origin.get(s.key, "default")) for s in SETTINGS]
