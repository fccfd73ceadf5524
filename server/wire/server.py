"""The gRPC server of :mod:`server.wire`: sockets, TLS, the dispatch of calls and their contexts.

:class:`WireServer` takes the same method handlers as a ``grpc.aio`` server
(``add_generic_rpc_handlers`` with ``grpc.*_rpc_method_handler`` objects, so the boundary's
:func:`server.boundary.register` and ``grpc_health``'s servicer register on either), and gives
each call a :class:`WireContext` with the parts of ``grpc.aio.ServicerContext`` a servicer uses
here: ``peer``, ``cancelled``, ``abort`` (raising ``grpc.aio.AbortError`` as grpc.aio does),
``set_code``, ``set_details``, ``set_trailing_metadata``, ``invocation_metadata``,
``time_remaining``, ``write`` and ``auth_context`` (empty: the attestation port asks for no
client certificate).

Connections are accepted by this module's own loop so that the connection cap is applied
before the TLS handshake, and a handshake that does not finish in time is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from server.wire.h2 import Connection, Limits
from server.wire.headers import trailers
from server.wire.stream import Stream

log = logging.getLogger(__name__)

OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = (
    0,
    1,
    2,
    4,
    8,
    12,
    13,
)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (1-8 digits and a unit), in seconds; None when malformed."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    return None if unit is None else int(value[:-1]) * unit


class ServerTls:
    """The port's TLS context from the server SVID; a renewed SVID serves new connections."""

    def __init__(self, svid: Any, key_path: Path, cert_path: Path) -> None:
        self._svid = svid
        self._key = key_path
        self._cert = cert_path
        self._generation = -1
        self._ctx: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        self._svid.renew_if_due()
        if self._ctx is None or self._svid.generation != self._generation:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
            ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_TICKET
            ctx.num_tickets = 0  # agents connect once: session tickets would be signed for nobody
            ctx.set_alpn_protocols(["h2"])
            ctx.load_cert_chain(self._cert, self._key)
            self._generation = self._svid.generation
            self._ctx = ctx
        return self._ctx


@dataclass(frozen=True)
class _Details:
    method: str
    invocation_metadata: tuple[Any, ...] = ()


class _Requests:
    """A streaming call's request iterator: decoded messages until the client half-closes."""

    __slots__ = ("_decode", "_stream")

    def __init__(self, stream: Stream, decode: Any) -> None:
        self._stream = stream
        self._decode = decode

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        raw = await self._stream.next_message()
        if raw is None:
            raise StopAsyncIteration
        return self._decode(raw) if self._decode is not None else raw


class WireContext:
    """The servicer context of one call on a :class:`WireServer`."""

    __slots__ = ("_code", "_conn", "_deadline", "_details", "_handler", "_stream", "_trailing")

    def __init__(self, conn: Connection, stream: Stream, handler: Any) -> None:
        self._conn = conn
        self._stream = stream
        self._handler = handler
        self._code: int | None = None
        self._details = ""
        self._trailing: Sequence[tuple[str, Any]] = ()
        self._deadline: float | None = None

    def peer(self) -> str:
        return self._conn.peer

    def cancelled(self) -> bool:
        return self._stream.reset

    def done(self) -> bool:
        return self._stream.closed or self._stream.reset

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[tuple[str, Any]] = ()
    ) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() with OK")
        self._code = code.value[0]
        self._details = details
        if trailing_metadata:
            self._trailing = trailing_metadata
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code.value[0]

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = trailing_metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        out: list[tuple[str, Any]] = []
        for name, value in self._stream.headers.items():
            if name[:1] == b":" or name in (b"te", b"content-type", b"grpc-timeout"):
                continue
            key = name.decode("ascii", "replace")
            if key.endswith("-bin"):
                try:
                    out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
                except ValueError:
                    continue
            else:
                out.append((key, value.decode("latin-1")))
        return tuple(out)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def write(self, message: Any) -> None:
        if self._stream.reset:
            raise asyncio.CancelledError
        self._conn.send_message(self._stream, self._handler.response_serializer(message))
        await self._conn.drain()


class WireServer:
    """A gRPC server on the event loop; the subset of ``grpc.aio.Server`` that nodeserver uses."""

    def __init__(
        self,
        *,
        limits: Limits,
        max_connections: int = 0,
        handshake_timeout: float = 10.0,
        maximum_concurrent_rpcs: int = 4096,
        max_send_message: int = 4 * 1024 * 1024,
    ) -> None:
        self.limits = limits
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.maximum_concurrent_rpcs = maximum_concurrent_rpcs
        self.max_send_message = max_send_message
        self._generic: list[Any] = []
        self._methods: dict[str, Any] = {}
        self._listeners: list[tuple[socket.socket, ServerTls]] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # handshakes and calls: kept until done
        self._active = 0
        self._stopped: asyncio.Event | None = None

    # -- grpc.aio.Server's registration API ------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler

    def _lookup(self, path: str) -> Any:
        handler = self._methods.get(path)
        if handler is None:
            for generic in self._generic:
                handler = generic.service(_Details(path))
                if handler is not None:
                    self._methods[path] = handler  # only found paths are kept: the table stays bounded
                    break
        return handler

    def add_secure_port(self, address: str, tls: ServerTls) -> int:
        """Bind ``host:port`` (``[v6]:port``) now; the port bound, or 0 when it cannot be bound."""
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        if not port_text.isdigit() or int(port_text) > 65535:
            return 0
        try:
            infos = socket.getaddrinfo(
                host or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except (OSError, ValueError):
            return 0
        bound = 0
        for family, kind, proto, _, resolved in infos:
            addr = (resolved[0], bound, *resolved[2:]) if bound else resolved
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and addr[0] == "::":
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(addr)
                sock.listen(1024)
                sock.setblocking(False)
            except OSError:
                sock.close()
                continue
            bound = bound or sock.getsockname()[1]
            self._listeners.append((sock, tls))
            if family == socket.AF_INET6 and addr[0] == "::":
                break  # dual-stack: 0.0.0.0 is the same port
        return bound

    async def start(self) -> None:
        self._stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sock, tls in self._listeners:
            factory = functools.partial(self._connection, loop, tls)
            self._servers.append(await loop.create_server(factory, sock=sock, backlog=1024))

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[None]:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _connection(self, loop: asyncio.AbstractEventLoop, tls: ServerTls) -> Connection:
        return Connection(
            self, self.limits, "", loop, tls=tls.context(), handshake_timeout=self.handshake_timeout
        )

    # -- Application (server.wire.h2) ---------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        """A new TCP connection, before TLS: within the cap, or refused."""
        if self.max_connections and len(self._connections) >= self.max_connections:
            return False
        assert conn.transport is not None  # noqa: S101 - connection_made sets it
        addr = conn.transport.get_extra_info("peername")
        sock = conn.transport.get_extra_info("socket")
        if isinstance(addr, tuple) and len(addr) >= 2:
            v6 = sock is not None and sock.family == socket.AF_INET6
            conn.peer = f"ipv6:[{addr[0]}]:{addr[1]}" if v6 else f"ipv4:{addr[0]}:{addr[1]}"
        self._connections.add(conn)
        return True

    def connection_closed(self, conn: Connection) -> None:
        self._connections.discard(conn)

    def stream_opened(self, conn: Connection, stream: Stream) -> None:
        headers = stream.headers
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            conn.send_trailers(stream, trailers(UNKNOWN, "content-type is not application/grpc"))
            return
        encoding = headers.get(b"grpc-encoding")
        if encoding is not None and encoding != b"identity":
            refusal = trailers(
                UNIMPLEMENTED,
                "compressed requests are not accepted",
                (("grpc-accept-encoding", "identity"),),
            )
            conn.send_trailers(stream, refusal)
            return
        handler = self._lookup(stream.path)
        if handler is None:
            conn.send_trailers(stream, trailers(UNIMPLEMENTED, "Method not found!"))
            return
        if self._active >= self.maximum_concurrent_rpcs:
            conn.send_trailers(stream, trailers(RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"))
            return
        context = WireContext(conn, stream, handler)
        self._active += 1  # counted now: calls that arrive in one read are all held to the cap
        task = self._spawn(conn.loop, self._run(conn, stream, handler, context))
        task.add_done_callback(self._call_done)
        stream.task = task
        stream.on_reset = task.cancel
        raw_timeout = headers.get(b"grpc-timeout")
        if raw_timeout is not None:
            timeout = parse_timeout(raw_timeout)
            if timeout is not None:
                context._deadline = time.monotonic() + timeout
                # Kept until the stream is gone, not until the handler returns: an answer held back
                # by the peer's window must not outlive the deadline either.
                stream.timer = conn.loop.call_later(timeout, self._expire, conn, stream)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._active -= 1

    def _expire(self, conn: Connection, stream: Stream) -> None:
        """The call's deadline passed: its status, then the handler is cancelled."""
        conn.app_error(stream, DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def _run(self, conn: Connection, stream: Stream, handler: Any, context: WireContext) -> None:
        code, details = OK, ""
        try:
            if handler.request_streaming:
                requests = _Requests(stream, handler.request_deserializer)
                if handler.response_streaming:
                    await self._send_all(conn, stream, handler, handler.stream_stream(requests, context))
                else:
                    self._send(conn, stream, handler, await handler.stream_unary(requests, context))
            else:
                raw = await stream.next_message()
                if raw is None:
                    code, details = INTERNAL, "the request carried no message"
                else:
                    try:
                        request = handler.request_deserializer(raw) if handler.request_deserializer else raw
                    except Exception:
                        request = None
                        code, details = INTERNAL, "could not parse the request message"
                    if request is not None and handler.response_streaming:
                        result = handler.unary_stream(request, context)
                        if hasattr(result, "__aiter__"):
                            await self._send_all(conn, stream, handler, result)
                        else:
                            await result
                    elif request is not None:
                        self._send(conn, stream, handler, await handler.unary_unary(request, context))
            if code == OK and context._code is not None:
                code, details = context._code, context._details
        except grpc.aio.AbortError:
            code, details = context._code if context._code is not None else UNKNOWN, context._details
        except asyncio.CancelledError:
            if stream.reset or stream.closed:
                return  # the peer reset the call, the connection is gone, or the deadline passed
            raise
        except _TooLarge as err:
            code, details = RESOURCE_EXHAUSTED, str(err)
        except Exception:
            log.exception("unexpected error in %s from %s", stream.path, conn.peer)
            code, details = UNKNOWN, "Unexpected error"
        conn.send_trailers(stream, trailers(code, details, context._trailing))

    def _send(self, conn: Connection, stream: Stream, handler: Any, response: Any) -> None:
        data = handler.response_serializer(response) if handler.response_serializer else response
        if len(data) > self.max_send_message:
            raise _TooLarge(f"the response of {len(data)} bytes exceeds {self.max_send_message}")
        conn.send_message(stream, data)

    async def _send_all(
        self, conn: Connection, stream: Stream, handler: Any, responses: AsyncIterator[Any]
    ) -> None:
        async for response in responses:
            self._send(conn, stream, handler, response)
            await conn.drain()

    # -- lifetime -----------------------------------------------------------------------
    async def stop(self, grace: float | None) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        self._listeners.clear()
        for conn in list(self._connections):
            conn.goaway(0, "server stopping")
        deadline = time.monotonic() + (grace or 0)
        while any(c.streams for c in self._connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:  # the handlers see their cancellation (and write their audit lines) before stop returns
            await asyncio.wait(tasks, timeout=5.0)
        for conn in list(self._connections):
            conn.abort()
        self._connections.clear()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()


class _TooLarge(Exception):
    pass


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
