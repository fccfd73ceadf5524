"""Where the server's RPCs meet the wire: admission, decoding, audit, metrics and error mapping.

Every RPC the server serves is registered through :func:`register`, which builds gRPC method
handlers from the service's protobuf descriptor and wraps each implementation so that, for
every attempt, in this order:

1. the caller's address is admitted or refused by :class:`server.limits.PeerLimits` before a
   byte of its request is parsed (``RESOURCE_EXHAUSTED``, reasons ``peer_limit`` and
   ``rate_limited``, with a ``RetryInfo``);
2. the request is decoded by a deserializer that never raises: a message that is not a valid
   protobuf of its type, or larger than ``max_message_bytes``, reaches the implementation as an
   :class:`Undecodable` and is refused with ``INVALID_ARGUMENT``/``malformed_message`` or
   ``RESOURCE_EXHAUSTED``/``message_too_large``;
3. a :class:`server.errors.ServerError` becomes its gRPC status, a message for people (never a
   server path: server-side detail goes to the log only) and the structured details of
   :mod:`protocol.status_details` (the reason slug, SPIRE's own details where SPIRE has them);
   anything else becomes ``INTERNAL`` with no exception text, and a traceback in the log;
4. exactly one audit line and one metrics sample are written, whatever happens: an
   implementation writes its success line itself with :meth:`Call.commit` (so that it can do so
   in the same worker-thread step as the store write it reports), and the boundary writes every
   other outcome. When the audit line cannot be written the answer is ``UNAVAILABLE``/
   ``audit_unavailable``: nothing is granted without a trail.

This is the only place that maps errors to statuses; the services raise and return.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import message_factory

from protocol import reasons, status_details
from server.audit import AuditLog, AuditUnavailableError, bound
from server.errors import InvalidRequestError, PayloadTooLargeError, ServerError
from server.limits import PeerLimits, peer_key
from server.metrics import Metrics

log = logging.getLogger(__name__)

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(frozen=True)
class Undecodable:
    """A request message that could not be decoded; the implementation refuses it."""

    reason: str  # "malformed_message" or "message_too_large"
    size: int

    def error(self, what: str) -> ServerError:
        if self.reason == "message_too_large":
            return PayloadTooLargeError(
                f"{what}: a message of {self.size} bytes exceeds this server's limit", reason=self.reason
            )
        return InvalidRequestError(f"{what}: not a valid protobuf message of its type", reason=self.reason)


def tolerant_deserializer(cls: type[_message.Message], max_bytes: int) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        if len(raw) > max_bytes:
            return Undecodable("message_too_large", len(raw))
        msg = cls()
        try:
            msg.ParseFromString(raw)
        except (_message.DecodeError, RecursionError, ValueError):
            return Undecodable("malformed_message", len(raw))
        return msg

    return decode


class CallCancelled(Exception):
    """Raised in a worker thread step that sees its call was cancelled before it committed."""


@dataclass
class Call:
    """One RPC attempt: who, what, and the fields of its audit line.

    An implementation grants what it grants inside ``with call.committing():`` and writes its
    success line there with :meth:`commit`. If the client cancels before the section starts,
    :class:`CallCancelled` is raised and nothing is granted (the boundary writes the
    ``cancelled`` line); once it has started, the grant and its line complete, and the
    ``on_cancel`` callbacks registered inside the section undo what nobody will receive (the
    join broker revokes the token), run by whichever side finishes last. The lock is held only
    for a few assignments, never across the grant, so a cancellation never waits on a database
    or a token backend.
    """

    method: str
    event: str
    peer: str
    boundary: Boundary
    started: float = field(default_factory=time.monotonic)
    fields: dict[str, Any] = field(default_factory=dict)
    committed: bool = False
    cancelled: bool = False
    on_cancel: list[Callable[[], None]] = field(default_factory=list)
    _in_commit: bool = False
    _undone: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)

    @contextmanager
    def committing(self) -> Iterator[None]:
        with self._lock:
            if self.cancelled:
                raise CallCancelled(self.method)
            self._in_commit = True
        try:
            yield
        finally:
            self._end_commit()

    def _end_commit(self) -> None:
        with self._lock:
            self._in_commit = False
            undo = self.cancelled and self.committed and not self._undone
            self._undone = self._undone or undo
            orphan = self.cancelled and not self.committed
        if undo:
            self._run_undo()
        if orphan:  # the client left and the grant failed: nobody else writes this attempt's line
            self.boundary.cancelled_line(self)

    def commit(self, reason: str, message: str) -> None:
        """Write the success line; raises AuditUnavailableError (then nothing may be granted)."""
        if self.committed:
            raise AssertionError(f"{self.method}: committed twice")
        self.boundary.write(self, "ok", reason, "OK", message)
        with self._lock:
            self.committed = True

    def client_cancelled(self) -> bool:
        """The client went away: True if the attempt's line is (or will be) written by the grant."""
        with self._lock:
            self.cancelled = True
            if self._in_commit:
                return True
            undo = self.committed and not self._undone
            self._undone = self._undone or undo
            committed = self.committed
        if undo:
            self._run_undo()
        return committed

    def _run_undo(self) -> None:
        for undo in self.on_cancel:
            try:
                undo()
            except Exception:
                log.exception("%s: undoing a cancelled call failed", self.method)


@dataclass(frozen=True)
class Method:
    """How the boundary serves one RPC of a service.

    ``handler`` is ``async (request, context, call) -> response`` for unary requests and an
    async generator ``(request_iterator, context, call)`` for streaming ones (the iterator
    yields decoded messages or :class:`Undecodable`). ``rated``: the attestation rate limit
    applies. ``audited``: the attempt gets an audit line (cheap reads like GetBundle do not).
    """

    event: str
    handler: Callable[..., Any]
    rated: bool = False
    audited: bool = True


class Boundary:
    def __init__(
        self,
        *,
        audit: AuditLog,
        metrics: Metrics,
        limits: PeerLimits,
        max_message_bytes: int,
    ) -> None:
        self.audit = audit
        self.metrics = metrics
        self.limits = limits
        self.max_message_bytes = max_message_bytes

    # -- audit and metrics ----------------------------------------------------
    def write(self, call: Call, result: str, reason: str, code: str, message: str) -> None:
        """The attempt's one audit line and metrics sample (raises AuditUnavailableError)."""
        elapsed = time.monotonic() - call.started
        self.metrics.requests.labels(method=call.method, result=result, reason=reason).inc()
        if call.event == "attest":
            self.metrics.attestations.labels(result=result, reason=reason).inc()
            self.metrics.attestation_seconds.labels(result=result).observe(elapsed)
        elif call.event == "join":
            self.metrics.joins.labels(result=result, reason=reason).inc()
            self.metrics.join_seconds.observe(elapsed)
        self.audit.write(
            call.event,
            result=result,
            reason=reason,
            status=code,
            message=message,
            peer=call.peer,
            duration_ms=round(elapsed * 1000, 1),
            **call.fields,
        )
        if result == "ok":
            log.debug("%s from %s: %s in %.0f ms", call.method, bound(call.peer), reason, elapsed * 1000)
        else:
            log.warning("%s from %s refused (%s): %s", call.method, bound(call.peer), reason, bound(message))

    def _refuse_line(self, call: Call, err: ServerError) -> ServerError:
        """Write the refusal's line; if that fails, the refusal becomes UNAVAILABLE."""
        if err.detail:
            call.set(detail=err.detail)
            log.info(
                "%s from %s: %s: %s", call.method, bound(call.peer), err.reason, bound(err.detail, 2048)
            )
        result = "cancelled" if err.grpc_code == "CANCELLED" else (
            "denied" if err.grpc_code in ("PERMISSION_DENIED", "UNAUTHENTICATED") else "error"
        )  # fmt: skip
        try:
            self.write(call, result, err.reason, err.grpc_code, err.message)
        except AuditUnavailableError as unavailable:
            return unavailable
        return err

    async def _abort(self, context: Context, err: ServerError) -> None:
        try:
            reason = reasons.get(err.reason)
        except KeyError:
            log.error("reason %r is not in protocol.reasons; sending 'internal'", err.reason)
            reason = reasons.get("internal")
        message = public_message(err, reason)
        details = status_details.encode(err.grpc_code, message, reason, retry_after_s=err.retry_after_s)
        code = getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)
        await context.abort(code, message, trailing_metadata=((status_details.TRAILER, details),))

    def _admit(self, call: Call, rated: bool) -> str | None:
        key = peer_key(call.peer)
        refusal = self.limits.admit(key, rated=rated)
        if refusal is not None:
            slug, retry = refusal
            raise _LimitError(
                "too many requests from this address; retry later"
                if slug == "rate_limited"
                else "too many concurrent requests from this address",
                reason=slug,
                retry_after_s=retry,
            )
        return key

    def _cancelled(self, call: Call) -> None:
        if call.client_cancelled():
            return
        self.cancelled_line(call)

    def cancelled_line(self, call: Call) -> None:
        with suppress(AuditUnavailableError):
            self.write(call, "cancelled", "cancelled", "CANCELLED", "the client cancelled the request")

    # -- wrappers ---------------------------------------------------------------
    @asynccontextmanager
    async def _attempt(self, name: str, method: Method, context: Context) -> AsyncIterator[Call]:
        """One attempt of ``name``: admission, then the body; every outcome mapped and audited once."""
        call = Call(method=name, event=method.event, peer=context.peer() or "", boundary=self)
        key: str | None = None
        try:
            key = self._admit(call, method.rated)
            self._check_audit()
            yield call
        except ServerError as err:
            await self._abort(context, self._refuse_line(call, err) if method.audited else err)
        except asyncio.CancelledError:
            if method.audited:
                self._cancelled(call)
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s from %s failed unexpectedly", name, bound(call.peer))
            internal = ServerError("internal error; the server logged the details")
            await self._abort(context, self._refuse_line(call, internal) if method.audited else internal)
        finally:
            if key is not None:
                self.limits.release(key)

    def unary(self, name: str, method: Method) -> Callable[[Any, Context], Awaitable[Any]]:
        async def serve(request: Any, context: Context) -> Any:
            async with self._attempt(name, method, context) as call:
                if isinstance(request, Undecodable):
                    raise request.error(name)
                response = await method.handler(request, context, call)
                if method.audited and not call.committed:
                    call.commit("ok", "ok")
                return response
            raise AssertionError("unreachable")  # pragma: no cover - _attempt aborts or re-raises

        return serve

    def stream(
        self, name: str, method: Method
    ) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
        async def serve(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            async with self._attempt(name, method, context) as call:
                async for response in method.handler(requests, context, call):
                    yield response
                if method.audited and not call.committed:
                    raise ServerError(f"{name} ended without a result")

        return serve

    def _check_audit(self) -> None:
        if not self.audit.healthy():
            raise AuditUnavailableError("the server cannot write its audit log: its disk is nearly full")

    async def _unimplemented(self, request: Any, context: Context) -> Any:
        err = ServerError("this method is not served by nodeserver", reason="unimplemented")
        err.grpc_code = "UNIMPLEMENTED"
        await self._abort(context, err)

    async def _unimplemented_stream(
        self, requests: AsyncIterator[Any], context: Context
    ) -> AsyncIterator[Any]:
        # An async generator itself: grpc.aio iterates what a plain function returns as a sync generator.
        await self._unimplemented(None, context)
        yield None  # pragma: no cover - abort() raises


def public_message(err: ServerError, reason: reasons.Reason) -> str:
    """What the peer is told. The server's own failures say only what failed (their text can
    name files, hosts and databases: that goes to the audit line and the log)."""
    if reason.family is reasons.Family.SERVER:
        return f"{reason.summary}; retry later"
    if reason.family is reasons.Family.INTERNAL:
        return "internal error; the server logged the details"
    return err.message


class _LimitError(ServerError):
    grpc_code = "RESOURCE_EXHAUSTED"
    reason = "peer_limit"


class HandlerRegistry(Protocol):
    """A server that takes gRPC method handlers: grpc.aio's, or server.wire's."""

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None: ...


def register(
    server: HandlerRegistry,
    boundary: Boundary,
    service: _descriptor.ServiceDescriptor,
    methods: dict[str, Method],
    *,
    unimplemented_message: str = "",
) -> None:
    """Serve ``service`` on ``server``: ``methods`` by name, every other method UNIMPLEMENTED."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    unknown = set(methods) - set(service.methods_by_name)
    if unknown:
        raise ValueError(f"{service.full_name} has no method(s) {', '.join(sorted(unknown))}")
    for m in service.methods:
        request_cls = message_factory.GetMessageClass(m.input_type)
        response_cls = message_factory.GetMessageClass(m.output_type)
        deserialize = tolerant_deserializer(request_cls, boundary.max_message_bytes)
        serialize = response_cls.SerializeToString
        impl = methods.get(m.name)
        streaming_in, streaming_out = m.client_streaming, m.server_streaming
        if impl is None:
            unary_fn: Any = boundary._unimplemented
            stream_fn: Any = boundary._unimplemented_stream
        else:
            unary_fn = boundary.unary(m.name, impl) if not streaming_in else None
            stream_fn = boundary.stream(m.name, impl) if streaming_in else None
        if streaming_in and streaming_out:
            h = grpc.stream_stream_rpc_method_handler(stream_fn, deserialize, serialize)
        elif streaming_in:
            raise ValueError(f"{m.full_name}: client-streaming unary responses are not served")
        elif streaming_out:
            raise ValueError(f"{m.full_name}: server-streaming responses are not served")
        else:
            h = grpc.unary_unary_rpc_method_handler(unary_fn, deserialize, serialize)
        handlers[m.name] = h
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
