"""The join request: the verification report to the broker over mutual TLS with the agent SVID."""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from agent.errors import JoinRefusedError, ServerNotTrustedError, ServerUnavailableError
from agent.tls import SpiffeTLSContext
from protocol._gen.nodetrust.join.v1 import join_pb2
from protocol.spiffe import server_id

log = logging.getLogger(__name__)

JOIN_METHOD = "/nodetrust.join.v1.Join/RequestJoin"
# Refusals that a retry with the same evidence cannot change.
PERMANENT = {"PERMISSION_DENIED", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "UNIMPLEMENTED"}


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


def _hint(status: str, message: str) -> str:
    if "not attested" in message or "has not attested" in message:
        return "the server does not know this node (its store was reset?): the agent attests again"
    if "banned" in message:
        return "an operator banned this node: `nodeserver agents unban <SPIFFE ID>`"
    if "fails pool" in message:
        return "fix the failing checks (nodeagent check --pool <profile>) or join another pool"
    if "unknown pool" in message:
        return "set pool to one of the pools the server lists"
    if "off the server's clock" in message:
        return "synchronise the clock (chrony, systemd-timesyncd)"
    return "see the server's audit log for this request"


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
    timeout: float = 60.0,
) -> JoinGrant:
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    host, _, port = address.rpartition(":")
    try:
        tls = SpiffeTLSContext(bundle_pem, [server_id(trust_domain)], cert_file=svid_cert, key_file=svid_key)
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise ServerNotTrustedError(
            f"cannot set up mutual TLS: {exc}", hint="attest first (nodeagent attest)"
        ) from exc
    request = join_pb2.JoinRequest(
        pool=pool,
        node_name=node_name,
        report=report,
        request_id=secrets.token_hex(16),
        requested_at=int(time.time()),
    )
    channel = Channel(host.strip("[]"), int(port), ssl=tls)
    try:
        async with channel.request(
            JOIN_METHOD,
            Cardinality.UNARY_UNARY,
            join_pb2.JoinRequest,
            join_pb2.JoinResponse,
            timeout=timeout,
        ) as stream:
            await stream.send_message(request, end=True)
            reply = await stream.recv_message()
    except GRPCError as exc:
        status = exc.status.name
        message = exc.message or status
        raise JoinRefusedError(
            f"join refused by the broker ({status}): {message}",
            hint=_hint(status, message),
            code=status,
            permanent=status in PERMANENT and "not attested" not in message,
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
    if reply is None or not reply.token:
        raise JoinRefusedError("the broker answered without a token", permanent=False)
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
