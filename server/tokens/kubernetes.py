"""The Kubernetes token backend: bootstrap-token Secrets through the API server, over plain HTTPS.

Public API::

    class KubernetesBackend:            # satisfies server.tokens.backend.TokenBackend
        name = "kubernetes"
        def __init__(self, access: ClusterAccess, *, timeout: float = 10.0) -> None
        @classmethod
        def from_kubeconfig(cls, path: Path, *, context: str | None = None,
                            timeout: float = 10.0) -> KubernetesBackend
        def check(self) -> None             # SelfSubjectAccessReview: create and delete secrets in kube-system
        def create(self, token: BootstrapToken) -> str   # "kube-system/bootstrap-token-<id>"
        def delete(self, token_id: str, backend_ref: str) -> None   # 404 = already gone

Every failure is a :class:`TokenBackendError` (a duplicate name: :class:`TokenConflictError`)
whose message names the fix. The request body and the token secret are never
logged, and every message built from an API server answer is passed through
:func:`server.tokens.token.redact`.

Credentials: a static or file token, a client certificate, or an exec credential plugin's token or
client certificate (run when needed, cached until it expires, asked again once when the API server
answers 401).

TLS: the cluster CA from the kubeconfig (or the system store when none is given),
host name checked, TLS 1.2 at least. A client key from ``client-key-data`` is handed
to OpenSSL through an anonymous memory file (``memfd``) when the kernel has one,
otherwise through a 0600 file in a 0700 temporary folder; either is gone before
the constructor returns.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from server.errors import ConfigError, TokenBackendError, TokenConflictError
from server.tokens.kubeconfig import ClusterAccess, load_kubeconfig
from server.tokens.token import NAMESPACE, BootstrapToken, redact, secret_manifest, secret_name

log = logging.getLogger(__name__)

_MAX_RESPONSE = 1 << 20
_SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
_SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_USER_AGENT = "nodeserver (nodetrust token backend)"
_RBAC_HINT = "see docs/join-backends.md for a minimal Role and RoleBinding"


@contextlib.contextmanager
def _key_material_path(pem: bytes) -> Iterator[str]:
    """A path OpenSSL can read ``pem`` from, removed when the block ends."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("nodeserver-kube-client", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    folder = tempfile.mkdtemp(prefix="nodeserver-kube-")  # 0700
    path = os.path.join(folder, "client.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(folder)


def _ssl_context(access: ClusterAccess, pair: tuple[bytes, bytes] | None) -> ssl.SSLContext:
    where = f"kubeconfig {access.source}"
    try:
        cadata = access.ca_pem.decode("ascii") if access.ca_pem is not None else None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=cadata)
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"{where}: certificate-authority of cluster for context {access.context} is not a PEM certificate"
        ) from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if pair is not None:
        with _key_material_path(pair[0] + b"\n" + pair[1]) as path:
            try:
                ctx.load_cert_chain(path, password=lambda: b"")
            except ssl.SSLError as exc:
                source = "the exec plugin's" if access.exec_plugin is not None else "the"
                raise ConfigError(
                    f"{where}: users[{access.user}]: {source} client certificate and key are not PEM, do not "
                    "match, or the key is encrypted"
                ) from exc
    return ctx


class _Connection(http.client.HTTPSConnection):
    """An HTTPS connection that may check the certificate against another name (``tls-server-name``)."""

    def __init__(
        self, host: str, port: int, *, timeout: float, context: ssl.SSLContext, server_hostname: str
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls = context
        self._server_hostname = server_hostname

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_hostname)


def _status_message(payload: Any, raw: bytes) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])[:500]
    text = raw[:200].decode("utf-8", "replace").strip()
    return text or "no message"


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, access: ClusterAccess, *, timeout: float = 10.0) -> None:
        if timeout <= 0:
            raise ConfigError("token_backend.timeout: must be positive")
        self.access = access
        self.timeout = float(timeout)
        parts = urlsplit(access.server)
        self._host = parts.hostname or ""
        self._port = parts.port or 443
        self._prefix = parts.path.rstrip("/")
        self._server_hostname = access.tls_server_name or self._host
        # An exec plugin's client certificate is known only once the plugin ran (first request).
        self._pair = access.client_pair() if access.exec_plugin is None else None
        self._context = _ssl_context(access, self._pair)
        self._context_lock = threading.Lock()

    @classmethod
    def from_kubeconfig(
        cls, path: Path, *, context: str | None = None, timeout: float = 10.0
    ) -> KubernetesBackend:
        return cls(load_kubeconfig(path, context=context), timeout=timeout)

    def __repr__(self) -> str:
        return f"KubernetesBackend(server={self.access.server!r}, context={self.access.context!r})"

    # -- HTTP ---------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any, bytes]:
        status, payload, raw = self._send(method, path, body)
        if status == 401 and self.access.refresh():
            log.info("the API server refused the exec plugin's credential; asking the plugin again")
            status, payload, raw = self._send(method, path, body)
        return status, payload, raw

    def _tls(self, pair: tuple[bytes, bytes] | None) -> ssl.SSLContext:
        if self.access.exec_plugin is None:
            return self._context
        with self._context_lock:
            if pair != self._pair:
                self._context = _ssl_context(self.access, pair)
                self._pair = pair
            return self._context

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any, bytes]:
        headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        bearer, pair = self.access.credentials()
        context = self._tls(pair)
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
        server = self.access.server
        conn = _Connection(
            self._host,
            self._port,
            timeout=self.timeout,
            context=context,
            server_hostname=self._server_hostname,
        )
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(_MAX_RESPONSE)
            status = resp.status
        except ssl.SSLCertVerificationError as exc:
            raise TokenBackendError(
                f"TLS verification of {server} failed ({exc.verify_message}): the certificate-authority(-data) "
                f"in {self.access.source} must be the CA that signed the API server's certificate"
                + (", and tls-server-name one of its names" if self.access.tls_server_name else "")
            ) from exc
        except ssl.SSLError as exc:
            raise TokenBackendError(
                f"TLS handshake with {server} failed ({exc.reason or exc}): check that the client certificate "
                f"in {self.access.source} is signed by the cluster's client CA"
            ) from exc
        except TimeoutError as exc:
            raise TokenBackendError(
                f"the API server {server} did not answer {method} within {self.timeout:g} s; it may be "
                "overloaded or unreachable (token_backend.timeout sets the limit)"
            ) from exc
        except ConnectionRefusedError as exc:
            raise TokenBackendError(
                f"cannot connect to {server}: connection refused; is clusters[].cluster.server in "
                f"{self.access.source} the API server's address, and is it running?"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise TokenBackendError(f"cannot reach the API server {server}: {why}") from exc
        finally:
            conn.close()
        log.debug("%s %s -> %d", method, path, status)
        payload: Any = None
        if raw:
            with contextlib.suppress(ValueError):
                payload = json.loads(raw)
        return status, payload, raw

    def _fail(
        self, status: int, payload: Any, raw: bytes, *, action: str, token: BootstrapToken | None
    ) -> None:
        said = _status_message(payload, raw)
        user = f"kubeconfig user {self.access.user} in {self.access.source}"
        message: str
        if status == 401:
            message = (
                f"401 Unauthorized: the API server {self.access.server} did not accept the credentials of {user}; "
                "the token or client certificate is wrong, expired or from another cluster"
            )
        elif status == 403 and not _names_a_resource(payload):
            # RBAC refused a path that is no API resource (details has no kind): the URL is wrong, not the Role.
            message = (
                f"403 Forbidden while trying to {action}: the API server refused the path itself, so "
                f"clusters[].cluster.server in {self.access.source} ({self.access.server}) is not the API "
                f"server's URL, or its path prefix is wrong; the API server said: {said}"
            )
        elif status == 403:
            message = (
                "403 Forbidden: the nodeserver identity needs create/delete on secrets in kube-system "
                f"({user}; {_RBAC_HINT}); the API server said: {said}"
            )
        elif status == 409:
            raise TokenConflictError(
                redact(
                    f"409 Conflict while trying to {action}: {said}; mint a new token and retry", *_t(token)
                )
            )
        elif status == 422:
            message = f"422 Unprocessable Entity: the API server refused to {action}: {said}"
        elif status == 429:
            message = (
                f"429 Too Many Requests: the API server is throttling while trying to {action}; retry later"
            )
        elif status >= 500:
            message = (
                f"{status} from the API server while trying to {action}: {said}; "
                "the API server (or its etcd) is unhealthy, retry later"
            )
        elif status == 404:
            message = (
                f"404 Not Found while trying to {action}: is {self.access.server} a Kubernetes API server "
                f"(and its path prefix right)? The API server said: {said}"
            )
        else:
            message = f"unexpected HTTP {status} while trying to {action}: {said}"
        raise TokenBackendError(redact(message, *_t(token)))

    # -- TokenBackend ---------------------------------------------------------
    def check(self) -> None:
        missing = []
        for verb in ("create", "delete"):
            review = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {
                    "resourceAttributes": {
                        "namespace": NAMESPACE,
                        "verb": verb,
                        "group": "",
                        "resource": "secrets",
                    }
                },
            }
            status, payload, raw = self._request("POST", _SSAR, review)
            if status not in (200, 201):
                self._fail(
                    status, payload, raw, action=f"review its own permission to {verb} secrets", token=None
                )
            answer = payload.get("status") if isinstance(payload, dict) else None
            if not isinstance(answer, dict):
                raise TokenBackendError(
                    f"the API server {self.access.server} answered a SelfSubjectAccessReview oddly"
                )
            if answer.get("allowed") is not True:
                missing.append(verb)
        if missing:
            raise TokenBackendError(
                "403 Forbidden: the nodeserver identity needs create/delete on secrets in kube-system; "
                f"kubeconfig user {self.access.user} in {self.access.source} may not {' or '.join(missing)} "
                f"them ({_RBAC_HINT})"
            )
        log.info(
            "token backend kubernetes: %s (context %s) reachable; may create and delete secrets in %s",
            self.access.server,
            self.access.context,
            NAMESPACE,
        )

    def create(self, token: BootstrapToken) -> str:
        status, payload, raw = self._request("POST", _SECRETS, secret_manifest(token))
        if status not in (200, 201):
            self._fail(
                status, payload, raw, action=f"create Secret {NAMESPACE}/{token.secret_name}", token=token
            )
        log.info("created bootstrap token %s as Secret %s/%s", token.token_id, NAMESPACE, token.secret_name)
        return f"{NAMESPACE}/{token.secret_name}"

    def delete(self, token_id: str, backend_ref: str) -> None:
        try:
            name = secret_name(token_id)
        except ValueError as exc:
            raise TokenBackendError(f"cannot delete a token with a malformed id {token_id!r}") from exc
        if backend_ref and backend_ref != f"{NAMESPACE}/{name}":
            log.warning(
                "token %s: backend_ref %r does not name %s/%s; deleting the latter",
                token_id,
                backend_ref,
                NAMESPACE,
                name,
            )
        status, payload, raw = self._request("DELETE", f"{_SECRETS}/{name}", None)
        if status == 404:
            log.debug("bootstrap token %s was already gone", token_id)
            return
        if status not in (200, 202):
            self._fail(status, payload, raw, action=f"delete Secret {NAMESPACE}/{name}", token=None)
        log.info("deleted bootstrap token %s (Secret %s/%s)", token_id, NAMESPACE, name)


def _names_a_resource(payload: Any) -> bool:
    """A ``v1/Status`` about an API resource: its ``details.kind`` is set (``secrets``); a refused path has none."""
    details = payload.get("details") if isinstance(payload, dict) else None
    return isinstance(details, dict) and isinstance(details.get("kind"), str) and bool(details["kind"])


def _t(token: BootstrapToken | None) -> tuple[BootstrapToken, ...]:
    return (token,) if token is not None else ()
