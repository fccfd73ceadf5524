"""KUBERNETES API SERVER TEST DOUBLE (recorded contract): a real HTTPS server on 127.0.0.1.

The token backend is tested against a real kube-apiserver v1.36.3 (tests/peers/, built by
``make peers``); this double stays for the faults a real server cannot be made to produce on
demand (5xx and 429 answers, an answer echoing the request body, no answer at all) and for the
exec-plugin tests. It speaks the part of the API the backend uses, with the answers (status codes
and ``v1/Status`` bodies) of a real kube-apiserver, except where noted:

* TLS with a certificate from a test CA; client certificates are verified when
  presented (``VerifyClientCertIfGiven``; a real kube-apiserver instead accepts the handshake and
  answers 401 for a certificate from another CA, and 403 rather than 404 for an unknown path prefix);
* authentication: a valid client certificate (user = CN, groups = O) or a known
  ``Authorization: Bearer`` token; otherwise ``401 Unauthorized``;
* authorization: ``grants`` maps a user to the verbs it may use on ``secrets``
  (``None``: everything); otherwise ``403 Forbidden`` with the apiserver's wording.
  ``SelfSubjectAccessReview`` answers from the same table;
* routes: ``POST /api/v1/namespaces/{ns}/secrets``, ``GET|DELETE .../secrets/{name}``,
  ``GET /api/v1/namespaces/{ns}``, ``POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews``,
  ``GET /version``; an unknown path is ``404``, a wrong verb ``405``;
* ``Content-Type`` must be ``application/json`` (``415``); a body that does not decode
  as a Secret (not an object, non-string ``stringData`` values) is ``400``;
  ``metadata.namespace`` must match the URL (``400``);
* a ``bootstrap.kubernetes.io/token`` Secret is checked as the bootstrap authenticator
  and token cleaner read it: name ``bootstrap-token-<token-id>``; ``token-id``
  ``[a-z0-9]{6}``; ``token-secret`` ``[a-z0-9]{16}``; ``expiration`` RFC 3339 and in
  the future; ``usage-bootstrap-authentication`` and ``usage-bootstrap-signing``
  exactly ``"true"``; each ``auth-extra-groups`` entry matches
  ``\\Asystem:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9]\\z``; ``description`` a string.
  Anything else is ``422 Invalid`` with ``details.causes``. (A real apiserver stores
  such a Secret and the authenticator silently ignores it; the double is stricter on
  purpose, because that silence is the failure worth catching.)
* ``409 AlreadyExists`` on a duplicate name, ``404 NotFound`` when deleting an unknown Secret;
* fault injection: :meth:`fail_next` (any status, optionally echoing the request body in
  the message, as a careless proxy would) and :meth:`hang_next` (no answer);
* every request is recorded in :attr:`calls` (method, path, content type, user, status, body).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import socket
import ssl
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.kube_api_contract import status_body, validate_token_secret
from tests.support.kube_pki import Issued

_SECRETS = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)/secrets(?:/([^/]+))?$")
_NAMESPACE = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)$")
_SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


@dataclass
class Call:
    method: str
    path: str
    content_type: str | None
    user: str | None
    status: int = 0
    body: Any = None
    groups: tuple[str, ...] = ()
    authorization: str | None = field(default=None, repr=False)


class _Reply(Exception):
    def __init__(self, code: int, body: dict[str, Any]) -> None:
        super().__init__(code)
        self.code = code
        self.body = body


def _fail(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> _Reply:
    return _Reply(code, status_body(code, reason, message, details))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()  # applies ``timeout`` to the connection
        conn = self.connection
        if isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()

    def _user(self) -> tuple[str | None, tuple[str, ...]]:
        double = self.server.double
        conn = self.connection
        if isinstance(conn, ssl.SSLSocket):
            peer = conn.getpeercert()
            if peer:
                cn, orgs = None, []
                for rdn in peer.get("subject", ()):
                    for attr in rdn:
                        key, value = attr[0], attr[1]
                        if key == "commonName":
                            cn = str(value)
                        elif key == "organizationName":
                            orgs.append(str(value))
                if cn:
                    return cn, tuple(orgs)
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            user = double.tokens.get(auth[len("Bearer ") :])
            if user:
                return user, ()
        return None, ()

    def _send(self, call: Call, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        call.status = code
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        double = self.server.double
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        user, groups = self._user()
        call = Call(
            method,
            self.path,
            self.headers.get("Content-Type"),
            user,
            groups=groups,
            authorization=self.headers.get("Authorization"),
        )
        if raw:
            try:
                call.body = json.loads(raw)
            except ValueError:
                call.body = raw.decode("utf-8", "replace")
        with double.lock:
            double.calls.append(call)
            hang = double._hangs.pop(0) if double._hangs else None
            failure = double._failures.pop(0) if double._failures and not hang else None
        if hang is not None:
            double._stopping.wait(hang)
            self.close_connection = True
            return
        try:
            if failure is not None:
                code, echo = failure
                message = "Internal error occurred" if code >= 500 else "injected failure"
                if echo:
                    message += f": could not store {raw.decode('utf-8', 'replace')}"
                raise _fail(code, "InternalError" if code >= 500 else "BadRequest", message)
            code, body = double._route(method, self.path, call.content_type, raw, user)
        except _Reply as reply:
            code, body = reply.code, reply.body
        self._send(call, code, body)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    double: KubeApiServerDouble

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        return self.double._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # aborted handshakes (wrong CA tests) are expected


class KubeApiServerDouble:
    """See the module docstring. Use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        serving: Issued,
        *,
        client_ca_pem: bytes | None = None,
        tokens: dict[str, str] | None = None,
        grants: dict[str, set[str]] | None = None,
    ) -> None:
        self.tokens = dict(tokens or {})
        self.grants = grants
        self.namespaces = {"default", "kube-system", "kube-public", "kube-node-lease"}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self._failures: list[tuple[int, bool]] = []
        self._hangs: list[float] = []
        self._stopping = threading.Event()
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as tmp:
            pem = Path(tmp) / "serving.pem"
            pem.write_bytes(serving.cert_pem + serving.key_pem)
            self._tls.load_cert_chain(pem)
        if client_ca_pem is not None:
            self._tls.load_verify_locations(cadata=client_ca_pem.decode())
            self._tls.verify_mode = ssl.CERT_OPTIONAL
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> KubeApiServerDouble:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.double = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> KubeApiServerDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # -- fault injection ------------------------------------------------------
    def fail_next(self, status: int = 500, *, count: int = 1, echo_body: bool = False) -> None:
        with self.lock:
            self._failures.extend([(status, echo_body)] * count)

    def hang_next(self, seconds: float = 30.0, *, count: int = 1) -> None:
        with self.lock:
            self._hangs.extend([seconds] * count)

    # -- the API --------------------------------------------------------------
    def _allowed(self, user: str, verb: str) -> bool:
        return self.grants is None or verb in self.grants.get(user, set())

    def _authorize(self, user: str, verb: str, ns: str, name: str | None = None) -> None:
        if not self._allowed(user, verb):
            raise _fail(
                403,
                "Forbidden",
                f'secrets{f" {json.dumps(name)}" if name else ""} is forbidden: User "{user}" cannot {verb} '
                f'resource "secrets" in API group "" in the namespace "{ns}"',
                {"name": name, "kind": "secrets"} if name else {"kind": "secrets"},
            )

    def _json_body(self, content_type: str | None, raw: bytes) -> dict[str, Any]:
        if (content_type or "").split(";")[0].strip() != "application/json":
            raise _fail(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: "
                f"application/json, application/yaml, application/vnd.kubernetes.protobuf (got {content_type!r})",
            )
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise _fail(400, "BadRequest", "the object provided is unrecognized (must be a JSON object)")
        return body

    def _route(
        self,
        method: str,
        path: str,
        ctype: str | None,
        raw: bytes,
        user: str | None,
    ) -> tuple[int, dict[str, Any]]:
        if path == "/version" and method == "GET":
            return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.4-nodetrust-test-double"}
        if user is None:
            raise _fail(401, "Unauthorized", "Unauthorized")
        if path == _SSAR:
            if method != "POST":
                raise _fail(405, "MethodNotAllowed", f"the server does not allow this method ({method})")
            review = self._json_body(ctype, raw)
            attrs = (review.get("spec") or {}).get("resourceAttributes") or {}
            allowed = attrs.get("resource") == "secrets" and self._allowed(user, str(attrs.get("verb")))
            review["status"] = {"allowed": allowed, **({} if allowed else {"reason": "no RBAC rule"})}
            return 201, review
        if m := _NAMESPACE.match(path):
            if method != "GET":
                raise _fail(405, "MethodNotAllowed", f"the server does not allow this method ({method})")
            if m.group(1) not in self.namespaces:
                raise _fail(404, "NotFound", f'namespaces "{m.group(1)}" not found', {"name": m.group(1)})
            return 200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": m.group(1)}}
        m = _SECRETS.match(path)
        if not m:
            raise _fail(404, "NotFound", "the server could not find the requested resource")
        ns, name = m.group(1), m.group(2)
        verb = {"POST": "create", "GET": "get", "DELETE": "delete"}.get(method)
        if verb is None or (verb == "create") == (name is not None):
            raise _fail(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        self._authorize(user, verb, ns, name)
        if ns not in self.namespaces:
            raise _fail(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        if verb == "create":
            return self._create(ns, self._json_body(ctype, raw))
        assert name is not None
        with self.lock:
            obj = self.secrets.get((ns, name)) if verb == "get" else self.secrets.pop((ns, name), None)
        if obj is None:
            raise _fail(404, "NotFound", f'secrets "{name}" not found', {"name": name, "kind": "secrets"})
        return 200, obj

    def _create(self, ns: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        meta = obj.get("metadata")
        if obj.get("apiVersion") != "v1" or obj.get("kind") != "Secret" or not isinstance(meta, dict):
            raise _fail(
                400, "BadRequest", "the API version in the data (or its kind) does not match the expected"
            )
        if meta.get("namespace", ns) != ns:
            raise _fail(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        string_data = obj.get("stringData") or {}
        if not isinstance(string_data, dict) or not all(isinstance(v, str) for v in string_data.values()):
            raise _fail(
                400,
                "BadRequest",
                "json: cannot unmarshal into Go struct field Secret.stringData of type string",
            )
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(
                422,
                "Invalid",
                "Secret is invalid: metadata.name: Required value",
                {"kind": "Secret", "causes": [{"reason": "FieldValueRequired", "field": "metadata.name"}]},
            )
        if obj.get("type") == "bootstrap.kubernetes.io/token":
            causes = validate_token_secret(name, obj, dt.datetime.now(dt.UTC))
            if causes:
                summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
                raise _fail(
                    422,
                    "Invalid",
                    f'Secret "{name}" is invalid: [{summary}]',
                    {"name": name, "kind": "Secret", "causes": causes},
                )
        data = {k: v for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64encode(v.encode()).decode() for k, v in string_data.items()})
        stored = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": obj.get("type", "Opaque"),
            "metadata": {
                **meta,
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "resourceVersion": str(len(self.calls)),
                "creationTimestamp": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            "data": data,
        }
        with self.lock:
            if (ns, name) in self.secrets:
                raise _fail(
                    409,
                    "AlreadyExists",
                    f'secrets "{name}" already exists',
                    {"name": name, "kind": "secrets"},
                )
            self.secrets[(ns, name)] = stored
        return 201, stored

    # -- for assertions -------------------------------------------------------
    def secret_data(self, name: str, ns: str = "kube-system") -> dict[str, str]:
        """The stored Secret's data, decoded."""
        obj = self.secrets[(ns, name)]
        return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}
