"""Kubernetes exec credential plugins (``users[].user.exec``): the server package's subprocess chokepoint.

Every managed cluster hands out credentials this way (``aws eks get-token``, ``gke-gcloud-auth-plugin``,
``kubelogin``). The protocol is client-go's (``client.authentication.k8s.io/v1`` and ``v1beta1``): the
plugin runs with the server's environment plus the kubeconfig's ``env`` and ``KUBERNETES_EXEC_INFO`` (an
``ExecCredential`` whose ``spec`` says the session is not interactive and, with ``provideClusterInfo``,
describes the cluster), and prints an ``ExecCredential`` whose ``status`` holds a bearer ``token`` or a
``clientCertificateData``/``clientKeyData`` pair, and optionally an ``expirationTimestamp``.

:func:`run_plugin` is the only place in ``server`` that starts a process: no shell, standard input
closed, its own process group, a time limit and a bound on what it may print (both enforced by
killing the group). The credential is never logged and never part of an exception message; the
plugin's standard error is quoted (bounded) when it fails, as kubectl shows it.

Public API::

    @dataclass(frozen=True)
    class ExecPlugin:                       # the kubeconfig's exec block, validated
        api_version, command, args, env, install_hint, provide_cluster_info, interactive_mode
    @dataclass(frozen=True)
    class ExecCredential:                   # what the plugin answered (repr hides the secrets)
        token, client_cert_pem, client_key_pem, expires_at
    class CredentialCache:                  # runs the plugin when there is no valid credential
        get() -> ExecCredential; invalidate() -> None
    run_plugin(argv, *, env, timeout_s, limit) -> bytes
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from server.errors import ConfigError, TokenBackendError

log = logging.getLogger(__name__)

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
EXEC_TIMEOUT_S = 30.0  # aws, gcloud and kubelogin answer in a second or two; a hung plugin is killed
MAX_OUTPUT_BYTES = 256 * 1024  # an ExecCredential is a few KB even with a certificate chain
_STDERR_SHOWN = 400
_EXPIRY_MARGIN_S = 10.0  # refresh a little before the plugin's own expiry, as client-go does


@dataclass(frozen=True)
class ExecPlugin:
    api_version: str
    command: str  # absolute, or a name looked up on PATH
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # may carry secrets
    install_hint: str = ""
    provide_cluster_info: bool = False
    interactive_mode: str = "IfAvailable"
    where: str = ""  # "<kubeconfig>: users[<name>].user.exec", for messages


@dataclass(frozen=True)
class ExecCredential:
    token: str | None = field(default=None, repr=False)
    client_cert_pem: bytes | None = field(default=None, repr=False)
    client_key_pem: bytes | None = field(default=None, repr=False)
    expires_at: float | None = None  # POSIX time; None: until the API server refuses it

    def valid(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at - _EXPIRY_MARGIN_S


def run_plugin(argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float, limit: int) -> bytes:
    """Run ``argv`` (no shell, stdin closed) and return its standard output.

    Raises TokenBackendError when it cannot start, runs longer than ``timeout_s``, prints more than
    ``limit`` bytes on either stream, or exits non-zero (quoting the end of its standard error).
    """
    what = argv[0]
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        raise TokenBackendError(f"exec credential plugin {what} cannot be started: {exc.strerror}") from None
    streams: dict[int, bytearray] = {}
    try:
        streams = _collect(proc, timeout_s, limit, what)
        code = proc.wait(timeout=max(0.1, timeout_s))
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise TokenBackendError(
            f"exec credential plugin {what} did not finish within {timeout_s:g} s and was stopped"
        ) from None
    except BaseException:
        _kill(proc)
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    out, err = bytes(streams.get(1, b"")), bytes(streams.get(2, b""))
    if code != 0:
        said = err.decode("utf-8", "replace").strip()[-_STDERR_SHOWN:] or "nothing on standard error"
        raise TokenBackendError(f"exec credential plugin {what} exited with status {code}: {said}")
    return out


def _collect(proc: subprocess.Popen[bytes], timeout_s: float, limit: int, what: str) -> dict[int, bytearray]:
    assert proc.stdout is not None and proc.stderr is not None  # noqa: S101 - both are pipes
    deadline = time.monotonic() + timeout_s
    buffers = {1: bytearray(), 2: bytearray()}
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, 1)
        selector.register(proc.stderr, selectors.EVENT_READ, 2)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(what, timeout_s)
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.data]
                if len(buffer) + len(chunk) > limit:
                    _kill(proc)
                    stream = "standard output" if key.data == 1 else "standard error"
                    raise TokenBackendError(
                        f"exec credential plugin {what} printed more than {limit} bytes on {stream}; stopped"
                    )
                buffer += chunk
    return buffers


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def exec_info(plugin: ExecPlugin, cluster: Mapping[str, Any] | None) -> str:
    """``KUBERNETES_EXEC_INFO``: the ExecCredential the plugin reads (client-go's ``spec``)."""
    spec: dict[str, Any] = {"interactive": False}
    if plugin.provide_cluster_info and cluster is not None:
        spec["cluster"] = dict(cluster)
    return json.dumps({"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": spec})


def parse_credential(plugin: ExecPlugin, output: bytes) -> ExecCredential:
    """The plugin's ExecCredential; the messages never quote the output (it holds the secret)."""
    what = f"exec credential plugin {plugin.command}"
    try:
        doc = json.loads(output)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TokenBackendError(f"{what} did not print an ExecCredential (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("kind") != "ExecCredential":
        raise TokenBackendError(f"{what} did not print an ExecCredential (kind must be ExecCredential)")
    if doc.get("apiVersion") != plugin.api_version:
        raise TokenBackendError(
            f"{what} answered apiVersion {str(doc.get('apiVersion'))[:80]!r}, but the kubeconfig asked for "
            f"{plugin.api_version}"
        )
    status = doc.get("status")
    if not isinstance(status, dict):
        raise TokenBackendError(f"{what}: the ExecCredential has no status")
    token = status.get("token")
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if token is not None and (not isinstance(token, str) or not token or "\n" in token):
        raise TokenBackendError(f"{what}: status.token must be a non-empty one-line string")
    if (cert is None) != (key is None) or not all(isinstance(v, str) for v in (cert, key) if v is not None):
        raise TokenBackendError(f"{what}: status needs both clientCertificateData and clientKeyData (PEM)")
    if token is None and cert is None:
        raise TokenBackendError(f"{what}: status has neither a token nor a client certificate")
    expires_at: float | None = None
    stamp = status.get("expirationTimestamp")
    if stamp is not None:
        try:
            moment = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
        except ValueError:
            raise TokenBackendError(f"{what}: status.expirationTimestamp is not an RFC 3339 time") from None
        if moment.tzinfo is None:
            raise TokenBackendError(f"{what}: status.expirationTimestamp has no time zone")
        expires_at = moment.timestamp()
    return ExecCredential(
        token=token,
        client_cert_pem=cert.encode() if isinstance(cert, str) else None,
        client_key_pem=key.encode() if isinstance(key, str) else None,
        expires_at=expires_at,
    )


class CredentialCache:
    """The plugin's current credential: run again when it is about to expire or was refused."""

    def __init__(
        self,
        plugin: ExecPlugin,
        cluster: Mapping[str, Any] | None,
        *,
        timeout_s: float = EXEC_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.plugin = plugin
        self._cluster = dict(cluster) if cluster is not None else None
        self._timeout_s = timeout_s
        self._clock = clock
        self._environ = environ
        self._lock = threading.Lock()
        self._current: ExecCredential | None = None
        self.runs = 0

    def __repr__(self) -> str:
        return f"CredentialCache(command={self.plugin.command!r}, runs={self.runs})"

    def get(self) -> ExecCredential:
        with self._lock:
            current = self._current
            if current is not None and current.valid(self._clock()):
                return current
            current = self._run()
            self._current = current
            return current

    def invalidate(self) -> None:
        """Forget the credential (the API server answered 401); the next get() runs the plugin."""
        with self._lock:
            self._current = None

    def _run(self) -> ExecCredential:
        plugin = self.plugin
        env = dict(os.environ if self._environ is None else self._environ)
        env.update(plugin.env)
        env["KUBERNETES_EXEC_INFO"] = exec_info(plugin, self._cluster)
        self.runs += 1
        log.debug("running exec credential plugin %s (%s)", plugin.command, plugin.where)
        try:
            output = run_plugin(
                [plugin.command, *plugin.args], env=env, timeout_s=self._timeout_s, limit=MAX_OUTPUT_BYTES
            )
        except TokenBackendError as exc:
            hint = f" ({plugin.install_hint.strip()})" if plugin.install_hint.strip() else ""
            raise TokenBackendError(f"{plugin.where}: {exc.message}{hint}") from None
        credential = parse_credential(plugin, output)
        log.info(
            "exec credential plugin %s gave a %s%s",
            plugin.command,
            "token" if credential.token else "client certificate",
            f" valid until {datetime.fromtimestamp(credential.expires_at).isoformat()}"
            if credential.expires_at
            else "",
        )
        return credential


def parse_exec(raw: Any, *, where: str, resolve: Callable[[str], str]) -> ExecPlugin:
    """Validate a kubeconfig ``exec`` block; ``resolve`` makes a relative command path absolute."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    known = {"apiVersion", "command", "args", "env", "installHint", "provideClusterInfo", "interactiveMode"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    api_version = raw.get("apiVersion")
    if api_version not in API_VERSIONS:
        raise ConfigError(
            f"{where}.apiVersion: {api_version!r} is not supported; use one of {', '.join(API_VERSIONS)} "
            "(v1alpha1 was removed in Kubernetes 1.24)"
        )
    command = raw.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ConfigError(f"{where}.command is missing (the plugin to run, e.g. aws or kubelogin)")
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args must be a list of strings")
    env_entries = raw.get("env") or []
    env: list[tuple[str, str]] = []
    if not isinstance(env_entries, list):
        raise ConfigError(f"{where}.env must be a list of {{name, value}}")
    for entry in env_entries:
        if (
            not isinstance(entry, dict)
            or set(entry) != {"name", "value"}
            or not isinstance(entry["name"], str)
            or not entry["name"]
            or not isinstance(entry["value"], str)
        ):
            raise ConfigError(f"{where}.env: every entry must be {{name: <string>, value: <string>}}")
        env.append((entry["name"], entry["value"]))
    mode = raw.get("interactiveMode", "Never" if api_version.endswith("/v1beta1") else None)
    if mode not in INTERACTIVE_MODES:
        raise ConfigError(f"{where}.interactiveMode: expected one of {', '.join(INTERACTIVE_MODES)}")
    if mode == "Always":
        raise ConfigError(
            f"{where}.interactiveMode: Always needs a terminal, and the nodeserver has none; "
            "configure the plugin to run non-interactively (IfAvailable or Never)"
        )
    provide = raw.get("provideClusterInfo", False)
    if not isinstance(provide, bool):
        raise ConfigError(f"{where}.provideClusterInfo must be true or false")
    hint = raw.get("installHint") or ""
    if not isinstance(hint, str):
        raise ConfigError(f"{where}.installHint must be a string")
    return ExecPlugin(
        api_version=api_version,
        command=resolve(command),
        args=tuple(args),
        env=tuple(env),
        install_hint=hint,
        provide_cluster_info=provide,
        interactive_mode=mode,
        where=where,
    )


def cluster_info(
    server: str, tls_server_name: str | None, ca_pem: bytes | None, extensions: Any
) -> dict[str, Any]:
    """The ``spec.cluster`` of KUBERNETES_EXEC_INFO (client-go's Cluster type)."""
    info: dict[str, Any] = {"server": server}
    if tls_server_name:
        info["tls-server-name"] = tls_server_name
    if ca_pem is not None:
        info["certificate-authority-data"] = base64.b64encode(ca_pem).decode("ascii")
    if isinstance(extensions, list):
        for entry in extensions:
            if isinstance(entry, dict) and entry.get("name") == "client.authentication.k8s.io/exec":
                info["config"] = entry.get("extension")
    return info
