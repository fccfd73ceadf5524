"""A bare AttestAgent stream over the agent's SPIFFE TLS, for tests that send what a real agent never would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from agent.refusals import DetailsCodec
from agent.tls import SpiffeTLSContext
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.types import attestation_pb2
from protocol.spiffe import server_id
from protocol.status_details import ErrorDetail

T = TypeVar("T")
ATTEST = "/spire.api.server.agent.v1.Agent/AttestAgent"


class RpcFailed(Exception):
    def __init__(self, status: str, message: str, detail: ErrorDetail | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.detail = detail  # the server's structured details (protocol.status_details)

    @property
    def reason(self) -> str:
        return self.detail.reason.slug if self.detail is not None and self.detail.reason else ""


def params(payload: bytes, csr: bytes, attestor: str = "tpm") -> agent_pb2.AttestAgentRequest:
    return agent_pb2.AttestAgentRequest(
        params=agent_pb2.AttestAgentRequest.Params(
            data=attestation_pb2.AttestationData(type=attestor, payload=payload),
            params=agent_pb2.AgentX509SVIDParams(csr=csr),
        )
    )


async def _run(
    address: str, bundle: bytes, trust_domain: str, script: Callable[[Any], Awaitable[T]], timeout: float
) -> T:
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    host, _, port = address.rpartition(":")
    channel = Channel(
        host,
        int(port),
        ssl=SpiffeTLSContext(bundle, [server_id(trust_domain)]),
        status_details_codec=DetailsCodec(),
    )
    try:
        async with channel.request(
            ATTEST,
            Cardinality.STREAM_STREAM,
            agent_pb2.AttestAgentRequest,
            agent_pb2.AttestAgentResponse,
            timeout=timeout,
        ) as stream:
            return await script(stream)
    except GRPCError as exc:
        detail = exc.details if isinstance(exc.details, ErrorDetail) else None
        raise RpcFailed(exc.status.name, exc.message or "", detail) from exc
    finally:
        channel.close()


def run_stream(
    address: str,
    bundle: bytes,
    script: Callable[[Any], Awaitable[T]],
    *,
    trust_domain: str = "example.org",
    timeout: float = 60,
) -> T:
    return asyncio.run(_run(address, bundle, trust_domain, script, timeout))
