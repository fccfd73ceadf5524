"""One raw call to the join broker over the agent's mutual TLS, with the server's refusal details.

For tests that send what the agent's own client would not (a stale nonce, a foreign quote) or that
need the refusal's structured reason (``Refused.reason``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent.refusals import DetailsCodec
from agent.tls import SpiffeTLSContext
from protocol.spiffe import server_id
from protocol.status_details import ErrorDetail
from tests.support.joinenv import JoinEnv, SimAgent


class Refused(Exception):
    def __init__(self, status: str, message: str, detail: ErrorDetail | None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.detail = status, message, detail

    @property
    def reason(self) -> str:
        return self.detail.reason.slug if self.detail and self.detail.reason else ""


def join_call(
    env: JoinEnv, agent: SimAgent, method: str, request: Any, reply_cls: Any, *, cancel_after: float = 0
) -> Any:
    """``/nodetrust.join.v1.Join/<method>``; raises :class:`Refused`; ``cancel_after`` cancels instead of waiting."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    async def call() -> Any:
        tls = SpiffeTLSContext(
            env.srv.bundle, [server_id("example.org")], cert_file=agent.cert, key_file=agent.key
        )
        ch = Channel("127.0.0.1", env.srv.app.ports.join, ssl=tls, status_details_codec=DetailsCodec())
        try:
            async with ch.request(
                f"/nodetrust.join.v1.Join/{method}",
                Cardinality.UNARY_UNARY,
                type(request),
                reply_cls,
                timeout=30,
            ) as stream:
                await stream.send_message(request, end=True)
                if cancel_after:
                    await asyncio.sleep(cancel_after)
                    await stream.cancel()
                    return None
                return await stream.recv_message()
        except GRPCError as exc:
            detail = exc.details if isinstance(exc.details, ErrorDetail) else None
            raise Refused(exc.status.name, exc.message or "", detail) from exc
        finally:
            ch.close()

    return asyncio.run(call())
