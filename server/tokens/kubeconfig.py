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
        source: Path
        bearer() -> str | None

    load_kubeconfig(path: Path, *, context: str | None = None) -> ClusterAccess

Supported: ``clusters[].cluster.{server, certificate-authority, certificate-authority-data,
tls-server-name}``, ``users[].user.{token, tokenFile, client-certificate, client-key,
client-certificate-data, client-key-data}``, ``contexts[].context.{cluster, user}``
and ``current-context``. Relative file paths are relative to the kubeconfig's folder,
as kubectl reads them. Refused with a :class:`ConfigError` naming the field:
``insecure-skip-tls-verify: true`` (never turned into an unverified connection),
``proxy-url``, ``exec`` and ``auth-provider`` plugins, basic auth, and an ``http://`` server.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from server.errors import ConfigError

_REFUSED_USER_FIELDS = {
    "exec": "exec credential plugins are not supported; give the nodeserver a ServiceAccount token "
    "(token or tokenFile) or a client certificate",
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

    def bearer(self) -> str | None:
        """The bearer token to send, read fresh from ``token_file`` when one is configured."""
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
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"kubeconfig {path}: cannot read it ({exc.strerror})") from exc
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
    base = path.parent
    cwhere, uwhere = f"{where}: clusters[{cluster_name}].cluster", f"{where}: users[{user_name}].user"

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

    unknown = sorted(set(user) - _USER_FIELDS)
    if unknown:
        raise ConfigError(f"{uwhere}: unknown field(s) {', '.join(unknown)}")
    for key, why in _REFUSED_USER_FIELDS.items():
        if user.get(key):
            raise ConfigError(f"{uwhere}.{key}: {why}")
    cert = _pem_or_file(user, "client-certificate", base, uwhere)
    key_pem = _pem_or_file(user, "client-key", base, uwhere)
    if (cert is None) != (key_pem is None):
        raise ConfigError(
            f"{uwhere}: a client certificate needs both client-certificate(-data) and client-key(-data)"
        )
    token = _string(user, "token", uwhere)
    token_file_text = _string(user, "tokenFile", uwhere)
    token_file = None
    if token_file_text:
        token_file = Path(token_file_text)
        if not token_file.is_absolute():
            token_file = base / token_file
    if token and token_file:
        raise ConfigError(f"{uwhere}: give token or tokenFile, not both")
    if cert is None and token is None and token_file is None:
        raise ConfigError(
            f"{uwhere}: no credentials: set token, tokenFile, or client-certificate(-data) with client-key(-data)"
        )
    access = ClusterAccess(
        server=server.rstrip("/"),
        context=ctx_name,
        user=user_name,
        source=path,
        ca_pem=_pem_or_file(cluster, "certificate-authority", base, cwhere),
        tls_server_name=_string(cluster, "tls-server-name", cwhere),
        client_cert_pem=cert,
        client_key_pem=key_pem,
        token=token,
        token_file=token_file,
    )
    if token_file is not None:
        access.bearer()  # fail at start if it cannot be read
    return access
