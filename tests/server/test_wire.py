"""server/wire: nodeserver's own gRPC server transport, against real clients and raw HTTP/2.

A :class:`WireThread` runs a :class:`WireServer` on its own event loop in a thread, serving a small
test service (``test.Wire``, built with grpc's generic handlers from protobuf wrapper messages)
and the stock grpc health servicer, over TLS with a throwaway CA. The tests talk to it with
gRPC's C core (``grpc.aio``), with grpclib (the agent's client) and with hand-built HTTP/2
frames (tests/support/h2raw.py), whose answers ``hyperframe`` and ``hpack`` decode: the
ecosystem's parsers are the oracle. Bounds are made small (``Limits``) rather than waited for.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime as dt
import hashlib
import itertools
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import hpack
import pytest
from google.protobuf import message as _message
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from hyperframe.frame import DataFrame, PingFrame, RstStreamFrame, SettingsFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from server.app import server_tls
from server.ca import CertificateAuthority, ServerSvid
from server.wire import h2 as wire_h2
from server.wire import headers as wire_headers
from server.wire.h2 import Limits
from server.wire.headers import _percent, literal, trailers
from server.wire.server import WireServer, parse_timeout
from tests.support.h2flood import closed_by_peer, silent_connections
from tests.support.h2raw import (
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    RawH2,
    client_context,
    frame,
    peer_closed,
)

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")
TRUST_DOMAIN = "example.org"
SERVICE = "test.Wire"
ECHO = f"/{SERVICE}/Echo"
SIZED = f"/{SERVICE}/Sized"
ABORT = f"/{SERVICE}/Abort"
COUNT = f"/{SERVICE}/Count"
ECHO_STREAM = f"/{SERVICE}/EchoStream"
HANG = f"/{SERVICE}/Hang"
HANG_STREAM = f"/{SERVICE}/HangStream"
SLOW = f"/{SERVICE}/Slow"
META = f"/{SERVICE}/Meta"
# Non-ASCII, a percent sign, DEL and a control character: all must be percent-encoded on the wire.
ABORT_MESSAGE = "état: 100% ✓ \x7f\x01 fin"
ABORT_TRAILING: tuple[tuple[str, str | bytes], ...] = (
    ("x-bin", b"\x00\xff"),  # base64 "AP8=": one padding byte
    ("x-one-bin", b"\xfe"),  # "/g==": two
    ("x-three-bin", b"\x01\x02\x03"),  # "AQID": none
    ("x-text", "plain value"),
)
KIB = 1024
# The shared server's limits: messages up to 512 KiB in, 1 MiB out.
LIMITS = Limits(max_message=512 * KIB)
MAX_SEND = 1024 * KIB


# -- the test service ----------------------------------------------------------------------------
class Observed:
    """Events the handlers set in the server's thread and the tests wait for in theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(name, threading.Event())

    def wait(self, name: str, timeout: float = 10.0) -> bool:
        return self.event(name).wait(timeout)

    def is_set(self, name: str) -> bool:
        return self.event(name).is_set()

    def tags(self, prefix: str) -> set[str]:
        with self._lock:
            return {
                n.removeprefix(prefix)
                for n, e in self._events.items()
                if n.startswith(prefix) and e.is_set()
            }


_tags = itertools.count()


def new_tag() -> str:
    return f"t{next(_tags)}-{os.urandom(3).hex()}"


def _serialize(message: _message.Message) -> bytes:
    return message.SerializeToString()


def sv(text: str) -> bytes:
    return wrappers_pb2.StringValue(value=text).SerializeToString()


def wire_service(seen: Observed) -> Any:
    """``test.Wire``: the handler shapes a server meets, each reporting what it saw to ``seen``."""

    async def echo(request: wrappers_pb2.BytesValue, context: Any) -> wrappers_pb2.BytesValue:
        return wrappers_pb2.BytesValue(value=request.value)

    async def sized(request: wrappers_pb2.Int64Value, context: Any) -> wrappers_pb2.BytesValue:
        return wrappers_pb2.BytesValue(value=b"s" * request.value)

    async def abort(request: wrappers_pb2.StringValue, context: Any) -> wrappers_pb2.StringValue:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, ABORT_MESSAGE, trailing_metadata=ABORT_TRAILING
        )
        raise AssertionError("abort() returned")

    async def count(
        request: wrappers_pb2.Int32Value, context: Any
    ) -> AsyncIterator[wrappers_pb2.StringValue]:
        for i in range(request.value):
            yield wrappers_pb2.StringValue(value=f"item {i}")

    async def echo_stream(
        requests: AsyncIterator[wrappers_pb2.BytesValue], context: Any
    ) -> AsyncIterator[wrappers_pb2.BytesValue]:
        async for request in requests:
            yield wrappers_pb2.BytesValue(value=request.value)

    async def hang(request: wrappers_pb2.StringValue, context: Any) -> wrappers_pb2.StringValue:
        seen.event(f"started:{request.value}").set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.event(f"cancelled:{request.value}").set()
            raise
        seen.event(f"finished:{request.value}").set()
        return wrappers_pb2.StringValue(value="woke")

    async def hang_stream(
        requests: AsyncIterator[wrappers_pb2.StringValue], context: Any
    ) -> AsyncIterator[wrappers_pb2.StringValue]:
        first = await anext(aiter(requests))
        tag = first.value
        seen.event(f"started:{tag}").set()
        try:
            yield wrappers_pb2.StringValue(value="ready")
            await asyncio.sleep(60)
        except (asyncio.CancelledError, GeneratorExit):
            seen.event(f"cancelled:{tag}").set()
            raise
        seen.event(f"finished:{tag}").set()

    async def slow(request: wrappers_pb2.StringValue, context: Any) -> wrappers_pb2.StringValue:
        seen.event(f"started:{request.value}").set()
        await asyncio.sleep(0.3)
        seen.event(f"finished:{request.value}").set()
        return wrappers_pb2.StringValue(value=f"done {request.value}")

    async def meta(request: wrappers_pb2.StringValue, context: Any) -> wrappers_pb2.StringValue:
        metadata = [
            [key, value.hex() if isinstance(value, bytes) else value]
            for key, value in context.invocation_metadata()
        ]
        answer = {
            "echo": request.value,
            "peer": context.peer(),
            "metadata": metadata,
            "time_remaining": context.time_remaining(),
        }
        return wrappers_pb2.StringValue(value=json.dumps(answer))

    unary, ustream, sstream = (
        grpc.unary_unary_rpc_method_handler,
        grpc.unary_stream_rpc_method_handler,
        grpc.stream_stream_rpc_method_handler,
    )
    string_in = wrappers_pb2.StringValue.FromString
    handlers = {
        "Echo": unary(echo, wrappers_pb2.BytesValue.FromString, _serialize),
        "Sized": unary(sized, wrappers_pb2.Int64Value.FromString, _serialize),
        "Abort": unary(abort, string_in, _serialize),
        "Count": ustream(count, wrappers_pb2.Int32Value.FromString, _serialize),
        "EchoStream": sstream(echo_stream, wrappers_pb2.BytesValue.FromString, _serialize),
        "Hang": unary(hang, string_in, _serialize),
        "HangStream": sstream(hang_stream, string_in, _serialize),
        "Slow": unary(slow, string_in, _serialize),
        "Meta": unary(meta, string_in, _serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


# -- the server in a thread --------------------------------------------------------------------
def running_handlers() -> int:
    """On the server's loop: calls whose handler task has not finished (WireServer._run coroutines)."""
    return sum(
        1
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "WireServer._run" and not task.done()
    )


class WireThread:
    """A WireServer on its own event loop in a daemon thread, with a fresh CA and server SVID."""

    def __init__(
        self,
        data_dir: Path,
        *,
        limits: Limits = LIMITS,
        address: str = "127.0.0.1:0",
        max_connections: int = 0,
        handshake_timeout: float = 10.0,
        maximum_concurrent_rpcs: int = 4096,
    ) -> None:
        self.ca = CertificateAuthority.load_or_create(data_dir, TRUST_DOMAIN, ca_ttl=dt.timedelta(days=1))
        self.svid = ServerSvid(self.ca, data_dir, dt.timedelta(hours=1), ("localhost",))
        self.seen = Observed()
        self.server = WireServer(
            limits=limits,
            max_connections=max_connections,
            handshake_timeout=handshake_timeout,
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
            max_send_message=MAX_SEND,
        )
        self.server.add_generic_rpc_handlers((wire_service(self.seen),))
        self.port = self.server.add_secure_port(address, server_tls(self.svid, data_dir))
        assert self.port > 0, address
        self.host = address.rpartition(":")[0].strip("[]")
        self.loop = asyncio.new_event_loop()
        self.health: Any = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="wire-test", daemon=True)

    def start(self) -> WireThread:
        self._thread.start()
        self.call(self._start)
        return self

    async def _start(self) -> None:
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def submit(self, fn: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        async def run() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
        return self.submit(fn).result(timeout)

    def handler_tasks(self) -> int:
        """Calls whose handler task has not finished (WireServer._run coroutines alive on the loop)."""

        async def count() -> int:
            return running_handlers()

        return self.call(count)

    def wait_no_handlers(self, timeout: float = 10.0) -> int:
        """Poll until no handler task is left (or ``timeout``); the number left."""
        left = self.handler_tasks()
        for _ in range(int(timeout / 0.05)):
            if left == 0:
                break
            time.sleep(0.05)
            left = self.handler_tasks()
        return left

    def stop(self, grace: float = 0.0) -> None:
        if self._thread.is_alive():
            with suppress(Exception):
                self.call(lambda: self.server.stop(grace))
            self.call(self._drain)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()

    @staticmethod
    async def _drain() -> None:
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        await asyncio.sleep(0.05)  # transports finish closing

    @property
    def bundle(self) -> bytes:
        return self.ca.bundle_pem()

    def raw(self, **kwargs: Any) -> RawH2:
        return RawH2(self.port, host=self.host, bundle=self.bundle, **kwargs)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WireThread]:
    srv = WireThread(tmp_path_factory.mktemp("wire") / "data").start()
    yield srv
    srv.stop()


@pytest.fixture
def make_wire(tmp_path: Path) -> Iterator[WireFactory]:
    """Factory: ``make_wire(limits=..., max_connections=...)`` starts a server of its own."""
    started: list[WireThread] = []
    counter = itertools.count()

    def make(**kwargs: Any) -> WireThread:
        srv = WireThread(tmp_path / f"data{next(counter)}", **kwargs).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


class RawFactory(Protocol):
    def __call__(self, srv: WireThread, **kwargs: Any) -> RawH2: ...


WireFactory = Callable[..., WireThread]


@pytest.fixture
def raws() -> Iterator[RawFactory]:
    """Factory of raw connections, all closed at the end."""
    opened: list[RawH2] = []

    def make(srv: WireThread, **kwargs: Any) -> RawH2:
        conn = srv.raw(**kwargs)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close()


# -- real clients ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    """How a call ended, in either client's terms."""

    code: str = "OK"
    message: str = ""
    trailing: dict[str, str | bytes] = field(default_factory=dict)
    responses: list[Any] = field(default_factory=list)


class Client(Protocol):
    async def unary(
        self,
        path: str,
        request: _message.Message,
        response_cls: type[_message.Message],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Outcome: ...

    async def server_stream(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Outcome: ...

    async def pingpong(
        self, path: str, requests: Sequence[_message.Message], response_cls: type[_message.Message]
    ) -> Outcome: ...

    async def cancel_after_first(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Any: ...


class AioClient:
    """gRPC's C core (grpc.aio) over TLS: the CA bundle as root, the SVID's DNS name as target."""

    def __init__(self, host: str, port: int, bundle: bytes) -> None:
        target = f"ipv6:[{host}]:{port}" if ":" in host else f"{host}:{port}"
        credentials = grpc.ssl_channel_credentials(root_certificates=bundle)
        self.channel = grpc.aio.secure_channel(
            target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
        )

    @staticmethod
    def _failed(err: Any) -> Outcome:
        return Outcome(err.code().name, err.details() or "", dict(err.trailing_metadata() or ()))

    async def unary(
        self,
        path: str,
        request: _message.Message,
        response_cls: type[_message.Message],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Outcome:
        call = self.channel.unary_unary(
            path, request_serializer=_serialize, response_deserializer=response_cls.FromString
        )
        try:
            response = await call(request, timeout=timeout, metadata=tuple(metadata) or None)
        except grpc.aio.AioRpcError as err:
            return self._failed(err)
        return Outcome(responses=[response])

    async def server_stream(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Outcome:
        call = self.channel.unary_stream(
            path, request_serializer=_serialize, response_deserializer=response_cls.FromString
        )(request)
        out = Outcome()
        try:
            async for response in call:
                out.responses.append(response)
        except grpc.aio.AioRpcError as err:
            failed = self._failed(err)
            failed.responses = out.responses
            return failed
        return out

    async def pingpong(
        self, path: str, requests: Sequence[_message.Message], response_cls: type[_message.Message]
    ) -> Outcome:
        call = self.channel.stream_stream(
            path, request_serializer=_serialize, response_deserializer=response_cls.FromString
        )()
        out = Outcome()
        try:
            for request in requests:
                await call.write(request)
                out.responses.append(await call.read())
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            out.code = (await call.code()).name
        except grpc.aio.AioRpcError as err:
            failed = self._failed(err)
            failed.responses = out.responses
            return failed
        return out

    async def cancel_after_first(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Any:
        call = self.channel.stream_stream(
            path, request_serializer=_serialize, response_deserializer=response_cls.FromString
        )()
        await call.write(request)
        first = await call.read()
        call.cancel()
        return first

    async def close(self) -> None:
        await self.channel.close()


class GrpclibClient:
    """grpclib, the agent's client, with the agent's SPIFFE TLS (agent.tls.SpiffeTLSContext)."""

    def __init__(self, host: str, port: int, bundle: bytes) -> None:
        from grpclib.client import Channel

        from agent.tls import SpiffeTLSContext
        from protocol.spiffe import server_id

        self.channel = Channel(host, port, ssl=SpiffeTLSContext(bundle, [server_id(TRUST_DOMAIN)]))

    @staticmethod
    def _trailing(stream: Any) -> dict[str, str | bytes]:
        return dict(stream.trailing_metadata or {}) if stream is not None else {}

    async def unary(
        self,
        path: str,
        request: _message.Message,
        response_cls: type[_message.Message],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Outcome:
        from grpclib.const import Cardinality
        from grpclib.exceptions import GRPCError

        stream: Any = None
        try:
            async with self.channel.request(
                path,
                Cardinality.UNARY_UNARY,
                type(request),
                response_cls,
                timeout=timeout,
                metadata=list(metadata),
            ) as stream:
                await stream.send_message(request, end=True)
                response = await stream.recv_message()
                await stream.recv_trailing_metadata()
        except GRPCError as err:
            return Outcome(err.status.name, err.message or "", self._trailing(stream))
        except TimeoutError:
            return Outcome("DEADLINE_EXCEEDED")
        return Outcome(responses=[response])

    async def server_stream(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Outcome:
        from grpclib.const import Cardinality
        from grpclib.exceptions import GRPCError

        out = Outcome()
        try:
            async with self.channel.request(
                path, Cardinality.UNARY_STREAM, type(request), response_cls
            ) as stream:
                await stream.send_message(request, end=True)
                while (response := await stream.recv_message()) is not None:
                    out.responses.append(response)
        except GRPCError as err:
            return Outcome(err.status.name, err.message or "", responses=out.responses)
        return out

    async def pingpong(
        self, path: str, requests: Sequence[_message.Message], response_cls: type[_message.Message]
    ) -> Outcome:
        from grpclib.const import Cardinality
        from grpclib.exceptions import GRPCError

        out = Outcome()
        try:
            async with self.channel.request(
                path, Cardinality.STREAM_STREAM, type(requests[0]), response_cls
            ) as stream:
                for request in requests:
                    await stream.send_message(request)
                    out.responses.append(await stream.recv_message())
                await stream.end()
                assert await stream.recv_message() is None
                await stream.recv_trailing_metadata()
        except GRPCError as err:
            return Outcome(err.status.name, err.message or "", responses=out.responses)
        return out

    async def cancel_after_first(
        self, path: str, request: _message.Message, response_cls: type[_message.Message]
    ) -> Any:
        from grpclib.const import Cardinality

        async with self.channel.request(
            path, Cardinality.STREAM_STREAM, type(request), response_cls
        ) as stream:
            await stream.send_message(request)
            first = await stream.recv_message()
            await stream.cancel()
        return first

    async def close(self) -> None:
        self.channel.close()


CLIENTS = ["grpc.aio", "grpclib"]


@asynccontextmanager
async def client(kind: str, srv: WireThread) -> AsyncIterator[Client]:
    made: AioClient | GrpclibClient = (
        AioClient(srv.host, srv.port, srv.bundle)
        if kind == "grpc.aio"
        else GrpclibClient(srv.host, srv.port, srv.bundle)
    )
    try:
        yield made
    finally:
        await made.close()


def run_client(kind: str, srv: WireThread, script: Callable[[Client], Awaitable[T]]) -> T:
    async def main() -> T:
        async with client(kind, srv) as c:
            return await script(c)

    return asyncio.run(main())


def bytes_value(data: bytes) -> wrappers_pb2.BytesValue:
    return wrappers_pb2.BytesValue(value=data)


def string_value(text: str) -> wrappers_pb2.StringValue:
    return wrappers_pb2.StringValue(value=text)


# == 1. real clients ==============================================================================
@pytest.mark.parametrize("kind", CLIENTS)
def test_unary_call(wire: WireThread, kind: str) -> None:
    out = run_client(
        kind, wire, lambda c: c.unary(ECHO, bytes_value(b"hello \x00 wire"), wrappers_pb2.BytesValue)
    )
    assert out.code == "OK", out
    assert [r.value for r in out.responses] == [b"hello \x00 wire"]


@pytest.mark.parametrize("kind", CLIENTS)
def test_server_streaming_sends_every_message_then_ok(wire: WireThread, kind: str) -> None:
    out = run_client(
        kind,
        wire,
        lambda c: c.server_stream(COUNT, wrappers_pb2.Int32Value(value=25), wrappers_pb2.StringValue),
    )
    assert out.code == "OK", out
    assert [r.value for r in out.responses] == [f"item {i}" for i in range(25)]


@pytest.mark.parametrize("kind", CLIENTS)
def test_bidi_streaming_ping_pong(wire: WireThread, kind: str) -> None:
    requests = [bytes_value(f"ping {i}".encode()) for i in range(10)]
    out = run_client(kind, wire, lambda c: c.pingpong(ECHO_STREAM, requests, wrappers_pb2.BytesValue))
    assert out.code == "OK", out
    assert [r.value for r in out.responses] == [f"ping {i}".encode() for i in range(10)]


@pytest.mark.parametrize("kind", CLIENTS)
def test_abort_carries_code_message_and_binary_trailing_metadata(wire: WireThread, kind: str) -> None:
    out = run_client(kind, wire, lambda c: c.unary(ABORT, string_value("x"), wrappers_pb2.StringValue))
    assert out.code == "FAILED_PRECONDITION", out
    assert out.message == ABORT_MESSAGE  # percent-encoded by the server, decoded by the client
    for key, value in ABORT_TRAILING:
        assert out.trailing.get(key) == value, (key, out.trailing)


@pytest.mark.parametrize("kind", CLIENTS)
def test_unknown_method_is_unimplemented(wire: WireThread, kind: str) -> None:
    out = run_client(
        kind, wire, lambda c: c.unary(f"/{SERVICE}/Nope", string_value("x"), wrappers_pb2.StringValue)
    )
    assert out.code == "UNIMPLEMENTED", out
    out = run_client(
        kind, wire, lambda c: c.unary("/no.Such/Service", string_value("x"), wrappers_pb2.StringValue)
    )
    assert out.code == "UNIMPLEMENTED", out


@pytest.mark.parametrize("kind", CLIENTS)
def test_large_messages_both_ways_cross_the_flow_control_windows(wire: WireThread, kind: str) -> None:
    """200 KiB each way (past the 64 KiB initial stream windows), then 8 x 200 KiB on one stream
    (past the server's 1 MiB connection window): WINDOW_UPDATE has to flow in both directions."""
    big = os.urandom(200 * KIB)

    async def script(c: Client) -> tuple[Outcome, Outcome]:
        one = await c.unary(ECHO, bytes_value(big), wrappers_pb2.BytesValue, timeout=30)
        many = await c.pingpong(
            ECHO_STREAM, [bytes_value(bytes([i]) + big[i:]) for i in range(8)], wrappers_pb2.BytesValue
        )
        return one, many

    one, many = run_client(kind, wire, script)
    assert one.code == "OK", one.code
    assert hashlib.sha256(one.responses[0].value).digest() == hashlib.sha256(big).digest()
    assert many.code == "OK", many.code
    assert [r.value for r in many.responses] == [bytes([i]) + big[i:] for i in range(8)]


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_request_above_max_message_is_resource_exhausted(wire: WireThread, kind: str) -> None:
    out = run_client(
        kind,
        wire,
        lambda c: c.unary(ECHO, bytes_value(b"x" * (600 * KIB)), wrappers_pb2.BytesValue, timeout=30),
    )
    assert out.code == "RESOURCE_EXHAUSTED", out
    # The connection is still good for the next call.
    again = run_client(kind, wire, lambda c: c.unary(ECHO, bytes_value(b"after"), wrappers_pb2.BytesValue))
    assert again.code == "OK" and again.responses[0].value == b"after"


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_response_above_max_send_message_is_resource_exhausted(wire: WireThread, kind: str) -> None:
    out = run_client(
        kind,
        wire,
        lambda c: c.unary(SIZED, wrappers_pb2.Int64Value(value=MAX_SEND + 1), wrappers_pb2.BytesValue),
    )
    assert out.code == "RESOURCE_EXHAUSTED", out
    ok = run_client(
        kind,
        wire,
        lambda c: c.unary(SIZED, wrappers_pb2.Int64Value(value=MAX_SEND - 16), wrappers_pb2.BytesValue),
    )
    assert ok.code == "OK" and len(ok.responses[0].value) == MAX_SEND - 16


@pytest.mark.parametrize("kind", CLIENTS)
def test_client_deadline_cancels_the_handler(wire: WireThread, kind: str) -> None:
    tag = new_tag()
    out = run_client(
        kind, wire, lambda c: c.unary(HANG, string_value(tag), wrappers_pb2.StringValue, timeout=0.5)
    )
    assert out.code == "DEADLINE_EXCEEDED", out
    assert wire.seen.is_set(f"started:{tag}")
    assert wire.seen.wait(f"cancelled:{tag}", 5), "the handler was not cancelled"
    assert not wire.seen.is_set(f"finished:{tag}")


@pytest.mark.parametrize("kind", CLIENTS)
def test_client_cancellation_mid_stream_cancels_the_handler(wire: WireThread, kind: str) -> None:
    tag = new_tag()
    first = run_client(
        kind, wire, lambda c: c.cancel_after_first(HANG_STREAM, string_value(tag), wrappers_pb2.StringValue)
    )
    assert first.value == "ready"
    assert wire.seen.wait(f"cancelled:{tag}"), "the handler was not cancelled"
    assert not wire.seen.is_set(f"finished:{tag}")


@pytest.mark.parametrize("kind", CLIENTS)
def test_many_concurrent_calls_on_one_connection(wire: WireThread, kind: str) -> None:
    """100 calls at once on one channel: more than max_streams (16), so the client queues some.

    One call goes first: until the server's SETTINGS arrive a client may assume no stream limit,
    and the server refuses what exceeds the limit it advertised (RFC 9113 §5.1.2, REFUSED_STREAM),
    which grpclib does not retry.
    """

    async def script(c: Client) -> list[Outcome]:
        warm = await c.unary(META, string_value("warm-up"), wrappers_pb2.StringValue)
        assert warm.code == "OK", warm
        return list(
            await asyncio.gather(
                *(c.unary(META, string_value(f"call {i}"), wrappers_pb2.StringValue) for i in range(100))
            )
        )

    outs = run_client(kind, wire, script)
    assert all(o.code == "OK" for o in outs), [o for o in outs if o.code != "OK"][:3]
    answers = [json.loads(o.responses[0].value) for o in outs]
    assert [a["echo"] for a in answers] == [f"call {i}" for i in range(100)]
    peers = {a["peer"] for a in answers}
    assert len(peers) == 1, peers  # one connection
    assert next(iter(peers)).startswith("ipv4:127.0.0.1:")


@pytest.mark.parametrize("kind", CLIENTS)
def test_invocation_metadata_and_time_remaining_reach_the_handler(wire: WireThread, kind: str) -> None:
    metadata = (("x-request", "value 1"), ("x-request-bin", b"\x00\x01\xfe\xff"))
    out = run_client(
        kind,
        wire,
        lambda c: c.unary(META, string_value("m"), wrappers_pb2.StringValue, timeout=30, metadata=metadata),
    )
    assert out.code == "OK", out
    answer = json.loads(out.responses[0].value)
    got = {k: v for k, v in answer["metadata"]}
    assert got.get("x-request") == "value 1"
    assert got.get("x-request-bin") == "0001feff"
    assert not any(k.startswith(":") or k in ("grpc-timeout", "content-type", "te") for k in got), got
    assert 0 < answer["time_remaining"] <= 30


def test_health_check_and_watch_through_the_stock_servicer(wire: WireThread) -> None:
    """grpc_health's aio servicer (Watch writes with context.write) served by the wire transport."""

    async def script() -> tuple[int, list[int]]:
        async with client("grpc.aio", wire) as c:
            assert isinstance(c, AioClient)
            stub = health_pb2_grpc.HealthStub(c.channel)
            check = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="probe"))
            states = [(await watch.read()).status]
            wire.submit(lambda: wire.health.set("probe", health_pb2.HealthCheckResponse.SERVING)).result(10)
            states.append((await watch.read()).status)
            watch.cancel()
            return check.status, states

    status, states = asyncio.run(script())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert states == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, health_pb2.HealthCheckResponse.SERVING]


# == 2. raw HTTP/2 ==================================================================================
def _goaway_code(conn: RawH2) -> int | None:
    goaway = conn.goaway()
    return None if goaway is None else goaway.error_code


def test_the_server_opens_with_its_settings_and_acks_ours(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    settings_seen = conn.ready()
    assert settings_seen.get(0x3) == LIMITS.max_streams  # SETTINGS_MAX_CONCURRENT_STREAMS
    assert settings_seen.get(0x6) == LIMITS.max_header_block  # SETTINGS_MAX_HEADER_LIST_SIZE
    assert settings_seen.get(0x2, 0) == 0  # a server never enables push (RFC 9113 §6.5.2)
    assert conn.read_until(
        lambda: any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in conn.frames)
    )


@pytest.mark.parametrize(
    "preface",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", b"PRI * HTTP/1.1\r\n"],
    ids=["http1", "same-length", "short-prefix-mismatch"],
)
def test_a_wrong_preface_is_a_protocol_error(wire: WireThread, raws: RawFactory, preface: bytes) -> None:
    conn = raws(wire, preface=False, settings=False)
    conn.send(preface)
    assert conn.closed()
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_the_first_frame_must_be_settings(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire, settings=False)
    conn.send_frame(PING, 0, 0, b"12345678")
    assert _goaway_code(conn) == PROTOCOL_ERROR
    assert conn.closed()


def test_a_frame_above_16384_bytes_is_a_frame_size_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(HEADERS, END_HEADERS, 1, b"\x00" * 16_385)
    assert _goaway_code(conn) == FRAME_SIZE_ERROR
    assert conn.closed()


def test_data_on_stream_0_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(DATA, 0, 0, b"abc")
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_headers_on_an_even_stream_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(2)
    assert _goaway_code(conn) == PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([frame(SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00")], FLOW_CONTROL_ERROR),  # INITIAL_WINDOW 2^31
        ([frame(SETTINGS, 0, 0, b"\x00\x05\x00\x00\x3f\xff")], PROTOCOL_ERROR),  # MAX_FRAME_SIZE 16383
        ([frame(SETTINGS, 0, 0, b"\x00\x05\x01\x00\x00\x00")], PROTOCOL_ERROR),  # MAX_FRAME_SIZE 2^24
        ([frame(SETTINGS, 0, 0, b"\x00\x02\x00\x00\x00\x02")], PROTOCOL_ERROR),  # ENABLE_PUSH 2
        ([frame(SETTINGS, 0, 0, b"\x00\x04\x00")], FRAME_SIZE_ERROR),  # not a multiple of 6
        ([frame(SETTINGS, 0, 1)], PROTOCOL_ERROR),  # on a stream
        ([frame(SETTINGS, 1, 0, b"\x00\x04\x00\x00\x00\x01")], FRAME_SIZE_ERROR),  # ACK with a payload
        ([frame(PING, 0, 0, b"1234567")], FRAME_SIZE_ERROR),
        ([frame(PING, 0, 1, b"12345678")], PROTOCOL_ERROR),
        ([frame(RST_STREAM, 0, 0, b"\x00\x00\x00\x08")], PROTOCOL_ERROR),
        ([frame(RST_STREAM, 0, 7, b"\x00\x00\x00\x08")], PROTOCOL_ERROR),  # an idle stream (§6.4)
        ([frame(WINDOW_UPDATE, 0, 9, b"\x00\x00\x01\x00")], PROTOCOL_ERROR),  # an idle stream (§5.1)
        ([frame(WINDOW_UPDATE, 0, 0, b"\x00\x01")], FRAME_SIZE_ERROR),
        ([frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02")], PROTOCOL_ERROR),
        ([frame(CONTINUATION, END_HEADERS, 1, b"\x88")], PROTOCOL_ERROR),  # no header block open
        ([frame(PRIORITY, 0, 1, b"\x00\x00")], FRAME_SIZE_ERROR),
        ([frame(DATA, 0, 5, b"\x00\x00\x00\x00\x00")], PROTOCOL_ERROR),  # an idle stream
    ],
    ids=[
        "initial-window-too-large",
        "max-frame-too-small",
        "max-frame-too-large",
        "enable-push-2",
        "settings-length",
        "settings-on-stream",
        "settings-ack-payload",
        "ping-length",
        "ping-on-stream",
        "rst-on-stream-0",
        "rst-on-idle",
        "window-update-idle",
        "window-update-length",
        "push-promise",
        "stray-continuation",
        "priority-length",
        "data-idle",
    ],
)
def test_connection_errors(wire: WireThread, raws: RawFactory, frames: list[bytes], code: int) -> None:
    conn = raws(wire)
    conn.ready()
    conn.send(b"".join(frames))
    assert _goaway_code(conn) == code
    assert conn.closed()


def test_a_frame_inside_a_header_block_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    block = conn.encode(conn.request_headers(ECHO))
    conn.send_frame(HEADERS, 0, 1, block[:3])  # no END_HEADERS
    conn.send_frame(PING, 0, 0, b"12345678")
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_a_continuation_flood_beyond_max_header_block_is_refused(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_header_block=8 * KIB))
    conn = raws(srv)
    block = conn.encode(conn.request_headers(HANG))
    conn.send_frame(HEADERS, 0, 1, block)
    for _ in range(40):  # 160 KiB of header block, never ended
        if not conn.try_send(frame(CONTINUATION, 0, 1, b"\x00" * 4096)):
            break
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()
    assert srv.seen.tags("started:") == set()


def test_empty_continuation_frames_count_against_the_control_frame_bound(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    block = conn.encode(conn.request_headers(HANG))
    conn.send_frame(HEADERS, 0, 1, block)
    for _ in range(200):
        if not conn.try_send(frame(CONTINUATION, 0, 1, b"")):
            break
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM


@pytest.mark.parametrize(
    "flood",
    [
        frame(PING, 0, 0, b"pingpong"),
        frame(SETTINGS, 0, 0),
        frame(0xFA, 0, 0, b"unknown"),
        frame(PRIORITY, 0, 3, bytes(5)),
        frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")),
        frame(SETTINGS, 1, 0),  # unsolicited SETTINGS ACKs
    ],
    ids=["ping", "settings", "unknown-type", "priority", "window-update", "settings-ack"],
)
def test_a_control_frame_flood_is_enhance_your_calm(
    make_wire: WireFactory, raws: RawFactory, flood: bytes
) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    conn.ready()
    conn.try_send(flood * 60)
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()


def test_an_empty_data_flood_is_enhance_your_calm(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    conn.headers(1, conn.request_headers(ECHO_STREAM))
    conn.try_send(frame(DATA, 0, 1) * 60)
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM


def test_requests_reset_the_control_frame_count(make_wire: WireFactory, raws: RawFactory) -> None:
    """Between two requests a client may send max_idle_frames control frames, as often as it likes."""
    srv = make_wire(limits=Limits(max_idle_frames=50))
    conn = raws(srv)
    for sid in (1, 3, 5):
        conn.send(frame(PING, 0, 0, b"pingpong") * 40)
        conn.call(sid, bytes_value(b"%d" % sid).SerializeToString())
        seen = conn.stream(sid)
        assert seen.status == 0, (sid, seen)
    assert conn.sync()
    assert conn.goaway(timeout=0) is None


def test_ping_is_answered_with_ack_and_the_same_payload(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(PING, 0, 0, b"\x01\x02\x03\x04\xfa\xfb\xfc\xfd")

    def acked() -> list[PingFrame]:
        return [f for f in conn.frames if isinstance(f, PingFrame) and "ACK" in f.flags]

    assert conn.read_until(lambda: bool(acked()))
    assert [f.opaque_data for f in acked()] == [b"\x01\x02\x03\x04\xfa\xfb\xfc\xfd"]
    assert acked()[0].stream_id == 0


def test_unknown_frame_types_are_ignored(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(0xFA, 0x0F, 0, b"extension")
    conn.send_frame(0x21, 0, 1, b"on an idle stream")
    conn.call(1, bytes_value(b"still fine").SerializeToString())
    assert conn.stream(1).status == 0
    assert conn.goaway(timeout=0) is None


def test_a_window_update_of_0_on_the_connection_is_a_protocol_error(
    wire: WireThread, raws: RawFactory
) -> None:
    conn = raws(wire)
    conn.send_frame(WINDOW_UPDATE, 0, 0, (0).to_bytes(4, "big"))
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_a_window_update_overflowing_the_connection_window_is_a_flow_control_error(
    wire: WireThread, raws: RawFactory
) -> None:
    conn = raws(wire)
    conn.send_frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big"))  # 65,535 + 2^31 - 1
    assert _goaway_code(conn) == FLOW_CONTROL_ERROR


def test_stream_window_errors_reset_only_the_stream(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    tags = [new_tag(), new_tag()]
    for sid, tag in zip((1, 3), tags, strict=True):
        conn.headers(sid, conn.request_headers(HANG))
        conn.message(sid, sv(tag))
    assert wire.seen.wait(f"started:{tags[0]}") and wire.seen.wait(f"started:{tags[1]}")
    conn.send_frame(WINDOW_UPDATE, 0, 1, (2**31 - 1).to_bytes(4, "big"))  # overflows stream 1's window
    conn.send_frame(WINDOW_UPDATE, 0, 3, (0).to_bytes(4, "big"))
    assert conn.stream(1).reset == FLOW_CONTROL_ERROR
    assert conn.stream(3).reset == PROTOCOL_ERROR
    assert wire.seen.wait(f"cancelled:{tags[0]}") and wire.seen.wait(f"cancelled:{tags[1]}")
    conn.call(5, bytes_value(b"the connection lives").SerializeToString())
    assert conn.stream(5).status == 0


def test_streams_beyond_max_streams_are_refused(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(max_streams=4))
    conn = raws(srv)
    assert conn.ready().get(0x3) == 4
    tags = {sid: new_tag() for sid in (1, 3, 5, 7, 9, 11)}
    for sid, tag in tags.items():
        conn.headers(sid, conn.request_headers(HANG))
        conn.message(sid, sv(tag))
    assert conn.sync()
    assert conn.streams.get(9) is not None and conn.streams[9].reset == REFUSED_STREAM
    assert conn.streams.get(11) is not None and conn.streams[11].reset == REFUSED_STREAM
    for sid in (1, 3, 5, 7):
        assert srv.seen.wait(f"started:{tags[sid]}"), sid
        assert sid not in conn.streams, conn.streams[sid]
    assert not srv.seen.is_set(f"started:{tags[9]}") and not srv.seen.is_set(f"started:{tags[11]}")
    # A slot freed by a reset is usable again.
    conn.send_frame(RST_STREAM, 0, 1, CANCEL.to_bytes(4, "big"))
    tag = new_tag()
    conn.headers(13, conn.request_headers(HANG))
    conn.message(13, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    assert srv.seen.wait(f"cancelled:{tags[1]}")


def test_rapid_reset_is_enhance_your_calm_and_leaves_no_handler_running(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    """CVE-2023-44487: HEADERS then RST_STREAM, over and over, makes the server start and cancel
    a call for every pair without ever holding max_streams; it must be stopped like a flood."""
    srv = make_wire(limits=Limits(max_idle_frames=100))
    conn = raws(srv)
    conn.ready()
    pairs = 2000
    burst = bytearray()
    for i in range(pairs):
        sid, body = 2 * i + 1, sv(f"rr{i}")
        burst += frame(HEADERS, END_HEADERS, sid, conn.encode(conn.request_headers(HANG)))
        burst += frame(DATA, 0, sid, b"\x00" + len(body).to_bytes(4, "big") + body)
        burst += frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big"))
    for i in range(0, len(burst), 64 * KIB):
        if not conn.try_send(bytes(burst[i : i + 64 * KIB])):
            break
    conn.sync()
    goaway = conn.goaway(timeout=2)
    left = srv.wait_no_handlers()
    started = len(srv.seen.tags("started:rr"))
    assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM, (
        f"{pairs} HEADERS+RST_STREAM pairs: no GOAWAY ENHANCE_YOUR_CALM ({goaway}); "
        f"{started} handlers were started and cancelled"
    )
    assert conn.closed()
    assert left == 0, f"{left} handler tasks still running"


def test_an_expired_call_waiting_for_a_request_message_does_not_leak(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    """A streaming call whose grpc-timeout passes while its handler waits for the next request
    message: the handler must end (and nothing of the call stay behind once the client is gone)."""
    srv = make_wire()
    conn = raws(srv)
    conn.headers(1, conn.request_headers(ECHO_STREAM, extra=[("grpc-timeout", "200m")]))
    seen = conn.stream(1)
    assert seen.status == 4, seen  # DEADLINE_EXCEEDED
    conn.close()
    assert srv.wait_no_handlers(timeout=3) == 0, "the handler waits forever for a message"


def test_request_bytes_buffered_beyond_max_buffered_are_enhance_your_calm(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(max_buffered=100_000, max_message=1024 * KIB))
    conn = raws(srv)
    conn.ready()
    part = b"\x00" + (900_000).to_bytes(4, "big") + b"p" * 40_000  # a message that never completes
    for sid in (1, 3, 5):
        conn.headers(sid, conn.request_headers(ECHO))
        if not conn.try_send(frame(DATA, 0, sid, part[:16_000]) + frame(DATA, 0, sid, part[16_000:32_000])):
            break
        conn.try_send(frame(DATA, 0, sid, part[32_000:]))
    assert _goaway_code(conn) == ENHANCE_YOUR_CALM
    assert conn.closed()


def test_a_reset_stream_gives_back_its_buffered_bytes(make_wire: WireFactory, raws: RawFactory) -> None:
    """Partial uploads that the client cancels must not add up against max_buffered forever."""
    srv = make_wire(limits=Limits(max_buffered=100_000, max_message=1024 * KIB))
    conn = raws(srv)
    conn.ready()
    part = b"\x00" + (900_000).to_bytes(4, "big") + b"p" * 40_000
    for sid in (1, 3, 5, 7, 9):  # 200,000 bytes sent in all, never more than 40,005 held
        block = conn.encode(conn.request_headers(ECHO))
        conn.try_send(
            frame(HEADERS, END_HEADERS, sid, block)
            + frame(DATA, 0, sid, part[:16_000])
            + frame(DATA, 0, sid, part[16_000:32_000])
            + frame(DATA, 0, sid, part[32_000:])
            + frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big"))
        )
        if not conn.sync():
            break
    goaway = conn.goaway(timeout=0)
    assert goaway is None, f"stream {sid}: GOAWAY {goaway.error_code}: {goaway.additional_data!r}"
    conn.call(11, bytes_value(b"fine").SerializeToString())
    assert conn.stream(11).status == 0


@pytest.mark.parametrize(
    "headers",
    [
        [(":method", "GET"), (":scheme", "https"), (":path", ECHO), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), ("content-type", "application/grpc")],
        [(":method", "POST"), (":path", ECHO), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), (":path", "Echo"), ("content-type", "application/grpc")],
        [(":method", "POST"), (":scheme", "https"), ("content-type", "application/grpc"), (":path", ECHO)],
        [(":method", "POST"), (":method", "POST"), (":scheme", "https"), (":path", ECHO)],
        [(":method", "POST"), (":scheme", "https"), (":path", ECHO), ("Content-Type", "application/grpc")],
    ],
    ids=[
        "get",
        "no-path",
        "no-scheme",
        "relative-path",
        "pseudo-after-regular",
        "duplicate-pseudo",
        "uppercase",
    ],
)
def test_a_malformed_request_is_reset_with_protocol_error(
    wire: WireThread, raws: RawFactory, headers: list[tuple[str, str]]
) -> None:
    conn = raws(wire)
    conn.headers(1, headers)
    conn.message(1, bytes_value(b"x").SerializeToString())
    assert conn.stream(1).reset == PROTOCOL_ERROR
    conn.call(3, bytes_value(b"the connection lives").SerializeToString())
    assert conn.stream(3).status == 0


@pytest.mark.parametrize(
    "extra", [[("connection", "keep-alive")], [("te", "gzip")]], ids=["connection-header", "te-not-trailers"]
)
def test_connection_specific_fields_are_malformed(
    wire: WireThread, raws: RawFactory, extra: list[tuple[str, str]]
) -> None:
    """RFC 9113 §8.2.2: a request with a connection-specific field, or TE other than "trailers",
    MUST be treated as malformed (a stream error of type PROTOCOL_ERROR, §8.1.1)."""
    conn = raws(wire)
    headers = [h for h in conn.request_headers(ECHO) if h[0] != "te"] + extra
    conn.headers(1, headers)
    conn.message(1, bytes_value(b"x").SerializeToString())
    assert conn.stream(1).reset == PROTOCOL_ERROR


@pytest.mark.parametrize("content_type", ["application/json", None], ids=["json", "missing"])
def test_a_request_that_is_not_grpc_gets_an_error(
    wire: WireThread, raws: RawFactory, content_type: str | None
) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, content_type=content_type))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.done
    http_status = seen.headers.get(b":status")
    assert http_status != b"200" or (seen.status is not None and seen.status != 0), seen


def test_grpc_encoding_gzip_is_unimplemented(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, extra=[("grpc-encoding", "gzip")]))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.status == 12, seen  # UNIMPLEMENTED


def test_grpc_encoding_gzip_is_answered_with_grpc_accept_encoding(
    wire: WireThread, raws: RawFactory
) -> None:
    """gRPC doc/compression.md: a request compressed with an algorithm the server does not support
    ends UNIMPLEMENTED, and the server includes grpc-accept-encoding (what it does accept)."""
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO, extra=[("grpc-encoding", "gzip")]))
    conn.message(1, bytes_value(b"x").SerializeToString())
    seen = conn.stream(1)
    assert seen.status == 12, seen
    accepted = b",".join(v for block in seen.blocks for n, v in block if n == b"grpc-accept-encoding")
    assert b"identity" in accepted, seen.blocks


def test_a_compressed_message_without_grpc_encoding_is_internal(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.message(1, bytes_value(b"x").SerializeToString(), compressed=True)
    seen = conn.stream(1)
    assert seen.status == 13, seen  # INTERNAL


def test_a_unary_request_without_a_message_is_an_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO), end_stream=True)
    seen = conn.stream(1)
    assert seen.status == 13, seen  # INTERNAL


def test_a_request_ending_inside_a_message_is_internal(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.send_frame(DATA, END_STREAM, 1, b"\x00\x00\x00\x00\x10abc")  # declares 16 bytes, sends 3
    assert conn.stream(1).status == 13


def test_padded_and_prioritised_frames_are_parsed(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    block = conn.encode(conn.request_headers(ECHO))
    # HEADERS: PADDED | PRIORITY | END_HEADERS, 7 bytes of padding, a priority of 5 bytes.
    conn.send_frame(
        HEADERS, 0x8 | 0x20 | END_HEADERS, 1, b"\x07" + b"\x00\x00\x00\x00\x10" + block + bytes(7)
    )
    body = wrappers_pb2.BytesValue(value=b"padded").SerializeToString()
    msg = b"\x00" + len(body).to_bytes(4, "big") + body
    conn.send_frame(DATA, 0x8 | END_STREAM, 1, b"\x03" + msg + bytes(3))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [wrappers_pb2.BytesValue.FromString(m).value for m in seen.messages()] == [b"padded"]


def test_client_trailers_end_the_request(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(ECHO))
    conn.message(1, bytes_value(b"with trailers").SerializeToString(), end_stream=False)
    conn.send_frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.encode([("x-client-trailer", "1")]))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [wrappers_pb2.BytesValue.FromString(m).value for m in seen.messages()] == [b"with trailers"]


def test_a_second_headers_without_end_stream_is_a_protocol_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.headers(1, conn.request_headers(HANG))
    conn.send_frame(HEADERS, END_HEADERS, 1, conn.encode([("x-more", "1")]))
    assert _goaway_code(conn) == PROTOCOL_ERROR


def test_data_after_end_stream_is_stream_closed(wire: WireThread, raws: RawFactory) -> None:
    """RFC 9113 §5.1: DATA on a half-closed (remote) stream is a stream error STREAM_CLOSED."""
    conn = raws(wire)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))  # END_STREAM
    assert wire.seen.wait(f"started:{tag}")
    conn.send_frame(DATA, 0, 1, b"\x00\x00\x00\x00\x00")
    assert conn.stream(1).reset == 0x5  # STREAM_CLOSED
    assert wire.seen.wait(f"cancelled:{tag}")


def test_headers_on_a_lower_stream_id_is_a_connection_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.call(5, bytes_value(b"five").SerializeToString())
    assert conn.stream(5).status == 0
    conn.call(3, bytes_value(b"three").SerializeToString())
    assert _goaway_code(conn) in (PROTOCOL_ERROR, 0x5)  # §5.1.1, or STREAM_CLOSED (§5.1)


def test_the_server_respects_the_clients_windows_and_resumes(wire: WireThread, raws: RawFactory) -> None:
    """With SETTINGS_INITIAL_WINDOW_SIZE 0 nothing may be sent; raising it releases the response."""
    conn = raws(wire, settings=False, auto_window=False)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED))
    conn.message(1, wrappers_pb2.Int64Value(value=5000).SerializeToString())
    conn.read_for(0.3)
    assert not any(isinstance(f, DataFrame) and f.data for f in conn.frames)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (65_535).to_bytes(4, "big"))
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert [len(wrappers_pb2.BytesValue.FromString(m).value) for m in seen.messages()] == [5000]


def test_a_small_client_window_still_gets_the_whole_response(wire: WireThread, raws: RawFactory) -> None:
    """A client may advertise a window smaller than a frame (RFC 9113 §6.9.2: any value up to
    2^31-1) and credit only what it has received; the server must send DATA that fits."""
    conn = raws(wire, settings=False)  # auto_window: credits every DATA frame as it arrives
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (4096).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED))
    conn.message(1, wrappers_pb2.Int64Value(value=20_000).SerializeToString())
    seen = conn.stream(1, timeout=5)
    assert seen.status == 0, f"stalled with {len(seen.data)} bytes received"
    assert [len(wrappers_pb2.BytesValue.FromString(m).value) for m in seen.messages()] == [20_000]


def test_large_responses_use_frames_no_larger_than_16384(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.call(1, wrappers_pb2.Int64Value(value=300 * KIB).SerializeToString(), path=SIZED)
    seen = conn.stream(1)
    assert seen.status == 0
    sizes = [len(f.data) for f in conn.frames if isinstance(f, DataFrame)]
    assert max(sizes) <= 16_384 and sum(sizes) > 300 * KIB


def test_the_server_enforces_grpc_timeout_and_cancels_the_handler(
    wire: WireThread, raws: RawFactory
) -> None:
    """A client that never resets its call: the server's own deadline ends it, and the handler."""
    conn = raws(wire)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG, extra=[("grpc-timeout", "200m")]))
    conn.message(1, sv(tag))
    seen = conn.stream(1)
    assert seen.status == 4, seen  # DEADLINE_EXCEEDED
    assert conn.sync()
    assert wire.seen.wait(f"cancelled:{tag}", 5), "the handler still runs after its deadline"


def test_a_deadline_while_the_response_waits_for_the_window_ends_the_stream(
    wire: WireThread, raws: RawFactory
) -> None:
    """The client gives no window, so the response cannot leave; its deadline must still end the
    call: DEADLINE_EXCEEDED if the trailers can go, otherwise a reset, never a stream left open."""
    conn = raws(wire, settings=False, auto_window=False)
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
    conn.headers(1, conn.request_headers(SIZED, extra=[("grpc-timeout", "200m")]))
    conn.message(1, wrappers_pb2.Int64Value(value=5000).SerializeToString())
    seen = conn.stream(1, timeout=5)
    assert seen.done, seen
    assert seen.status == 4 if seen.ended else seen.reset == CANCEL, seen
    conn.send_frame(SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (65_535).to_bytes(4, "big"))
    assert conn.sync()
    assert not any(isinstance(f, DataFrame) and f.stream_id == 1 and f.data for f in conn.frames)


def test_maximum_concurrent_rpcs_holds_for_a_burst(make_wire: WireFactory, raws: RawFactory) -> None:
    """Four calls in one TLS record against a server capped at two RPCs: two run, two are refused."""
    srv = make_wire(maximum_concurrent_rpcs=2)
    conn = raws(srv)
    conn.ready()
    tags = {sid: new_tag() for sid in (1, 3, 5, 7)}
    burst = b""
    for sid, tag in tags.items():
        burst += frame(HEADERS, END_HEADERS, sid, conn.encode(conn.request_headers(HANG)))
        burst += frame(DATA, END_STREAM, sid, b"\x00" + len(sv(tag)).to_bytes(4, "big") + sv(tag))
    conn.send(burst)
    conn.read_until(lambda: sum(1 for s in conn.streams.values() if s.done) >= 2, timeout=5)
    conn.sync()
    refused = [sid for sid, s in conn.streams.items() if s.status == 8]
    started = {sid for sid, tag in tags.items() if srv.seen.is_set(f"started:{tag}")}
    assert len(started) <= 2, f"{len(started)} handlers ran at once (refused: {refused})"
    assert len(refused) == 2


# -- HPACK: the first-block memo --------------------------------------------------------------------
def test_the_first_block_memo_keeps_the_dynamic_table_of_every_connection(
    wire: WireThread, raws: RawFactory
) -> None:
    """Five connections send the same first header block (a fleet's agents); a second request on
    two of them refers to the first block's dynamic-table entries and must decode the same."""
    unique = new_tag()
    fleet = [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", META),
        (":authority", "nodeserver.example:8081"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("x-fleet", unique),
        ("x-node", "same for all"),
    ]
    encoder = hpack.Encoder()
    first = encoder.encode(fleet)
    second = encoder.encode([*fleet, ("x-second", "two")])
    assert len(second) < len(first) // 2  # indexed fields: it refers to the first block's entries
    conns = [raws(wire) for _ in range(5)]
    for i, conn in enumerate(conns):
        conn.send_frame(HEADERS, END_HEADERS, 1, first)
        conn.message(1, sv(f"first {i}"))
    for i, conn in enumerate(conns):
        seen = conn.stream(1)
        assert seen.status == 0, (i, seen)
        answer = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)
        assert answer["echo"] == f"first {i}"
        assert ["x-fleet", unique] in answer["metadata"] and ["x-node", "same for all"] in answer["metadata"]
    for i in (0, 3):  # the connection that decoded the block, and one that found it in the memo
        conns[i].send_frame(HEADERS, END_HEADERS, 3, second)
        conns[i].message(3, sv(f"second {i}"))
        seen = conns[i].stream(3)
        assert seen.status == 0, (i, seen)
        answer = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)
        assert answer["echo"] == f"second {i}"
        md = answer["metadata"]
        assert (
            ["x-fleet", unique] in md and ["x-node", "same for all"] in md and ["x-second", "two"] in md
        ), md
    # A third block on a memo connection still decodes (the decoder's state carried on).
    third = encoder.encode([*fleet, ("x-second", "two"), ("x-third", "3")])
    conns[3].send_frame(HEADERS, END_HEADERS, 5, third)
    conns[3].message(5, sv("third"))
    seen = conns[3].stream(5)
    md = json.loads(wrappers_pb2.StringValue.FromString(seen.messages()[0]).value)["metadata"]
    assert ["x-third", "3"] in md and ["x-fleet", unique] in md


def test_a_bad_header_block_is_a_compression_error(wire: WireThread, raws: RawFactory) -> None:
    conn = raws(wire)
    conn.send_frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\x7f")  # index out of any table
    assert _goaway_code(conn) == 0x9  # COMPRESSION_ERROR


# -- TLS and connection lifetime ---------------------------------------------------------------------
@pytest.mark.parametrize("alpn", [None, ["http/1.1"]], ids=["no-alpn", "http1.1"])
def test_a_tls_client_without_alpn_h2_is_closed(wire: WireThread, alpn: list[str] | None) -> None:
    raw = socket.create_connection((wire.host, wire.port), timeout=10)
    try:
        try:
            sock = client_context(wire.bundle, alpn=alpn).wrap_socket(raw, server_hostname=None)
        except OSError:
            return  # refused in the handshake itself: closed too
        assert sock.selected_alpn_protocol() is None
        with suppress(OSError):
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        assert peer_closed(sock, within=10)
    finally:
        raw.close()


def test_an_idle_connection_gets_goaway_no_error_and_is_closed(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(limits=Limits(idle_s=0.3))
    conn = raws(srv)
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert conn.closed()


def test_a_connection_with_a_call_open_is_not_idle(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire(limits=Limits(idle_s=0.3))
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    conn.read_for(1.0)  # more than three idle periods
    assert conn.goaway(timeout=0) is None and not conn.eof
    conn.send_frame(RST_STREAM, 0, 1, CANCEL.to_bytes(4, "big"))  # the call ends: idle from now
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert srv.seen.wait(f"cancelled:{tag}")


def test_connections_over_max_connections_are_closed_before_the_handshake(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire(max_connections=2, handshake_timeout=60.0)
    first, second = raws(srv), raws(srv)
    assert first.ready() and second.ready()
    extra = socket.create_connection((srv.host, srv.port), timeout=10)
    try:
        # handshake_timeout is 60 s: a close now is the cap, not the handshake deadline.
        assert closed_by_peer(extra, within=15)
    finally:
        extra.close()
    first.close()
    for _ in range(100):  # the slot comes back once the server has seen the close
        try:
            third = raws(srv)
        except OSError:
            time.sleep(0.05)
            continue
        if third.ready(timeout=2):
            break
    else:
        pytest.fail("no new connection was accepted after one of the two closed")
    third.call(1, bytes_value(b"in").SerializeToString())
    assert third.stream(1).status == 0


def test_silent_connections_count_against_max_connections(make_wire: WireFactory) -> None:
    srv = make_wire(max_connections=2, handshake_timeout=60.0)
    silent = silent_connections(srv.host, srv.port, 3)
    try:
        assert len(silent) == 3
        assert closed_by_peer(silent[2], within=15)
    finally:
        for s in silent:
            s.close()


def test_a_connection_that_never_says_hello_is_closed_after_handshake_timeout(
    make_wire: WireFactory,
) -> None:
    srv = make_wire(handshake_timeout=0.3)
    silent = socket.create_connection((srv.host, srv.port), timeout=10)
    try:
        assert closed_by_peer(silent, within=15)
    finally:
        silent.close()
    conn = srv.raw()  # and the server still serves
    try:
        conn.call(1, bytes_value(b"x").SerializeToString())
        assert conn.stream(1).status == 0
    finally:
        conn.close()


# == 3. stop, ports, IPv6 ===========================================================================
def test_stop_ends_in_flight_calls_and_closes_connections(make_wire: WireFactory, raws: RawFactory) -> None:
    srv = make_wire()
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(HANG))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")

    async def stop() -> tuple[bool, int]:
        await srv.server.stop(0.2)
        # When stop() returns, the calls it ended have ended: nothing runs after the server
        # is gone (ServerApp.stop closes the audit log and the store next).
        return srv.seen.is_set(f"cancelled:{tag}"), running_handlers()

    cancelled, running = srv.call(stop)
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR
    assert conn.closed()
    srv.call(srv.server.wait_for_termination, timeout=5)
    with pytest.raises(OSError):
        socket.create_connection((srv.host, srv.port), timeout=5).close()
    assert srv.seen.wait(f"cancelled:{tag}"), "the in-flight handler was never cancelled"
    assert (cancelled, running) == (True, 0), "stop() returned while a handler was still running"


def test_stop_with_grace_lets_calls_finish_and_refuses_new_streams(
    make_wire: WireFactory, raws: RawFactory
) -> None:
    srv = make_wire()
    conn = raws(srv)
    tag = new_tag()
    conn.headers(1, conn.request_headers(SLOW))
    conn.message(1, sv(tag))
    assert srv.seen.wait(f"started:{tag}")
    stopping = srv.submit(lambda: srv.server.stop(30))
    goaway = conn.goaway()
    assert goaway is not None and goaway.error_code == NO_ERROR and goaway.last_stream_id == 1
    conn.call(3, sv("late"), path=SLOW)
    assert conn.stream(3).reset == REFUSED_STREAM
    seen = conn.stream(1)
    assert seen.status == 0, seen
    assert wrappers_pb2.StringValue.FromString(seen.messages()[0]).value == f"done {tag}"
    assert conn.closed()
    stopping.result(10)


def test_add_secure_port_returns_0_for_an_address_it_cannot_bind(
    make_wire: WireFactory, tmp_path: Path
) -> None:
    srv = make_wire()
    tls = server_tls(srv.svid, tmp_path / "data0")
    server = WireServer(limits=LIMITS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        in_use = taken.getsockname()[1]
        assert server.add_secure_port(f"127.0.0.1:{in_use}", tls) == 0
    assert server.add_secure_port("192.0.2.1:0", tls) == 0  # TEST-NET-1: not an address of this host
    assert server.add_secure_port("127.0.0.1:port", tls) == 0
    assert server.add_secure_port("127.0.0.1:70000", tls) == 0
    bound = server.add_secure_port("127.0.0.1:0", tls)
    assert bound > 0
    with socket.create_connection(("127.0.0.1", bound), timeout=5):
        pass  # listening (the kernel's backlog accepts before start())

    async def close() -> None:
        await server.stop(0)

    srv.call(close)


def test_ipv6_loopback(make_wire: WireFactory, tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        has_ipv6 = True
    except OSError:
        has_ipv6 = False
    if not has_ipv6:
        srv = make_wire()
        server = WireServer(limits=LIMITS)
        assert server.add_secure_port("[::1]:0", server_tls(srv.svid, tmp_path / "data0")) == 0
        return
    srv = make_wire(address="[::1]:0")
    assert srv.host == "::1" and srv.port > 0
    for kind in CLIENTS:
        out = run_client(kind, srv, lambda c: c.unary(META, string_value("v6"), wrappers_pb2.StringValue))
        assert out.code == "OK", (kind, out)
        assert json.loads(out.responses[0].value)["peer"].startswith("ipv6:[::1]:"), kind


# == 4. units, decoded by hpack ====================================================================
def _decode(block: bytes) -> list[tuple[bytes, bytes]]:
    decoder = hpack.Decoder(max_header_list_size=1 << 23)  # the default stops at 64 KiB
    return [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]


def _b64(value: bytes) -> bytes:
    return base64.b64decode(value + b"=" * (-len(value) % 4))


def test_trailers_decode_to_status_message_and_metadata() -> None:
    block = trailers(9, ABORT_MESSAGE, [("X-Mixed-Case", "v"), *ABORT_TRAILING])
    fields = _decode(block)
    assert fields[0] == (b"grpc-status", b"9")
    assert fields[1][0] == b"grpc-message"
    assert urllib.parse.unquote_to_bytes(fields[1][1]) == ABORT_MESSAGE.encode()
    assert all(0x20 <= b <= 0x7E for b in fields[1][1])
    rest = dict(fields[2:])
    assert rest[b"x-mixed-case"] == b"v"
    for key, value in ABORT_TRAILING:
        wire_value = rest[key.encode()]
        if key.endswith("-bin"):
            assert b"=" not in wire_value  # unpadded, as the gRPC spec says implementations should emit
            assert _b64(wire_value) == value
        else:
            assert wire_value == str(value).encode()


def test_trailers_without_a_message_and_a_long_message() -> None:
    assert _decode(trailers(0)) == [(b"grpc-status", b"0")]
    long = _decode(trailers(2, "é" * 5000))
    assert urllib.parse.unquote_to_bytes(long[1][1]).decode() == "é" * 1024


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"1S", 1.0),
        (b"250m", 0.25),
        (b"5M", 300.0),
        (b"2H", 7200.0),
        (b"1500u", 0.0015),
        (b"99999999n", 0.099999999),
        (b"0S", 0.0),
        (b"12345678S", 12345678.0),
    ],
)
def test_parse_timeout(value: bytes, seconds: float) -> None:
    parsed = parse_timeout(value)
    assert parsed is not None and parsed == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [b"", b"S", b"1", b"123456789S", b"1s", b"1.5S", b"-1S", b"+1S", b" 1S", b"1x", b"\xd9\xa1S", b"1SS"],
)
def test_parse_timeout_refuses_what_is_not_a_grpc_timeout(value: bytes) -> None:
    assert parse_timeout(value) is None


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_percent_encoding_round_trips(message: str) -> None:
    encoded = _percent(message)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert urllib.parse.unquote_to_bytes(encoded) == message.encode("utf-8", "replace")
    for escape in encoded.split(b"%")[1:]:  # every % starts a %XX of upper-case hex digits
        assert len(escape) >= 2 and all(c in b"0123456789ABCDEF" for c in escape[:2]), encoded


def test_percent_encoding_of_examples() -> None:
    assert _percent("plain ascii ~!") == b"plain ascii ~!"
    assert _percent("100%") == b"100%25"
    assert _percent("é") == b"%C3%A9"
    assert _percent("a\nb\x7f") == b"a%0Ab%7F"


@given(st.binary(min_size=1, max_size=400), st.binary(max_size=20_000))
@settings(max_examples=200, deadline=None)
def test_literal_decodes_with_hpack(name: bytes, value: bytes) -> None:
    decoder = hpack.Decoder()
    assert [(bytes(n), bytes(v)) for n, v in decoder.decode(literal(name, value), raw=True)] == [
        (name, value)
    ]
    assert len(decoder.header_table.dynamic_entries) == 0  # "without indexing": the table stays empty


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 255, 16_383, 16_384, 2**21])
def test_literal_integer_boundaries(size: int) -> None:
    name, value = b"n" * max(size % 300, 1), b"v" * size
    assert _decode(literal(name, value)) == [(name, value)]


def test_the_response_header_block_decodes() -> None:
    fields = _decode(wire_headers.TABLE_SIZE_ZERO + wire_headers.RESPONSE_HEADERS + trailers(0))
    assert fields == [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"0")]


def test_frames_decode_with_hyperframe() -> None:
    from hyperframe.frame import Frame

    raw = wire_h2.frame(wire_h2.PING, wire_h2.FLAG_ACK, 0, b"abcdefgh")
    parsed, length = Frame.parse_frame_header(memoryview(raw[:9]))
    parsed.parse_body(memoryview(raw[9 : 9 + length]))
    assert isinstance(parsed, PingFrame) and "ACK" in parsed.flags and parsed.opaque_data == b"abcdefgh"
    raw = wire_h2.frame(wire_h2.RST_STREAM, 0, 7, (8).to_bytes(4, "big"))
    parsed, length = Frame.parse_frame_header(memoryview(raw[:9]))
    parsed.parse_body(memoryview(raw[9:]))
    assert isinstance(parsed, RstStreamFrame) and parsed.stream_id == 7 and parsed.error_code == 8
