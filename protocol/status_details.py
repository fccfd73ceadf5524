"""Structured error details on gRPC refusals: the ``grpc-status-details-bin`` trailer.

The server ends every refused RPC with a ``google.rpc.Status`` (the same code and message
as the gRPC status) whose details hold:

* a ``google.rpc.ErrorInfo`` with ``domain`` = :data:`protocol.reasons.DOMAIN`, ``reason`` =
  the reason slug in upper case, and ``metadata`` = ``{"family": <family>}`` plus any
  reason-specific keys (never a secret, never a server path);
* for refusals SPIRE also describes, SPIRE's own ``spire.api.types.PermissionDeniedDetails``
  (``AGENT_MUST_REATTEST``, ``AGENT_BANNED``, ``AGENT_NOT_ATTESTED``), which spire-agent reads;
* for limits, a ``google.rpc.RetryInfo`` with the delay after which a retry may succeed.

This module only encodes and decodes; it imports no gRPC library, so the server (grpcio)
and the agent (grpclib) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from protocol._gen.spire.api.types import status_pb2 as spire_status_pb2
from protocol.reasons import DOMAIN, Reason, from_wire

TRAILER = "grpc-status-details-bin"
MAX_DETAILS_BYTES = 16 * 1024  # a client reads at most this much of a server's details

# Reason slug -> SPIRE's PermissionDeniedDetails.Reason, for the refusals SPIRE defines.
_SPIRE_REASONS = {
    "must_reattest": spire_status_pb2.PermissionDeniedDetails.AGENT_MUST_REATTEST,
    "banned": spire_status_pb2.PermissionDeniedDetails.AGENT_BANNED,
    "not_attested": spire_status_pb2.PermissionDeniedDetails.AGENT_NOT_ATTESTED,
}

# grpc.StatusCode names -> google.rpc.Code numbers (the same numbering as the gRPC wire).
CODES = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}


@dataclass(frozen=True)
class ErrorDetail:
    """What a client learns from a refusal's details."""

    reason: Reason | None  # None: no nodetrust detail, or a reason this build does not know
    wire_reason: str = ""  # the ErrorInfo.reason as sent (kept when ``reason`` is unknown)
    family: str = ""  # from the metadata: lets a client act on a reason it does not know
    metadata: dict[str, str] = field(default_factory=dict)
    spire_reason: str = ""  # PermissionDeniedDetails.Reason name, when sent
    retry_after_s: float | None = None


def encode(
    code: str,
    message: str,
    reason: Reason,
    *,
    metadata: dict[str, str] | None = None,
    retry_after_s: float | None = None,
) -> bytes:
    """The serialized ``google.rpc.Status`` for ``grpc-status-details-bin``."""
    info = error_details_pb2.ErrorInfo(
        reason=reason.wire, domain=DOMAIN, metadata={"family": str(reason.family), **(metadata or {})}
    )
    details = [_pack(info)]
    spire = _SPIRE_REASONS.get(reason.slug)
    if spire is not None:
        details.append(_pack(spire_status_pb2.PermissionDeniedDetails(reason=spire)))
    if retry_after_s is not None:
        whole = int(retry_after_s)
        delay = duration_pb2.Duration(seconds=whole, nanos=int((retry_after_s - whole) * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(code=CODES.get(code, CODES["UNKNOWN"]), message=message, details=details)
    raw: bytes = status.SerializeToString()
    return raw


def _pack(msg: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(msg)  # type: ignore[arg-type]
    return packed


def decode(raw: bytes | None) -> ErrorDetail:
    """Read a server's details leniently: anything unreadable is simply no detail."""
    if not raw or len(raw) > MAX_DETAILS_BYTES:
        return ErrorDetail(reason=None)
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except DecodeError:
        return ErrorDetail(reason=None)
    return from_status(status)


def from_status(status: status_pb2.Status) -> ErrorDetail:
    wire_reason, family, metadata, spire_reason = "", "", {}, ""
    retry: float | None = None
    for item in status.details:
        info = error_details_pb2.ErrorInfo()
        spire = spire_status_pb2.PermissionDeniedDetails()
        retry_info = error_details_pb2.RetryInfo()
        try:
            if item.Is(info.DESCRIPTOR) and item.Unpack(info) and info.domain == DOMAIN:
                wire_reason = info.reason
                metadata = dict(info.metadata)
                family = metadata.get("family", "")
            elif item.Is(spire.DESCRIPTOR) and item.Unpack(spire):
                name = spire_status_pb2.PermissionDeniedDetails.Reason.Name
                spire_reason = name(spire.reason) if spire.reason in spire.Reason.values() else "UNKNOWN"
            elif item.Is(retry_info.DESCRIPTOR) and item.Unpack(retry_info):
                retry = retry_info.retry_delay.seconds + retry_info.retry_delay.nanos / 1e9
        except DecodeError:
            continue  # one corrupt detail is no detail; the others still count
    return ErrorDetail(
        reason=from_wire(wire_reason),
        wire_reason=wire_reason,
        family=family,
        metadata=metadata,
        spire_reason=spire_reason,
        retry_after_s=retry,
    )
