"""The join broker's client: RequestJoin and ReportJoined over mutual TLS with the agent SVID.

``begin_join_async`` asks the broker which PCRs the pool checks and for a nonce
(:class:`agent.tpm.quote.QuoteRequest`; none for a pool that does not check measured boot);
``request_join_async`` sends the verification report, and the quote and event log when asked,
and returns the one-time :class:`JoinGrant`; ``report_joined_async`` tells the broker, after
``kubeadm join`` succeeded, that the token was used, so the broker revokes it at once;
``recheck_async`` sends a joined node's fresh quote (``nodeagent reattest``). Refusals become
errors through :mod:`agent.refusals` (status and reason slug, never the message text).
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import re
import secrets
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.attest_client import host_port
from agent.errors import (
    ConfigError,
    JoinConfigError,
    RefusedForNowError,
    ServerNotTrustedError,
    ServerUnavailableError,
)
from agent.refusals import DetailsCodec, Rpc, from_grpc_error
from agent.tls import SpiffeTLSContext
from agent.tpm.quote import QuoteEvidence, QuoteRequest
from protocol._gen.nodetrust.join.v1 import join_pb2
from protocol.spiffe import server_id

log = logging.getLogger(__name__)

BEGIN_METHOD = "/nodetrust.join.v1.Join/BeginJoin"
JOIN_METHOD = "/nodetrust.join.v1.Join/RequestJoin"
REPORT_METHOD = "/nodetrust.join.v1.Join/ReportJoined"
RECHECK_METHOD = "/nodetrust.join.v1.Join/Recheck"
_TOKEN_ID_RE = re.compile(r"[a-z0-9]{6}")


@dataclass(frozen=True)
class JoinGrant:
    """What the broker answered. ``token`` is a secret: never log it."""

    token: str
    token_expires_at: int
    ca_cert_hashes: tuple[str, ...]
    api_server_endpoint: str
    kubernetes_version: str
    labels: dict[str, str]
    taints: tuple[tuple[str, str, str], ...]
    kubelet_extra_args: tuple[tuple[str, str], ...]
    verdict: str

    def __repr__(self) -> str:
        return f"JoinGrant(token=<redacted>, endpoint={self.api_server_endpoint}, expires={self.token_expires_at})"


async def begin_join_async(
    address: str,
    *,
    trust_domain: str,
    bundle_pem: bytes,
    svid_cert: Path,
    svid_key: Path,
    pool: str,
    timeout: float = 60.0,
) -> QuoteRequest | None:
    """Join.BeginJoin: what to quote for ``pool``; None when the pool does not check measured boot."""
    tls = _mtls(bundle_pem, trust_domain, svid_cert, svid_key)
    request = join_pb2.BeginJoinRequest(pool=pool)
    reply = await _unary(
        address, tls, Rpc.JOIN, request, join_pb2.BeginJoinResponse, method=BEGIN_METHOD, timeout=timeout
    )
    if reply is None or not reply.pcrs:
        return None
    return QuoteRequest(
        nonce=bytes(reply.nonce), bank=reply.pcr_bank, pcrs=tuple(reply.pcrs), expires_at=reply.expires_at
    )


def _join_request(pool: str, node_name: str, report: bytes, evidence: QuoteEvidence | None) -> Any:
    request = join_pb2.JoinRequest(
        pool=pool,
        node_name=node_name,
        report=report,
        request_id=secrets.token_hex(16),
        requested_at=int(time.time()),
    )
    if evidence is not None:
        request.nonce = evidence.nonce
        request.quote = evidence.quote
        request.quote_signature = evidence.signature
        request.event_log = evidence.event_log
    return request


async def request_join_async(
    address: str,
    *,
    trust_domain: str,
    bundle_pem: bytes,
    svid_cert: Path,
    svid_key: Path,
    pool: str,
    node_name: str,
    report: bytes,
    evidence: QuoteEvidence | None = None,
    timeout: float = 60.0,
) -> JoinGrant:
    """Join.RequestJoin: the verification report (and the quote) for the one-time :class:`JoinGrant`."""
    tls = _mtls(bundle_pem, trust_domain, svid_cert, svid_key)
    request = _join_request(pool, node_name, report, evidence)
    reply = await _unary(
        address, tls, Rpc.JOIN, request, join_pb2.JoinResponse, method=JOIN_METHOD, timeout=timeout
    )
    if reply is None or not reply.token:
        raise RefusedForNowError(
            "the broker answered without a token", hint="see the broker's log for this request; retrying"
        )
    return JoinGrant(
        token=reply.token,
        token_expires_at=reply.token_expires_at,
        ca_cert_hashes=tuple(reply.ca_cert_hashes),
        api_server_endpoint=reply.api_server_endpoint,
        kubernetes_version=reply.kubernetes_version,
        labels=dict(reply.labels),
        taints=tuple((t.key, t.value, t.effect) for t in reply.taints),
        kubelet_extra_args=tuple((a.name, a.value) for a in reply.kubelet_extra_args),
        verdict=reply.verdict,
    )


def request_join(address: str, **kwargs: object) -> JoinGrant:
    return asyncio.run(request_join_async(address, **kwargs))  # type: ignore[arg-type]


def token_id(token: str) -> str:
    """The public id of a bootstrap token: the part before the dot (never the secret)."""
    public, dot, _ = token.partition(".")
    if not dot or not _TOKEN_ID_RE.fullmatch(public):
        raise JoinConfigError(
            "the bootstrap token is not of the form [a-z0-9]{6}.[a-z0-9]{16}",
            hint="the join broker sent it; check the pool and cluster settings of nodeserver",
        )
    return public


async def report_joined_async(
    address: str,
    *,
    trust_domain: str,
    bundle_pem: bytes,
    svid_cert: Path,
    svid_key: Path,
    token_id: str,
    node_name: str,
    timeout: float = 15.0,
) -> bool:
    """Join.ReportJoined: the token with this public id has been used; True when this call revoked it."""
    if not _TOKEN_ID_RE.fullmatch(token_id):
        raise JoinConfigError(
            f"{token_id!r} is not a bootstrap token id", hint="this is a bug in the caller"
        )
    tls = _mtls(bundle_pem, trust_domain, svid_cert, svid_key)
    request = join_pb2.JoinedRequest(token_id=token_id, node_name=node_name)
    reply = await _unary(
        address,
        tls,
        Rpc.REPORT_JOINED,
        request,
        join_pb2.JoinedResponse,
        method=REPORT_METHOD,
        timeout=timeout,
    )
    return bool(reply is not None and reply.revoked)


async def recheck_async(
    address: str,
    *,
    trust_domain: str,
    bundle_pem: bytes,
    svid_cert: Path,
    svid_key: Path,
    pool: str,
    node_name: str,
    evidence: QuoteEvidence,
    timeout: float = 60.0,
) -> str:
    """Join.Recheck: a joined node's fresh quote and event log; the release the server matched them with.

    Refusals (``boot_not_accepted``, the quote's own reasons) come back like RequestJoin's.
    """
    tls = _mtls(bundle_pem, trust_domain, svid_cert, svid_key)
    request = join_pb2.RecheckRequest(
        pool=pool,
        node_name=node_name,
        nonce=evidence.nonce,
        quote=evidence.quote,
        quote_signature=evidence.signature,
        event_log=evidence.event_log,
    )
    reply = await _unary(
        address, tls, Rpc.RECHECK, request, join_pb2.RecheckResponse, method=RECHECK_METHOD, timeout=timeout
    )
    return str(reply.release) if reply is not None else ""


def _mtls(bundle_pem: bytes, trust_domain: str, svid_cert: Path, svid_key: Path) -> SpiffeTLSContext:
    try:
        return SpiffeTLSContext(
            bundle_pem, [server_id(trust_domain)], cert_file=svid_cert, key_file=svid_key
        )
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise ServerNotTrustedError(
            f"cannot set up mutual TLS: {exc}", hint="attest first (nodeagent attest)"
        ) from exc


async def _unary(
    address: str,
    tls: SpiffeTLSContext,
    rpc: Rpc,
    request: Any,
    reply_type: Any,
    *,
    method: str,
    timeout: float,
) -> Any:
    """One unary call to the broker; transport and refusals become :class:`AgentError` subclasses."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    try:
        host, port = host_port(address)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="set join_server to HOST:PORT, e.g. join.example.org:8082") from exc
    channel = Channel(host, port, ssl=tls, status_details_codec=DetailsCodec())
    try:
        async with channel.request(
            method, Cardinality.UNARY_UNARY, type(request), reply_type, timeout=timeout
        ) as stream:
            await stream.send_message(request, end=True)
            return await stream.recv_message()
    except GRPCError as exc:
        raise from_grpc_error(rpc, exc) from exc
    except binascii.Error as exc:  # grpclib could not even base64-decode the status details
        raise RefusedForNowError(
            f"the join broker at {address} sent an unreadable status trailer: {exc}",
            hint="a proxy between the agent and the broker may mangle gRPC trailers; the agent retries",
        ) from exc
    except ssl.SSLCertVerificationError as exc:
        raise ServerNotTrustedError(
            f"the join broker at {address} is not trusted: {getattr(exc, 'verify_message', None) or exc.args[0]}",
            hint="check the bundle and the trust domain",
        ) from exc
    except (TimeoutError, OSError, StreamTerminatedError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the join broker at {address}: {exc or type(exc).__name__}",
            hint="check join_server and that nodeserver serves join_listen; the agent retries",
        ) from exc
    finally:
        channel.close()
