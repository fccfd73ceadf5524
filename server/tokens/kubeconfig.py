"""Read a kubeconfig into what an HTTPS client needs, failing closed.

Public API::

    @dataclass(frozen=True)
    class ClusterAccess:
        server: str                # https://host:port[/prefix], no trailing slash
        context: str
        user: str                  # the kubeconfig user entry's name (not a Kubernetes identity)
        ca_pem: bytes | None       # None: the system trust store
        tls_server_name: str | None
        client_cert_pem: bytes | None
        client_key_pem: bytes | None
        token: str | None          # a static bearer token
        token_file: Path | None    # re-read on every request (projected ServiceAccount tokens rotate)
        exec_plugin: ExecPlugin | None   # an exec credential plugin (EKS, GKE, AKS...)
        source: Path
        bearer() -> str | None
        client_pair() -> tuple[bytes, bytes] | None   # (certificate PEM, key PEM) to present
        credentials() -> (bearer, client_pair)          # both at once: the plugin runs at most once
        refresh() -> None          # the API server refused the credential: ask the plugin again

    load_kubeconfig(path: Path, *, context: str | None = None) -> ClusterAccess

The kubeconfig is loaded with lightkube's loader (``lightkube.config.kubeconfig``: the named lists,
the context, the typed cluster and user entries, relative paths), after a strict check of the raw
document, because lightkube drops the fields it does not model. Supported:
``clusters[].cluster.{server, certificate-authority, certificate-authority-data, tls-server-name}``,
``users[].user.{token, tokenFile, client-certificate, client-key, client-certificate-data,
client-key-data, exec}``, ``contexts[].context.{cluster, user}`` and ``current-context``. Relative file
paths (and a relative ``exec.command`` with a ``/``) are relative to the kubeconfig's folder, as
kubectl reads them. ``exec`` runs a ``client.authentication.k8s.io/v1`` or ``v1beta1`` credential
plugin (:mod:`server.tokens.execcred`). Refused with a :class:`ConfigError` naming the field:
``insecure-skip-tls-verify: true`` (never turned into an unverified connection), ``proxy-url``,
``auth-provider`` plugins, basic auth, impersonation, an interactive-only exec plugin, and an
``http://`` server.
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import User
from lightkube.core.exceptions import ConfigError as LightkubeConfigError

from server.errors import ConfigError
from server.tokens.execcred import CredentialCache, ExecPlugin, cluster_info, parse_exec

MAX_KUBECONFIG_BYTES = 1024 * 1024

_REFUSED_USER_FIELDS = {
    "auth-provider": "auth-provider plugins are not supported; use a ServiceAccount token or a client certificate",
    "username": "basic authentication was removed from Kubernetes; use a token or a client certificate",
    "password": "basic authentication was removed from Kubernetes; use a token or a client certificate",
    "as": "impersonation is not supported; give the nodeserver its own identity",
    "as-groups": "impersonation is not supported; give the nodeserver its own identity",
    "as-uid": "impersonation is not supported; give the nodeserver its own identity",
}
_USER_FIELDS = {
    "token",
    "tokenFile",
    "client-certificate",
    "client-key",
    "client-certificate-data",
    "client-key-data",
    "exec",
    *_REFUSED_USER_FIELDS,
    "as-user-extra",
    "extensions",
}
_CLUSTER_FIELDS = {
    "server",
    "certificate-authority",
    "certificate-authority-data",
    "insecure-skip-tls-verify",
    "tls-server-name",
    "proxy-url",
    "disable-compression",
    "extensions",
}


@dataclass(frozen=True)
class ClusterAccess:
    server: str
    context: str
    user: str
    source: Path
    ca_pem: bytes | None = None
    tls_server_name: str | None = None
    client_cert_pem: bytes | None = field(default=None, repr=False)
    client_key_pem: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    exec_plugin: ExecPlugin | None = None
    _credentials: CredentialCache | None = field(default=None, repr=False, compare=False)

    def bearer(self) -> str | None:
        """The bearer token to send: the exec plugin's (cached until it expires), ``token_file``'s
        (read fresh), or the static token."""
        if self._credentials is not None:
            return self._credentials.get().token
        if self.token_file is not None:
            try:
                value = self.token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(
                    f"{self.source}: users[{self.user}].user.tokenFile {self.token_file}: "
                    f"cannot read it ({exc.strerror})"
                ) from exc
            if not value:
                raise ConfigError(
                    f"{self.source}: users[{self.user}].user.tokenFile {self.token_file} is empty"
                )
            return value
        return self.token

    def credentials(self) -> tuple[str | None, tuple[bytes, bytes] | None]:
        """(bearer token, client certificate and key) for one request, the exec plugin run at most once."""
        if self._credentials is not None:
            credential = self._credentials.get()
            pair = None
            if credential.client_cert_pem is not None and credential.client_key_pem is not None:
                pair = (credential.client_cert_pem, credential.client_key_pem)
            return credential.token, pair
        return self.bearer(), self.client_pair()

    def client_pair(self) -> tuple[bytes, bytes] | None:
        """The client certificate and key to present (the exec plugin's, or the kubeconfig's), or None."""
        if self._credentials is not None:
            credential = self._credentials.get()
            if credential.client_cert_pem is not None and credential.client_key_pem is not None:
                return credential.client_cert_pem, credential.client_key_pem
            return None
        if self.client_cert_pem is not None and self.client_key_pem is not None:
            return self.client_cert_pem, self.client_key_pem
        return None

    def refresh(self) -> bool:
        """The API server refused the credential: True if asking again can help (an exec plugin)."""
        if self._credentials is None:
            return False
        self._credentials.invalidate()
        return True


def _named(doc: dict[str, Any], section: str, inner: str, name: str, where: str) -> dict[str, Any]:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: {section} must be a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(inner)
            if not isinstance(body, dict):
                raise ConfigError(f"{where}: {section}[{name}].{inner} must be a mapping")
            return body
    known = ", ".join(str(e.get("name")) for e in entries if isinstance(e, dict)) or "none"
    raise ConfigError(f"{where}: no {section[:-1]} named {name!r} (known: {known})")


def _string(body: dict[str, Any], key: str, where: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{key}: expected a non-empty string")
    return value


def _b64(value: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{where}: not valid base64") from exc


def _read(path_text: str, base: Path, where: str) -> bytes:
    path = Path(path_text)
    if not path.is_absolute():
        path = base / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path} ({exc.strerror})") from exc


def _pem_or_file(body: dict[str, Any], key: str, base: Path, where: str) -> bytes | None:
    data, path = _string(body, f"{key}-data", where), _string(body, key, where)
    if data and path:
        raise ConfigError(f"{where}: give {key} or {key}-data, not both")
    if data:
        return _b64(data, f"{where}.{key}-data")
    if path:
        return _read(path, base, f"{where}.{key}")
    return None


def load_kubeconfig(path: Path, *, context: str | None = None) -> ClusterAccess:
    """Parse ``path`` and resolve ``context`` (default: its ``current-context``)."""
    where = str(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_KUBECONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"kubeconfig {path}: cannot read it ({exc.strerror})") from exc
    if len(raw) > MAX_KUBECONFIG_BYTES:
        raise ConfigError(
            f"kubeconfig {path}: larger than {MAX_KUBECONFIG_BYTES} bytes; is it a kubeconfig?"
        )
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"kubeconfig {path}: not UTF-8 text") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"kubeconfig {path}: not valid YAML ({exc})") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"kubeconfig {path}: expected a YAML mapping (apiVersion: v1, kind: Config)")
    if doc.get("kind", "Config") != "Config":
        raise ConfigError(f"kubeconfig {path}: kind must be Config, got {doc.get('kind')!r}")
    ctx_name = context or doc.get("current-context")
    if not isinstance(ctx_name, str) or not ctx_name:
        raise ConfigError(
            f"kubeconfig {path}: no current-context; set token_backend.context or current-context"
        )
    # The raw entries first: lightkube's models drop what they do not know, so unknown and refused
    # fields are checked here, with messages that name them.
    ctx = _named(doc, "contexts", "context", ctx_name, where)
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise ConfigError(f"{where}: contexts[{ctx_name}].context.cluster is missing")
    if not isinstance(user_name, str) or not user_name:
        raise ConfigError(
            f"{where}: contexts[{ctx_name}].context.user is missing; the nodeserver needs credentials"
        )
    cluster = _named(doc, "clusters", "cluster", cluster_name, where)
    user = _named(doc, "users", "user", user_name, where)
    cwhere, uwhere = f"{where}: clusters[{cluster_name}].cluster", f"{where}: users[{user_name}].user"
    _check_cluster(cluster, cwhere)
    _check_user(user, uwhere)
    base = path.parent
    plugin: ExecPlugin | None = None
    if user.get("exec") is not None:
        plugin = parse_exec(
            user["exec"], where=f"{uwhere}.exec", resolve=lambda c: _command(c, base, uwhere)
        )
    # Only the entries in use go to lightkube: a broken entry of another context does not matter.
    selected = {
        "clusters": [{"name": cluster_name, "cluster": cluster}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": ctx_name, "context": ctx}],
    }
    loaded = _lightkube(selected, path, ctx_name)
    server = loaded.cluster.server
    tls_server_name = _string(cluster, "tls-server-name", cwhere)
    ca_pem = _pem_or_file(cluster, "certificate-authority", base, cwhere)
    lk_user = loaded.user or User()
    cert = _pem_or_file(user, "client-certificate", base, uwhere)
    key_pem = _pem_or_file(user, "client-key", base, uwhere)
    if (cert is None) != (key_pem is None):
        raise ConfigError(
            f"{uwhere}: a client certificate needs both client-certificate(-data) and client-key(-data)"
        )
    token = lk_user.token
    token_file = Path(str(loaded.abs_file(lk_user.token_file))) if lk_user.token_file else None
    if token and token_file:
        raise ConfigError(f"{uwhere}: give token or tokenFile, not both")
    if plugin is not None and (token or token_file or cert is not None):
        raise ConfigError(
            f"{uwhere}: exec gives the credentials; remove token, tokenFile and client-certificate"
        )
    if cert is None and token is None and token_file is None and plugin is None:
        raise ConfigError(
            f"{uwhere}: no credentials: set token, tokenFile, exec, or client-certificate(-data) with "
            "client-key(-data)"
        )
    credentials = None
    if plugin is not None:
        info = cluster_info(server.rstrip("/"), tls_server_name, ca_pem, cluster.get("extensions"))
        credentials = CredentialCache(plugin, info)
    access = ClusterAccess(
        server=server.rstrip("/"),
        context=ctx_name,
        user=user_name,
        source=path,
        ca_pem=ca_pem,
        tls_server_name=tls_server_name,
        client_cert_pem=cert,
        client_key_pem=key_pem,
        token=token,
        token_file=token_file,
        exec_plugin=plugin,
        _credentials=credentials,
    )
    if token_file is not None:
        access.bearer()  # fail at start if it cannot be read
    return access


def _check_cluster(cluster: dict[str, Any], cwhere: str) -> None:
    unknown = sorted(set(cluster) - _CLUSTER_FIELDS)
    if unknown:
        raise ConfigError(f"{cwhere}: unknown field(s) {', '.join(unknown)}")
    if cluster.get("insecure-skip-tls-verify") not in (None, False):
        raise ConfigError(
            f"{cwhere}.insecure-skip-tls-verify: refused: the nodeserver hands out join credentials and "
            "never talks to an API server it cannot verify; set certificate-authority-data to the cluster CA"
        )
    if cluster.get("proxy-url"):
        raise ConfigError(
            f"{cwhere}.proxy-url: proxies are not supported; the API server must be reachable directly"
        )
    server = _string(cluster, "server", cwhere)
    if server is None:
        raise ConfigError(f"{cwhere}.server is missing (e.g. https://10.0.0.10:6443)")
    parts = urlsplit(server)
    if parts.scheme != "https" or not parts.hostname:
        raise ConfigError(f"{cwhere}.server: expected an https:// URL, got {server!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ConfigError(f"{cwhere}.server: bad port in {server!r}") from exc
    if parts.query or parts.fragment or parts.username:
        raise ConfigError(f"{cwhere}.server: expected https://host:port[/path], got {server!r}")


def _check_user(user: dict[str, Any], uwhere: str) -> None:
    unknown = sorted(set(user) - _USER_FIELDS)
    if unknown:
        raise ConfigError(f"{uwhere}: unknown field(s) {', '.join(unknown)}")
    for key, why in _REFUSED_USER_FIELDS.items():
        if user.get(key):
            raise ConfigError(f"{uwhere}.{key}: {why}")
    for key in ("token", "tokenFile"):
        _string(user, key, uwhere)


def _lightkube(doc: dict[str, Any], path: Path, ctx_name: str) -> SingleConfig:
    """The context resolved by lightkube's loader (the raw document was checked before)."""
    try:
        loaded = KubeConfig.from_dict(doc, fname=path).get(ctx_name)
    except (
        LightkubeConfigError,
        KeyError,
        TypeError,
        ValueError,
    ) as exc:  # msgspec's errors are ValueErrors
        raise ConfigError(f"kubeconfig {path}: cannot be loaded ({exc})") from None
    if loaded is None:  # pragma: no cover - get() with a context name never returns the default
        raise ConfigError(f"kubeconfig {path}: no context {ctx_name!r}")
    return loaded


def _command(command: str, base: Path, uwhere: str) -> str:
    """A relative path with a slash is relative to the kubeconfig's folder; a bare name is looked up
    on PATH now, so a missing plugin is a configuration error at start, not a failed join later."""
    if "/" in command:
        resolved = Path(command) if Path(command).is_absolute() else base / command
        if not (resolved.is_file() and os.access(resolved, os.X_OK)):
            raise ConfigError(f"{uwhere}.exec.command: {resolved} is not an executable file")
        return str(resolved)
    found = shutil.which(command)
    if found is None:
        raise ConfigError(
            f"{uwhere}.exec.command: {command!r} is not on the nodeserver's PATH; install the plugin "
            "(see the kubeconfig's installHint) or give its absolute path"
        )
    return found
