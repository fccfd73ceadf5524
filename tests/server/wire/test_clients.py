"""server/wire against real clients: gRPC's C core (grpc.aio) and grpclib (the agent's)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.wire.helpers import (
    ABORT,
    ABORT_MESSAGE,
    ABORT_TRAILING,
    CLIENTS,
    COUNT,
    ECHO,
    ECHO_STREAM,
    HANG,
    HANG_STREAM,
    KIB,
    MAX_SEND,
    META,
    SERVICE,
    SIZED,
    AioClient,
    Client,
    Outcome,
    WireThread,
    bytes_value,
    client,
    new_tag,
    run_client,
    string_value,
)

pytestmark = pytest.mark.timeout(180)


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
