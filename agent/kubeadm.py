"""The join step on the node: a kubeadm ``JoinConfiguration`` (v1beta4) and ``kubeadm join``.

Public API::

    join_configuration(*, token: str, api_server_endpoint: str, ca_cert_hashes: Sequence[str],
                       node_name: str, taints: Sequence[tuple[str, str, str]],
                       labels: Mapping[str, str], kubelet_extra_args: Sequence[tuple[str, str]] = (),
                       cri_socket: str = "unix:///run/containerd/containerd.sock") -> dict[str, Any]
    write_join_config(path: Path, doc: dict[str, Any]) -> None      # YAML, 0600, atomic
    kubeadm_join(config_path: Path, *, kubeadm: str = "kubeadm", timeout: float = 600) -> None
        # KubeadmFailedError (with .failure) when kubeadm ran and failed
    kubeadm_reset(*, kubeadm: str = "kubeadm", cri_socket: str, timeout: float = 300) -> None
    @dataclass(frozen=True) class KubeadmFailure:
        status: int; phase: str | None; error: str; preflight_errors: tuple[str, ...]
        node_untouched -> bool     # kubeadm stopped in its preflight phase: it wrote nothing
    parse_failure(status: int, output: str) -> KubeadmFailure
    failure_hint(failure: KubeadmFailure) -> str
    redact(text: str, *secrets: str) -> str

The document follows ``kubeadm.k8s.io/v1beta4`` (reference §6.3): token discovery
pinned to the cluster CA (``unsafeSkipCAVerification: false``), an explicit taint
list (``[]`` means none, never kubeadm's defaults), ``kubeletExtraArgs`` as a list of
``{name, value}`` with the node labels as ``node-labels``, and the four timeouts.

Invalid input raises :class:`JoinConfigError` with a hint, before anything is
written or run.

A failed ``kubeadm join`` is judged from what kubeadm states, never from its warnings: the exit status,
the ``error execution phase <phase>: <error>`` line and the names of the fatal preflight checks
(``[ERROR <check>]: ...``). ``[WARNING ...]`` lines and klog lines are ignored: real nodes print warnings
on every run (containerd 1.x: ``ContainerRuntimeVersion``; no systemd: ``Service-kubelet``), and once
a warning's words picked the hint. The phase also says whether the node was changed: a failure in
``preflight`` wrote nothing; any later phase, or no phase line at all (kubeadm killed, timed out),
may have left a partial join behind, which the lifecycle undoes with :func:`kubeadm_reset` before it
tries again. The token is a secret: it lives only in the 0600 file, which
``kubeadm_join`` always removes, and it is redacted from every message and log
line (kubeadm's output included).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.errors import JoinConfigError, KubeadmError, KubeadmFailedError
from agent.files import read_bounded, write_atomic
from agent.proc import CommandError, Failure, run

log = logging.getLogger(__name__)

API_VERSION = "kubeadm.k8s.io/v1beta4"
DEFAULT_CRI_SOCKET = "unix:///run/containerd/containerd.sock"
TIMEOUTS = {
    "discovery": "5m0s",
    "tlsBootstrap": "5m0s",
    "kubeletHealthCheck": "4m0s",
    "kubernetesAPICall": "1m0s",
}
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MAX_JOIN_CONFIG_BYTES = 1024 * 1024

_TOKEN_RE = re.compile(r"\A[a-z0-9]{6}\.[a-z0-9]{16}\Z")
_TOKEN_IN_TEXT = re.compile(r"\b([a-z0-9]{6})\.[a-z0-9]{16}\b")
_HASH_RE = re.compile(r"\Asha256:[0-9a-fA-F]{64}\Z")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"\A{_DNS_LABEL}(\.{_DNS_LABEL})*\Z")
_NAME_RE = re.compile(r"\A([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_ARG_RE = re.compile(r"\A[a-z0-9][a-z0-9-]*\Z")
# Labels the kubelet may set on its own Node (k8s.io/kubelet well_known_labels.go, IsKubeletLabel).
_KUBELET_LABELS = {
    "kubernetes.io/hostname",
    "kubernetes.io/os",
    "kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
}
_KUBELET_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
_HINT_SERVER = "the join broker sent it; check the pool and cluster settings of nodeserver"

_PHASE_LINE = re.compile(
    r"^(?:error: )?error execution phase (?P<phase>[A-Za-z0-9/_-]+): (?P<error>.*)$", re.M
)
_PREFLIGHT_ERROR = re.compile(r"^\s*\[ERROR (?P<check>[A-Za-z0-9._/-]+)\]: ", re.M)
# Fatal preflight checks that mean "an earlier join left this": kubeadm's check names.
_LEFTOVER_CHECKS = ("FileAvailable--", "DirAvailable--", "Port-")
# (pattern on kubeadm's own error line, hint); the first match wins. Only the error line is searched.
_ERROR_HINTS = (
    (
        re.compile(
            r"none of the public keys .* are pinned|cluster CA found in cluster-info ConfigMap is invalid"
        ),
        "the cluster CA does not match the pinned caCertHashes: check cluster.ca_cert on nodeserver",
    ),
    (
        re.compile(r"JWS signature|token id .* is invalid|has expired|Unauthorized"),
        "the bootstrap token expired or was deleted before kubeadm used it; the agent asks for a new one",
    ),
    (
        re.compile(r"\bis forbidden: User \"system:bootstrap:"),
        "the cluster refused the bootstrap token what kubeadm join needs: its groups must include "
        "system:bootstrappers:kubeadm:default-node-token (nodeserver always adds it) and the cluster must have "
        "kubeadm's bootstrap-token RBAC (`kubeadm init phase bootstrap-token` on the control plane)",
    ),
    (
        re.compile(
            r"connection refused|i/o timeout|no route to host|context deadline exceeded|network is unreachable"
        ),
        "the API server endpoint is unreachable from this node: check routing and firewalls to port 6443",
    ),
)


@dataclass(frozen=True)
class KubeadmFailure:
    """What a failed kubeadm run said about itself (never its warnings)."""

    status: int  # exit status; negative: killed by that signal
    phase: str | None  # "preflight", "kubelet-start", ...; None: kubeadm stated none (killed, timed out)
    error: str  # kubeadm's error, after "error execution phase <phase>: " (redacted)
    preflight_errors: tuple[str, ...] = ()  # names of the fatal preflight checks

    @property
    def node_untouched(self) -> bool:
        """kubeadm stopped in its preflight phase, which writes nothing to the node."""
        return self.phase == "preflight"


def parse_failure(status: int, output: str) -> KubeadmFailure:
    """The failing phase, kubeadm's error line and the fatal preflight checks in ``output``."""
    phases = list(_PHASE_LINE.finditer(output))
    last = phases[-1] if phases else None
    checks = tuple(dict.fromkeys(m.group("check") for m in _PREFLIGHT_ERROR.finditer(output)))
    return KubeadmFailure(
        status=status,
        phase=last.group("phase") if last else None,
        error=last.group("error").strip() if last else "",
        preflight_errors=checks,
    )


def failure_hint(failure: KubeadmFailure, *, cri_socket: str = DEFAULT_CRI_SOCKET) -> str:
    """What to do about ``failure``, from its phase, its preflight check names and its error line."""
    leftovers = [c for c in failure.preflight_errors if c.startswith(_LEFTOVER_CHECKS)]
    if leftovers:
        return (
            f"files or ports of another kubeadm join are in the way ({', '.join(leftovers)}); the agent undoes "
            "only its own failed joins, so if this node should join afresh run `kubeadm reset -f` "
            "(and remove /var/lib/nodeagent/joined); the agent tries again"
        )
    if "CRI" in failure.preflight_errors:
        return f"the container runtime is not answering on {cri_socket}: check `systemctl status containerd`"
    if "KubeletVersion" in failure.preflight_errors:
        return (
            "the kubelet is missing or of the wrong version: the image must stage the pinned kubelet on PATH"
        )
    for pattern, hint in _ERROR_HINTS:
        if pattern.search(failure.error):
            return hint
    if failure.phase is None:
        how = (
            f"was killed by signal {-failure.status}"
            if failure.status < 0
            else "stopped without naming a phase"
        )
        return (
            f"kubeadm {how} before it finished; the agent runs `kubeadm reset -f` before it tries again "
            "(see `journalctl -u nodeagent` for its output)"
        )
    if failure.phase.startswith(("kubelet-start", "kubelet-wait-bootstrap")):
        return (
            "the kubelet did not start or did not finish its TLS bootstrap: see `journalctl -u kubelet`; "
            "the agent runs `kubeadm reset -f` before it tries again"
        )
    return f"kubeadm failed in its {failure.phase} phase: see `journalctl -u nodeagent` for its whole output"


def redact(text: str, *secrets: str) -> str:
    """``text`` with each of ``secrets`` and anything shaped like a bootstrap token replaced."""
    text = _TOKEN_IN_TEXT.sub(r"\1.<redacted>", text)  # keeps the public id, which helps debugging
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def _bad(message: str, hint: str) -> JoinConfigError:
    return JoinConfigError(message, hint=hint)


def _check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or ":" not in endpoint:
        raise _bad(f"API server endpoint {endpoint!r} is not HOST:PORT", _HINT_SERVER)
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _bad(f"API server endpoint {endpoint!r}: port must be 1..65535", _HINT_SERVER)
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _bad(f"API server endpoint {endpoint!r}: bad IPv6 address", _HINT_SERVER) from None
        return
    try:
        ipaddress.IPv4Address(host)
        return
    except ValueError:
        pass
    if len(host) > 253 or not _DNS_SUBDOMAIN_RE.match(host.lower()):
        raise _bad(
            f"API server endpoint {endpoint!r}: host must be a DNS name, an IPv4 address or [IPv6]",
            _HINT_SERVER,
        )


def _check_qualified_name(key: str, what: str) -> None:
    prefix, slash, name = key.rpartition("/")
    ok = bool(_NAME_RE.match(name)) and len(name) <= 63
    if slash:
        ok = ok and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN_RE.match(prefix))
    if not ok:
        raise _bad(
            f"{what} key {key!r} is not a valid Kubernetes qualified name ([prefix/]name, name at most 63 "
            "characters of [A-Za-z0-9-_.] starting and ending alphanumeric)",
            _HINT_SERVER,
        )


def _check_value(value: str, what: str) -> None:
    if not isinstance(value, str) or len(value) > 63 or (value and not _NAME_RE.match(value)):
        raise _bad(
            f"{what} value {value!r} is not a valid label value (at most 63 of [A-Za-z0-9-_.])", _HINT_SERVER
        )


def _check_kubelet_label(key: str) -> None:
    """The kubelet refuses to start with --node-labels in kubernetes.io/k8s.io it may not set itself."""
    prefix = key.rpartition("/")[0].lower()
    restricted = any(prefix == ns or prefix.endswith("." + ns) for ns in ("kubernetes.io", "k8s.io"))
    if not restricted or key in _KUBELET_LABELS:
        return
    if any(prefix == ns or prefix.endswith("." + ns) for ns in _KUBELET_NAMESPACES):
        return
    raise _bad(
        f"the kubelet may not set label {key!r} on its own Node (NodeRestriction; the kubelet exits on it)",
        "set node-role.kubernetes.io/* and other kubernetes.io labels from the control plane after the join, "
        "or use a label under node.kubernetes.io/ or your own prefix",
    )


def join_configuration(
    *,
    token: str,
    api_server_endpoint: str,
    ca_cert_hashes: Sequence[str],
    node_name: str,
    taints: Sequence[tuple[str, str, str]],
    labels: Mapping[str, str],
    kubelet_extra_args: Sequence[tuple[str, str]] = (),
    cri_socket: str = DEFAULT_CRI_SOCKET,
) -> dict[str, Any]:
    """The ``JoinConfiguration`` document for this node; raises :class:`JoinConfigError` on bad input."""
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        # Never echo the value: it may be a slightly malformed real secret.
        raise _bad("the bootstrap token is not of the form [a-z0-9]{6}.[a-z0-9]{16}", _HINT_SERVER)
    _check_endpoint(api_server_endpoint)
    if isinstance(ca_cert_hashes, str) or not ca_cert_hashes:
        raise _bad(
            "no CA certificate hash: kubeadm would have to trust whatever API server answers",
            "nodeserver must send the cluster CA pin (sha256:<hex of the CA SubjectPublicKeyInfo>)",
        )
    hashes = []
    for value in ca_cert_hashes:
        if not isinstance(value, str) or not _HASH_RE.match(value):
            raise _bad(f"CA certificate hash {value!r} is not sha256:<64 hex digits>", _HINT_SERVER)
        hashes.append(value.lower())
    if not isinstance(node_name, str) or len(node_name) > 253 or not _DNS_SUBDOMAIN_RE.match(node_name):
        raise _bad(
            f"node name {node_name!r} is not a DNS-1123 subdomain (lower-case a-z, 0-9, '-' and '.', at most 253)",
            "set node_name in the agent configuration, or give the host a lower-case host name",
        )
    taint_list = []
    for taint in taints:
        if not isinstance(taint, tuple | list) or len(taint) != 3:
            raise _bad(f"taint {taint!r} is not (key, value, effect)", _HINT_SERVER)
        key, value, effect = taint
        _check_qualified_name(key, "taint")
        _check_value(value, f"taint {key}")
        if effect not in TAINT_EFFECTS:
            raise _bad(
                f"taint {key}: effect {effect!r} is not one of {', '.join(TAINT_EFFECTS)}", _HINT_SERVER
            )
        entry = {"key": key, "effect": effect}
        if value:
            entry["value"] = value
        taint_list.append(entry)
    for key, value in labels.items():
        _check_qualified_name(key, "label")
        _check_value(value, f"label {key}")
        _check_kubelet_label(key)
    args: list[dict[str, str]] = []
    for arg in kubelet_extra_args:
        if not isinstance(arg, tuple | list) or len(arg) != 2 or not all(isinstance(x, str) for x in arg):
            raise _bad(f"kubelet argument {arg!r} is not (name, value)", _HINT_SERVER)
        name, value = arg
        if not _ARG_RE.match(name):
            raise _bad(
                f"kubelet argument name {name!r} must be a flag name without dashes (e.g. max-pods)",
                _HINT_SERVER,
            )
        if name == "node-labels":
            raise _bad(
                "kubelet argument node-labels is set from the labels; do not pass it twice", _HINT_SERVER
            )
        args.append({"name": name, "value": value})
    if labels:
        args.append({"name": "node-labels", "value": ",".join(f"{k}={labels[k]}" for k in sorted(labels))})
    if not isinstance(cri_socket, str) or not re.match(r"\Aunix:///\S+\Z", cri_socket):
        raise _bad(
            f"CRI socket {cri_socket!r} is not a unix:///absolute/path URL",
            "set cri_socket in the agent configuration (e.g. unix:///run/containerd/containerd.sock)",
        )
    return {
        "apiVersion": API_VERSION,
        "kind": "JoinConfiguration",
        "discovery": {
            "bootstrapToken": {
                "token": token,
                "apiServerEndpoint": api_server_endpoint,
                "caCertHashes": hashes,
                "unsafeSkipCAVerification": False,
            },
        },
        "nodeRegistration": {
            "name": node_name,
            "criSocket": cri_socket,
            "taints": taint_list,
            "kubeletExtraArgs": args,
        },
        "timeouts": dict(TIMEOUTS),
    }


def write_join_config(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as YAML to ``path`` atomically with mode 0600 (it holds the token)."""
    data = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).encode()
    try:
        write_atomic(path, data, mode=0o600)
    except OSError as exc:
        raise KubeadmError(
            f"cannot write the join configuration {path}: {exc.strerror}",
            hint=f"the folder {path.parent} must exist and be writable by root",
        ) from exc
    log.debug("wrote the join configuration to %s", path)


def _tokens_in(path: Path) -> list[str]:
    """The secrets inside a join configuration file, to redact them from kubeadm's output."""
    try:
        doc = yaml.safe_load(read_bounded(path, MAX_JOIN_CONFIG_BYTES))
    except (OSError, ValueError, yaml.YAMLError):  # FileTooLargeError is a ValueError
        return []
    found: list[str] = []
    discovery = doc.get("discovery") if isinstance(doc, dict) else None
    if not isinstance(discovery, dict):
        return found
    bootstrap = discovery.get("bootstrapToken")
    values = [
        bootstrap.get("token") if isinstance(bootstrap, dict) else None,
        discovery.get("tlsBootstrapToken"),
    ]
    for value in values:
        if isinstance(value, str) and value:
            found += [value, value.partition(".")[2]]
    return found


def _tail(text: str, lines: int = 8) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " / ".join(kept)


def _cri_socket_of(config_path: Path) -> str:
    try:
        doc = yaml.safe_load(read_bounded(config_path, MAX_JOIN_CONFIG_BYTES))
        value = doc["nodeRegistration"]["criSocket"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return DEFAULT_CRI_SOCKET
    return value if isinstance(value, str) else DEFAULT_CRI_SOCKET


def kubeadm_reset(
    *, kubeadm: str = "kubeadm", cri_socket: str = DEFAULT_CRI_SOCKET, timeout: float = 300
) -> None:
    """``kubeadm reset -f``: undo a partial join (kubelet files, its certificates, /var/lib/kubelet).

    Only for a join of this agent's that did not finish; never after a successful one.
    """
    argv = [kubeadm, "reset", "-f", "--cri-socket", cri_socket]
    log.warning("undoing an unfinished kubeadm join: %s", " ".join(argv))
    try:
        result = run(argv, timeout=timeout, check=False)
    except CommandError as exc:
        raise KubeadmError(
            f"kubeadm reset could not run: {exc.message}",
            hint="run `kubeadm reset -f` on the node yourself; the agent tries again",
        ) from exc
    if result.returncode != 0:
        output = redact(result.stdout + "\n" + result.stderr)
        log.warning("kubeadm reset failed (exit %d); its output:\n%s", result.returncode, output.strip())
        failure = parse_failure(result.returncode, output)
        raise KubeadmFailedError(
            f"kubeadm reset -f exited with status {result.returncode}: {failure.error or _tail(output) or 'no output'}",
            hint="run `kubeadm reset -f` on the node yourself and look at what it says; the agent tries again",
            failure=failure,
        )
    log.info("kubeadm reset -f undid the unfinished join")


def kubeadm_join(config_path: Path, *, kubeadm: str = "kubeadm", timeout: float = 600) -> None:
    """Run ``kubeadm join --config <config_path>``; the file is removed afterwards, whatever happens."""
    try:
        secrets = _tokens_in(config_path)
        mode = stat.S_IMODE(config_path.stat().st_mode)
        if mode & 0o077:
            raise KubeadmError(
                f"the join configuration {config_path} has mode {mode:04o}; it holds a token and must be 0600",
                hint="write it with agent.kubeadm.write_join_config",
            )
        argv = [kubeadm, "join", "--config", str(config_path)]
        log.info("running kubeadm join (API server from the join configuration)")
        try:
            result = run(argv, timeout=timeout, check=False)
        except CommandError as exc:
            if exc.failure is Failure.MISSING:
                hint = f"is {kubeadm} installed in the image?"
            elif exc.failure is Failure.NOT_RUNNABLE:
                hint = f"{kubeadm} must be an executable file on a file system not mounted noexec"
            else:  # it ran and was killed at the timeout: it may have left a partial join
                raise KubeadmFailedError(
                    redact(exc.message, *secrets),
                    hint="kubeadm hung (a stuck image pull or kubelet?): see `journalctl -u nodeagent -u kubelet`; "
                    "the agent runs `kubeadm reset -f` before it tries again",
                    failure=KubeadmFailure(status=-9, phase=None, error="timed out"),
                ) from exc
            raise KubeadmError(redact(exc.message, *secrets), hint=hint) from exc  # it never ran
        output = redact(result.stdout + "\n" + result.stderr, *secrets)
        if result.returncode != 0:
            log.warning("kubeadm join failed (exit %d); its output:\n%s", result.returncode, output.strip())
            failure = parse_failure(result.returncode, output)
            said = failure.error or _tail(output) or "no output"
            where = f" in phase {failure.phase}" if failure.phase else ""
            raise KubeadmFailedError(
                f"kubeadm join exited with status {result.returncode}{where}: {said}",
                hint=failure_hint(failure, cri_socket=_cri_socket_of(config_path)),
                failure=failure,
            )
        log.info("kubeadm join succeeded")
        log.debug("kubeadm output:\n%s", output)
    except FileNotFoundError as exc:
        raise KubeadmError(
            f"the join configuration {config_path} does not exist",
            hint="write it with write_join_config first",
        ) from exc
    finally:
        try:
            config_path.unlink(missing_ok=True)
        except OSError as exc:  # pragma: no cover - root on a read-only /run
            log.error("could not remove the join configuration %s: %s", config_path, exc.strerror)
