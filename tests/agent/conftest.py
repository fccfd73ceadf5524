"""Agent fixtures: a tiny gRPC server (grpc.aio, real TLS with SPIFFE SVIDs) that answers as the test says.

The agent's clients are tested against it rather than against nodeserver where the test needs a
server to answer something nodeserver does not (yet) send: a given status with given details,
a garbage trailer, a Join.ReportJoined answer. It is a real gRPC peer (grpcio, the server's
stack), over TLS with a server SVID issued by a real trust-domain CA, and for the Join service
it requires the agent's client certificate, as nodeserver does.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protocol._gen.nodetrust.join.v1 import join_pb2, join_pb2_grpc
from protocol._gen.spire.api.server.agent.v1 import agent_pb2_grpc
from protocol.spiffe import SpiffeId
from server.ca import CertificateAuthority

TRUST_DOMAIN = "example.org"
AGENT_ID = f"spiffe://{TRUST_DOMAIN}/spire/agent/tpm/" + "ab" * 32

# A handler gets (request, context) and returns a reply or awaits context.abort(...).
Handler = Callable[[Any, Any], Any]


@dataclass
class Calls:
    """What the tiny server saw: one (method, request, peer SPIFFE ID) per call."""

    seen: list[tuple[str, Any, str]] = field(default_factory=list)

    def of(self, method: str) -> list[Any]:
        return [request for name, request, _ in self.seen if name == method]


def _peer_id(context: Any) -> str:
    from cryptography import x509

    pems = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        return ""
    cert = x509.load_pem_x509_certificate(pems[0])
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return str(san.value.get_values_for_type(x509.UniformResourceIdentifier)[0])


class _Join(join_pb2_grpc.JoinServicer):
    def __init__(self, server: TinyServer) -> None:
        self.server = server

    async def BeginJoin(self, request: Any, context: Any) -> Any:
        if "BeginJoin" not in self.server.handlers:  # a pool that does not check measured boot
            self.server.calls.seen.append(("BeginJoin", request, _peer_id(context)))
            return join_pb2.BeginJoinResponse()
        return await self.server.dispatch("BeginJoin", request, context)

    async def RequestJoin(self, request: Any, context: Any) -> Any:
        return await self.server.dispatch("RequestJoin", request, context)

    async def ReportJoined(self, request: Any, context: Any) -> Any:
        return await self.server.dispatch("ReportJoined", request, context)

    async def Recheck(self, request: Any, context: Any) -> Any:
        return await self.server.dispatch("Recheck", request, context)


class _Agent(agent_pb2_grpc.AgentServicer):
    def __init__(self, server: TinyServer) -> None:
        self.server = server

    async def AttestAgent(self, request_iterator: Any, context: Any) -> Any:
        first = await request_iterator.__anext__()
        reply = await self.server.dispatch("AttestAgent", first, context)
        if reply is not None:
            yield reply


@dataclass
class TinyServer:
    """A grpc.aio server on 127.0.0.1 in its own thread; ``handlers`` maps method names to handlers."""

    base: Path
    handlers: dict[str, Handler] = field(default_factory=dict)
    calls: Calls = field(default_factory=Calls)
    port: int = 0

    def __post_init__(self) -> None:
        self.ca = CertificateAuthority.load_or_create(
            self.base / "ca", TRUST_DOMAIN, ca_ttl=dt.timedelta(days=1)
        )
        self.bundle = self.ca.bundle_pem()
        self.bundle_path = self.base / "bundle.pem"
        self.bundle_path.write_bytes(self.bundle)
        self.svid_cert, self.svid_key = self._agent_svid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiny-grpc", daemon=True)
        self._server: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _agent_svid(self) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        svid = self.ca.issue_agent_svid(key.public_key(), SpiffeId.parse(AGENT_ID), dt.timedelta(hours=1))
        cert_path, key_path = self.base / "svid.pem", self.base / "svid.key"
        cert_path.write_bytes(svid.cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_path.chmod(0o600)
        return cert_path, key_path

    async def dispatch(self, method: str, request: Any, context: Any) -> Any:
        self.calls.seen.append((method, request, _peer_id(context)))
        handler = self.handlers.get(method)
        if handler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served by the tiny server")
        result = handler(request, context)  # type: ignore[misc]
        if asyncio.iscoroutine(result):
            result = await result
        return result

    async def _start(self, require_client_auth: bool) -> None:
        server_key = ec.generate_private_key(ec.SECP256R1())
        svid = self.ca.issue_server_svid(server_key, dt.timedelta(hours=1))
        chain = svid.cert.public_bytes(serialization.Encoding.PEM)  # the CA itself is the bundle
        key_pem = server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        creds = grpc.ssl_server_credentials(
            [(key_pem, chain)], root_certificates=self.bundle, require_client_auth=require_client_auth
        )
        self._server = grpc.aio.server()
        join_pb2_grpc.add_JoinServicer_to_server(_Join(self), self._server)
        agent_pb2_grpc.add_AgentServicer_to_server(_Agent(self), self._server)  # type: ignore[abstract]
        self.port = self._server.add_secure_port("127.0.0.1:0", creds)
        await self._server.start()

    def start(self, *, require_client_auth: bool = True) -> TinyServer:
        self._thread.start()
        fut: Future[None] = asyncio.run_coroutine_threadsafe(self._start(require_client_auth), self._loop)
        fut.result(30)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            if self._server is not None:
                asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


@pytest.fixture
def tiny_server(tmp_path: Path) -> Iterator[Callable[..., TinyServer]]:
    """Factory: ``tiny_server(RequestJoin=handler, ...)`` starts a server with those handlers."""
    started: list[TinyServer] = []

    def make(*, require_client_auth: bool = True, **handlers: Handler) -> TinyServer:
        base = tmp_path / f"tiny{len(started)}"
        base.mkdir()
        srv = TinyServer(base, dict(handlers)).start(require_client_auth=require_client_auth)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def abort_with(code: grpc.StatusCode, message: str, details: bytes | None = None) -> Handler:
    """A handler that refuses with ``code``, ``message`` and a raw ``grpc-status-details-bin``."""

    async def handler(request: Any, context: Any) -> Any:
        trailers = (("grpc-status-details-bin", details),) if details is not None else ()
        await context.abort(code, message, trailing_metadata=trailers)

    return handler


def joined_reply(revoked: bool = True) -> Handler:
    def handler(request: Any, context: Any) -> Any:
        return join_pb2.JoinedResponse(revoked=revoked)

    return handler
