"""The agent's configuration, layered from several sources, all described by one table.

Precedence, lowest first (a later source overrides an earlier one, key by key):

1. built-in defaults;
2. ``/etc/nodeagent/config.yaml``;
3. ``/etc/nodeagent/config.d/*.yaml``, in lexical order;
4. the kernel command line: ``nodeagent.<key>=<value>`` (``-`` and ``_`` are the same), so an
   iPXE script can point a netbooted node at its server: ``nodeagent.server=10.0.0.5:8081``;
5. the environment: ``NODEAGENT_<KEY>`` (upper case), e.g. ``NODEAGENT_POOL=hgx-h200``;
6. command-line flags of the command (``nodeagent run``, ``attest``, ``check``).

Every setting is a row of :data:`TABLE` (type, default, help, file key, flag, kernel key,
environment variable); the loader, each command's flags, the checks and docs/settings.md come
from it. Every command reads the same layers. Unknown keys in a file are refused with the file
and key named, unknown ``nodeagent.*`` kernel parameters and environment variables are refused
too (a typo must not silently fall back to a default).

The kernel command line is split with the kernel's own rules (``lib/cmdline.c``, ``next_arg``):
whitespace separates parameters, double quotes group (``nodeagent.bundle="/etc/a b.pem"``) and
the quotes around a parameter or its value are dropped, there are no escapes and an apostrophe is
an ordinary character; everything after a bare ``--`` is for init and not read.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from agent.errors import ConfigError, PoolProfileError
from protocol.cmdline import kernel_params
from protocol.errors import SpiffeIdError
from protocol.settings import Ctx, Problem, Setting, SettingError, Table
from protocol.settings import address as _address
from protocol.settings import boolean as _boolean
from protocol.settings import choice as _choice
from protocol.settings import duration as _duration
from protocol.settings import text as _text
from protocol.spiffe import validate_trust_domain

log = logging.getLogger(__name__)

CONFIG_DIR = Path("/etc/nodeagent")
CMDLINE = Path("/proc/cmdline")
ENV_PREFIX = "NODEAGENT_"
CMDLINE_PREFIX = "nodeagent."
DEFAULT_POOL_FILE = "/etc/nodeagent/pool.yaml"
MAX_FILE_BYTES = 1024 * 1024  # a configuration file larger than this is refused before parsing
# The kernel keeps at most COMMAND_LINE_SIZE bytes (2048 on x86 and arm64, 4096 on s390 by
# default); a longer /proc/cmdline is not one a kernel wrote and is refused before parsing.
MAX_CMDLINE_BYTES = 4096
DOCS = "docs/settings.md"


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
    event_log: str = "/sys/kernel/security/tpm0/binary_bios_measurements"  # the firmware's TCG event log
    image_info: str = "/etc/nodetrust/image.json"  # what the image carries (agent.kubeversion)
    # After the join (agent.lifecycle): a DevID for SPIRE's tpm_devid, then the image's SPIRE agent unit.
    devid_enrol: bool = False
    devid_dir: str = ""  # default: <state_dir>/devid
    devid_renew_before_s: float = 30 * 86400.0  # enrol anew when the DevID expires within this
    spire_agent_unit: str = ""  # started after the DevID (systemctl start --no-block); "": none

    @property
    def devid_path(self) -> Path:
        """The DevID files' folder: ``devid_dir``, else ``<state_dir>/devid``."""
        return Path(self.devid_dir) if self.devid_dir else Path(self.state_dir) / "devid"

    @property
    def after_join_wanted(self) -> bool:
        """Whether ``nodeagent run`` has a stage after the join (a DevID, the SPIRE agent unit)."""
        return self.devid_enrol or bool(self.spire_agent_unit)

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

    def pool_profile_spec(self) -> str:
        """The profile the local checks use: ``pool_profile``, else /etc/nodeagent/pool.yaml when
        it exists, else the pool name as a preset; raises :class:`PoolProfileError` when none."""
        if self.pool_profile:
            return self.pool_profile
        if Path(DEFAULT_POOL_FILE).is_file():
            return DEFAULT_POOL_FILE
        if self.pool:
            return self.pool
        raise PoolProfileError(
            f"no pool given and {DEFAULT_POOL_FILE} does not exist",
            hint="pass --pool-profile FILE or a preset (nvke, lepton-byok, domino, cpu), "
            "or set pool_profile (NODEAGENT_POOL_PROFILE, nodeagent.pool_profile=)",
        )


def _trust_domain_problem(value: str) -> str | None:
    if not value:
        return None  # unset: the commands that need it say so
    try:
        validate_trust_domain(value)
    except SpiffeIdError as exc:
        return str(exc)
    return None


# A systemd service name: no leading '-' (it is one argv word of systemctl), a template instance allowed.
UNIT_PATTERN = r"([A-Za-z0-9][A-Za-z0-9:_.@-]{0,240}\.service)?"
_ADDRESS = _address(as_tuple=False)
_PATH = _text("a path", metavar="PATH")
_SECONDS = _duration(seconds=True, positive=True)

TABLE = Table(
    "nodeagent",
    (
        Setting("server", _ADDRESS, "attestation server HOST:PORT (SPIRE Agent API)", ""),
        Setting(
            "join_server",
            _ADDRESS,
            "join broker HOST:PORT",
            "",
            default_text="the server's host, port 8082",
        ),
        Setting(
            "trust_domain",
            # matched whole: protocol.spiffe's own check lets a trailing newline through
            _text("a trust domain like example.org", pattern=r"[a-z0-9._-]{0,255}", metavar="NAME"),
            "trust domain, e.g. example.org",
            "",
            check=_trust_domain_problem,
        ),
        Setting(
            "bundle",
            _PATH,
            "bootstrap trust bundle (PEM CA certificates, from `nodeserver bundle`)",
            "/etc/nodeagent/bundle.pem",
        ),
        Setting(
            "tcti",
            _text(metavar="TCTI"),
            "TPM access, tpm2-tools syntax: device:/dev/tpmrm0, swtpm:host=H,port=P",
            "device:/dev/tpmrm0",
        ),
        Setting("ek_alg", _choice("rsa", "ecc"), "EK algorithm", "rsa"),
        Setting("require_ek_cert", _boolean(), "fail when the TPM has no EK certificate in NV", False),
        Setting("pool", _text(metavar="NAME"), "the node pool to join, as configured on the server", ""),
        Setting(
            "pool_profile",
            _text(metavar="FILE|PRESET"),
            "pool profile for the local checks: a YAML file or a preset (nvke, lepton-byok, domino, cpu)",
            "",
            default_text="/etc/nodeagent/pool.yaml, else the pool name as a preset",
        ),
        Setting(
            "node_name", _text(metavar="NAME"), "Kubernetes node name", "", default_text="the host name"
        ),
        Setting(
            "state_dir",
            _PATH,
            "where the SVID, its key, the lifecycle state and the joined marker are kept",
            "/var/lib/nodeagent",
        ),
        Setting("kubeadm", _PATH, "kubeadm executable", "kubeadm"),
        Setting(
            "cri_socket",
            _text(metavar="URL"),
            "container runtime socket for kubeadm",
            "unix:///run/containerd/containerd.sock",
        ),
        Setting(
            "join_config",
            _PATH,
            "where the JoinConfiguration is written (0600) while kubeadm runs, then removed",
            "/run/nodeagent/kubeadm-join.yaml",
        ),
        Setting("retry_initial_s", _SECONDS, "first retry delay after a transient failure (doubles)", 5.0),
        Setting("retry_max_s", _SECONDS, "longest retry delay", 300.0),
        Setting(
            "deadline_s",
            _SECONDS,
            "give up after this long (exit non-zero; systemd restarts the unit)",
            1500.0,
        ),
        Setting("reattest_before_s", _SECONDS, "re-attest when the SVID expires within this", 600.0),
        Setting(
            "timeout_s",
            _SECONDS,
            "timeout of each network exchange",
            60.0,
            flag_aliases=("--timeout",),
        ),
        Setting(
            "event_log",
            _PATH,
            "the firmware's TCG event log, sent with the TPM quote to pools that check measured boot",
            "/sys/kernel/security/tpm0/binary_bios_measurements",
        ),
        Setting(
            "image_info",
            _PATH,
            "what the node image carries (its Kubernetes versions: installed, staged), written by imagebuilder",
            "/etc/nodetrust/image.json",
        ),
        Setting(
            "devid_enrol",
            _boolean(),
            "after the join, enrol a DevID with the server (nodeserver) for SPIRE's tpm_devid attestor, "
            "unless devid_dir holds one valid for more than devid_renew_before_s",
            False,
        ),
        Setting(
            "devid_dir",
            _PATH,
            "where the DevID files go: devid.crt.pem, devid.priv.blob, devid.pub.blob (what spire-agent's "
            "tpm_devid reads) and devid-ca.pem",
            "",
            default_text="<state_dir>/devid",
        ),
        Setting(
            "devid_renew_before_s",
            _SECONDS,
            "enrol a new DevID when the certificate in devid_dir expires within this",
            30 * 86400.0,
        ),
        Setting(
            "spire_agent_unit",
            _text("a systemd service name like spire-agent.service", pattern=UNIT_PATTERN, metavar="UNIT"),
            "after the join (and the DevID, with devid_enrol), start this unit: `systemctl start --no-block "
            "UNIT`; empty: start nothing",
            "",
        ),
    ),
    env_prefix=ENV_PREFIX,
    cmdline_prefix=CMDLINE_PREFIX,
    lenient=True,
)
SETTINGS: tuple[Setting, ...] = TABLE.settings

# The settings each command reads (all of them from every layer, each also as a flag).
COMMAND_SETTINGS: Mapping[str, tuple[str, ...]] = {
    "run": tuple(s.name for s in SETTINGS),
    "attest": (
        "server",
        "trust_domain",
        "bundle",
        "tcti",
        "ek_alg",
        "require_ek_cert",
        "state_dir",
        "timeout_s",
    ),
    "check": ("pool_profile", "pool", "image_info", "state_dir"),
    "reattest": (
        "server",
        "join_server",
        "trust_domain",
        "bundle",
        "tcti",
        "ek_alg",
        "require_ek_cert",
        "pool",
        "node_name",
        "state_dir",
        "reattest_before_s",
        "timeout_s",
        "event_log",
    ),
}
# Option strings that differ from the table's, per command: ``check --pool`` predates
# ``--pool-profile`` and keeps its meaning (a profile); the pool name is then read from the
# other layers only.
COMMAND_FLAGS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "check": {"pool_profile": ("--pool-profile", "--pool"), "pool": ()},
}
# Variables with the prefix that are not settings (test hooks).
_IGNORED_ENV = {"NODEAGENT_FAULT_KILL_AFTER"}


def _normalise(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _error(source: str, exc: SettingError) -> ConfigError:
    """A :class:`SettingError` as the agent says it: the source first, the fix in the hint."""
    if exc.problem is Problem.UNKNOWN_KEY:
        return ConfigError(
            f"{source}: unknown setting {exc.path[-1]!r}",
            hint="known settings: " + ", ".join(TABLE.keys) + f" (see {DOCS})",
        )
    return ConfigError(f"{source}: {exc}", hint=f"see {DOCS} for every setting and how to write it")


def _setting(key: str, source: str) -> Setting:
    setting = TABLE.by_key.get(key)
    if setting is None:
        raise _error(source, SettingError((key,), Problem.UNKNOWN_KEY, allowed=TABLE.keys))
    return setting


def _coerce(key: str, value: Any, source: str, where: str = "") -> Any:
    setting = _setting(key, source)
    try:
        if isinstance(value, str):
            return TABLE.parse_text(setting.name, value, where or key)
        return TABLE.parse_value(setting, value, Ctx((where or key,), lenient=True))
    except SettingError as exc:
        raise _error(source, exc) from None


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes; this is not {what}")
    return data


def _from_file(path: Path) -> dict[str, Any]:
    data = _read_bounded(path, MAX_FILE_BYTES, "an agent configuration file")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # an integer of too many digits, nesting too deep
        raise ConfigError(f"{path} cannot be read as YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(doc).__name__}")
    out: dict[str, Any] = {}
    for raw_key, value in doc.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{path}: keys must be setting names, got {raw_key!r}")
        key = _normalise(raw_key)
        setting = _setting(key, str(path))
        if setting.name in out:
            raise ConfigError(f"{path}: {setting.key} is given twice ({raw_key!r})")
        out[setting.name] = _coerce(key, value, str(path), raw_key)
    return out


def parse_cmdline(text: str | bytes) -> dict[str, Any]:
    """``nodeagent.<key>=<value>`` parameters of a kernel command line, parsed and checked."""
    data = text.encode() if isinstance(text, str) else text
    if len(data) > MAX_CMDLINE_BYTES:
        raise ConfigError(
            f"kernel command line: {len(data)} bytes, more than a kernel keeps ({MAX_CMDLINE_BYTES})"
        )
    out: dict[str, Any] = {}
    prefix = CMDLINE_PREFIX.encode()
    for raw_param, raw_value in kernel_params(data):
        if not raw_param.startswith(prefix):
            continue
        try:
            param = raw_param.decode()
            value = None if raw_value is None else raw_value.decode()
        except UnicodeDecodeError:
            raise ConfigError(
                f"kernel command line: {raw_param[:64]!r} is not UTF-8", hint="write the value in UTF-8"
            ) from None
        key = _normalise(param[len(CMDLINE_PREFIX) :])
        setting = _setting(key, "kernel command line")
        if value is None:
            if setting.kind.name != "boolean":
                raise ConfigError(
                    f"kernel command line: {param!r} has no value (use {param}=VALUE)",
                    hint=f"see {DOCS}",
                )
            value = "true"  # a bare boolean parameter means true, as for the kernel's own
        out[setting.name] = _coerce(key, value, f"kernel command line {param}")
    return out


def parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _IGNORED_ENV:
            continue
        key = _normalise(name[len(ENV_PREFIX) :])
        setting = _setting(key, f"environment {name}")
        out[setting.name] = _coerce(key, value, f"environment {name}")
    return out


def load_config(
    *,
    config_dir: Path = CONFIG_DIR,
    cmdline_path: Path | None = CMDLINE,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[AgentConfig, dict[str, str]]:
    """Build the configuration; also return, for each key set, the source that set it.

    ``overrides`` are the command's flags: ``{name: text or value}`` (None: not given).
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    main = config_dir / "config.yaml"
    if main.exists():
        layers.append((str(main), _from_file(main)))
    drop_ins = config_dir / "config.d"
    if drop_ins.is_dir():
        for path in sorted(drop_ins.glob("*.yaml")):
            layers.append((str(path), _from_file(path)))
    if cmdline_path is not None and cmdline_path.exists():
        data = _read_bounded(cmdline_path, MAX_CMDLINE_BYTES, "a kernel command line")
        layers.append(("kernel command line", parse_cmdline(data)))
    layers.append(("environment", parse_env(os.environ if env is None else env)))
    if overrides:
        flags: dict[str, Any] = {}
        for name, value in overrides.items():
            if value is None:
                continue
            setting = TABLE.by_name.get(name)
            if setting is None:
                raise ConfigError(f"command line: unknown setting {name!r}")
            flags[name] = _coerce(setting.key, value, f"command line {setting.flag or name}")
        layers.append(("command line", flags))
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, layer in layers:
        for name, value in layer.items():
            values[name] = value
            origin[name] = source
    return AgentConfig(**values), origin


def describe(config: AgentConfig, origin: Mapping[str, str]) -> Sequence[tuple[str, str, str]]:
    """(key, value, source) rows for ``nodeagent status --config``; durations in Go syntax."""
    rows = []
    for s in SETTINGS:
        value = "(secret)" if s.secret else s.kind.show(getattr(config, s.name))
        rows.append((s.key, value, origin.get(s.name, "default")))
    return rows


def table_matches_config() -> list[str]:
    """Differences between :data:`TABLE` and :class:`AgentConfig` (names, defaults); [] when none."""
    problems = []
    names = [f.name for f in fields(AgentConfig)]
    if names != [s.name for s in SETTINGS]:
        problems.append(f"names differ: {names} vs {[s.name for s in SETTINGS]}")
    for f in fields(AgentConfig):
        s = TABLE.by_name.get(f.name)
        if s is not None and s.default != f.default:
            problems.append(f"{f.name}: table default {s.default!r}, AgentConfig default {f.default!r}")
    return problems


# --------------------------------------------------------------------------- the commands' options


def add_arguments(parser: Any, command: str) -> None:
    """``--config-dir``, ``--cmdline`` and one flag per setting ``command`` reads."""
    parser.add_argument(
        "--config-dir",
        default=str(CONFIG_DIR),
        metavar="DIR",
        help=f"configuration folder: DIR/config.yaml, then DIR/config.d/*.yaml (default {CONFIG_DIR})",
    )
    parser.add_argument(
        "--cmdline",
        default=str(CMDLINE),
        metavar="FILE",
        help=f"read nodeagent.<key>= kernel parameters from FILE (default {CMDLINE}; '' reads none)",
    )
    TABLE.add_arguments(parser, COMMAND_SETTINGS[command], flags=COMMAND_FLAGS.get(command))


def config_for(args: Any, command: str) -> tuple[AgentConfig, dict[str, str]]:
    """The configuration ``command`` runs with: every layer, then the flags it was given."""
    cmdline = Path(args.cmdline) if args.cmdline else None
    if cmdline is not None and cmdline != CMDLINE and not cmdline.is_file():
        raise ConfigError(
            f"--cmdline {cmdline}: no such file", hint="give a file, or '' to read no command line"
        )
    # A missing configuration folder is no file layer (an unconfigured node; the environment may do).
    return load_config(
        config_dir=Path(args.config_dir),
        cmdline_path=cmdline,
        overrides=TABLE.given(args, COMMAND_SETTINGS[command]),
    )
