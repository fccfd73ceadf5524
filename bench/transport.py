"""The transport floor: what gRPC and TLS alone cost the server for one attestation's exchange.

A second server process runs the same stack as ``nodeserver run`` (the wire
transport, or with ``--transport grpc`` grpc.aio with the same channel arguments
and dynamic TLS credentials; a server SVID from a fresh CA) with an AttestAgent
handler that does no work: it reads the params, answers with a challenge of the
real size, reads the response and answers with a result carrying a chain of the
real size. The benchmark's clients drive it the
same way as the real server (one TLS connection per agent, four messages), so
its CPU per exchange is what the transport costs before any attestation logic.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


def serve_noop(  # noqa: PLR0917 - a multiprocessing target takes positional arguments
    data_dir: str, trust_domain: str, challenge: bytes, csr: bytes, queue: Any, transport: str = "wire"
) -> None:
    """Process target: serve the no-op AttestAgent; put ``(port, bundle PEM)`` on ``queue``; run until killed.

    ``challenge`` is a real challenge's bytes; the result carries an SVID issued once for ``csr``.
    """
    import grpc

    from protocol._gen.spire.api.server.agent.v1 import agent_pb2
    from protocol.spiffe import SpiffeId
    from server.app import (
        AGENT_SERVICE,
        MAX_CONCURRENT_RPCS,
        MAX_MESSAGE_BYTES,
        TRANSPORT_MAX_MESSAGE_BYTES,
        grpc_options,
        server_credentials,
        server_tls,
    )
    from server.ca import CertificateAuthority, ServerSvid
    from server.wire.h2 import Limits
    from server.wire.server import WireServer

    ca = CertificateAuthority.load_or_create(Path(data_dir), trust_domain, ca_ttl=dt.timedelta(days=1))
    svid = ServerSvid(ca, Path(data_dir), dt.timedelta(hours=1), ())
    first = agent_pb2.AttestAgentResponse(challenge=challenge)
    last = agent_pb2.AttestAgentResponse(result=agent_pb2.AttestAgentResponse.Result(reattestable=True))
    agent_id = SpiffeId(trust_domain, "/spire/agent/tpm/" + "0" * 64)
    last.result.svid.cert_chain.extend(ca.sign_agent_csr(csr, agent_id, dt.timedelta(hours=1)).chain_der)

    async def attest_agent(
        request_iterator: AsyncIterator[agent_pb2.AttestAgentRequest], context: Any
    ) -> AsyncIterator[agent_pb2.AttestAgentResponse]:
        await request_iterator.__anext__()
        yield first
        await request_iterator.__anext__()
        yield last

    handler = grpc.stream_stream_rpc_method_handler(
        attest_agent,
        request_deserializer=agent_pb2.AttestAgentRequest.FromString,
        response_serializer=agent_pb2.AttestAgentResponse.SerializeToString,
    )

    async def main() -> None:
        server: Any
        if transport == "wire":
            server = WireServer(
                limits=Limits(max_message=TRANSPORT_MAX_MESSAGE_BYTES),
                maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                max_send_message=MAX_MESSAGE_BYTES,
            )
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(AGENT_SERVICE, {"AttestAgent": handler}),)
            )
            port = server.add_secure_port("127.0.0.1:0", server_tls(svid, Path(data_dir)))
        else:
            server = grpc.aio.server(options=grpc_options(), maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(AGENT_SERVICE, {"AttestAgent": handler}),)
            )
            port = server.add_secure_port("127.0.0.1:0", server_credentials(svid))
        await server.start()
        queue.put((port, ca.bundle_pem()))
        await server.wait_for_termination()

    asyncio.run(main())
