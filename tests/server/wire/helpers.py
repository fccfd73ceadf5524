"""The wire transport's test bench: a WireServer in a thread serving a small test service, and clients.

A :class:`WireThread` runs a :class:`WireServer` on its own event loop in a thread, serving a small
test service (``test.Wire``, built with grpc's generic handlers from protobuf wrapper messages)
and the stock grpc health servicer, over TLS with a throwaway CA. The tests talk to it with
gRPC's C core (``grpc.aio``), with grpclib (the agent's client) and with hand-built HTTP/2
frames (tests/support/h2raw.py), whose answers ``hyperframe`` and ``hpack`` decode: the
ecosystem's parsers are the oracle. Bounds are made small (``Limits``) rather than waited for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import itertools
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import message as _message
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from server.app import server_tls
from server.ca import CertificateAuthority, ServerSvid
from server.wire.h2 import Limits
from server.wire.server import WireServer
from tests.support.h2raw import (
    RawH2,
)

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


class RawFactory(Protocol):
    def __call__(self, srv: WireThread, **kwargs: Any) -> RawH2: ...


WireFactory = Callable[..., WireThread]
