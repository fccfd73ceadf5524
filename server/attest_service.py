"""The SPIRE Agent API's AttestAgent stream (grpc.aio), for the ``tpm`` attestor.

The flow, as SPIRE runs it (spire/pkg/server/api/agent/v1/service.go): the
first message carries the attestation data and a CSR; the attestor answers
with one challenge; the agent answers it; the server issues the agent
X509-SVID, records the agent and closes the stream with the result.

Every attempt ends with exactly one audit line and one metrics sample. A
failed attempt stores nothing. Errors are :class:`server.errors.ServerError`
subclasses, mapped to gRPC status codes here and nowhere else.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from protocol._gen.spire.api.server.agent.v1 import agent_pb2, agent_pb2_grpc
from protocol._gen.spire.api.types import spiffeid_pb2, x509svid_pb2
from server.audit import AuditLog
from server.ca import CertificateAuthority
from server.errors import (
    BannedError,
    CancelledByClientError,
    ChallengeTimeoutError,
    InvalidRequestError,
    PayloadTooLargeError,
    ServerError,
    StoreError,
    UnknownAttestorError,
)
from server.metrics import Metrics
from server.store import AgentRecord, Store
from server.tpm_attestor import TpmNodeAttestor

log = logging.getLogger(__name__)
T = TypeVar("T")


def grpc_status(err: ServerError) -> grpc.StatusCode:
    """The one mapping from the server's errors to gRPC status codes."""
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


@dataclass
class _Attempt:
    peer: str
    started: float = field(default_factory=time.monotonic)
    agent_id: str = ""
    ek_hash: str = ""
    ek_method: str = ""
    attestor: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


class AgentService(agent_pb2_grpc.AgentServicer):
    """``spire.api.server.agent.v1.Agent``: AttestAgent (and RenewAgent's re-attestation answer)."""

    def __init__(
        self,
        *,
        ca: CertificateAuthority,
        store: Store,
        audit: AuditLog,
        metrics: Metrics,
        attestors: dict[str, TpmNodeAttestor],
        svid_ttl: dt.timedelta,
        challenge_timeout: float,
        max_payload_bytes: int,
        executor: Executor | None = None,
    ) -> None:
        self.ca = ca
        self.store = store
        self.audit = audit
        self.metrics = metrics
        self.attestors = attestors
        self.svid_ttl = svid_ttl
        self.challenge_timeout = challenge_timeout
        self.max_payload_bytes = max_payload_bytes
        self.executor = executor

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _next(
        self,
        it: AsyncIterator[agent_pb2.AttestAgentRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        what: str,
    ) -> agent_pb2.AttestAgentRequest:
        try:
            async with asyncio.timeout(self.challenge_timeout):
                return await it.__anext__()
        except TimeoutError:
            raise ChallengeTimeoutError(
                f"no {what} within {self.challenge_timeout:g} s",
                reason="challenge_timeout" if "response" in what else "params_timeout",
            ) from None
        except StopAsyncIteration:
            # The client closed or reset its side without sending what the protocol needs next.
            raise CancelledByClientError(
                f"the client closed or cancelled the stream before the {what}",
                reason="cancelled" if context.cancelled() else "stream_ended",
            ) from None

    async def AttestAgent(
        self,
        request_iterator: AsyncIterator[agent_pb2.AttestAgentRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[agent_pb2.AttestAgentResponse]:
        attempt = _Attempt(peer=context.peer() or "")
        try:
            async for response in self._attest(request_iterator, context, attempt):
                yield response
        except CancelledByClientError as err:
            self._finish(attempt, "cancelled", err.reason, err.grpc_code, err.message)
        except ServerError as err:
            self._finish(
                attempt,
                "denied" if err.grpc_code == "PERMISSION_DENIED" else "error",
                err.reason,
                err.grpc_code,
                err.message,
            )
            await context.abort(grpc_status(err), err.message)
        except asyncio.CancelledError:
            self._finish(attempt, "cancelled", "cancelled", "CANCELLED", "the client cancelled the stream")
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("attestation from %s failed unexpectedly", attempt.peer)
            self._finish(attempt, "error", "internal", "INTERNAL", "internal error")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")

    async def _attest(
        self,
        it: AsyncIterator[agent_pb2.AttestAgentRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        attempt: _Attempt,
    ) -> AsyncIterator[agent_pb2.AttestAgentResponse]:
        first = await self._next(it, context, "attestation parameters")
        if first.WhichOneof("step") != "params":
            raise InvalidRequestError(
                "malformed param: the first message must carry params", reason="malformed_params"
            )
        params = first.params
        if not params.HasField("data") or not params.HasField("params"):
            raise InvalidRequestError(
                "malformed param: missing attestation data or X509-SVID params", reason="malformed_params"
            )
        if not params.params.csr:
            raise InvalidRequestError("malformed param: missing CSR", reason="malformed_params")
        if not params.data.type:
            raise InvalidRequestError(
                "malformed param: missing attestation data type", reason="malformed_params"
            )
        if not params.data.payload:
            raise InvalidRequestError(
                "malformed param: missing attestation data payload", reason="malformed_params"
            )
        attempt.attestor = params.data.type
        if len(params.data.payload) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"attestation payload of {len(params.data.payload)} bytes exceeds the limit of {self.max_payload_bytes}"
            )
        attestor = self.attestors.get(params.data.type)
        if attestor is None:
            raise UnknownAttestorError(
                f"could not find node attestor type {params.data.type!r}; this server supports: "
                + ", ".join(sorted(self.attestors))
            )
        evidence = attestor.decode(params.data.payload)
        attempt.agent_id, attempt.ek_hash = str(evidence.agent_id), evidence.ek.pub_hash
        # Check the CSR now, so a bad one fails before the challenge; only its public key is used.
        csr_key = self.ca.verify_csr(params.params.csr)
        pending = attestor.begin(evidence)
        attempt.ek_method = pending.ek_method
        yield agent_pb2.AttestAgentResponse(challenge=pending.challenge)
        reply = await self._next(it, context, "challenge response")
        if reply.WhichOneof("step") != "challenge_response":
            raise InvalidRequestError(
                "expected a challenge_response; got a second params message on the same stream",
                reason="unexpected_params",
            )
        result = attestor.finish(pending, reply.challenge_response)
        # A banned agent proves its identity like any other, then is refused before anything leaves
        # the server. The SVID is signed first so that the ban check and the write share one trip to
        # the store's thread; a banned agent's SVID is dropped unsent.
        svid = self.ca.issue_agent_svid(csr_key, result.agent_id, self.svid_ttl)
        now = int(time.time())
        record = AgentRecord(
            spiffe_id=str(result.agent_id),
            attestation_type=attestor.name,
            ek_hash=result.ek_hash,
            first_attested_at=now,
            last_attested_at=now,
            svid_serial=str(svid.serial),
            svid_expires_at=svid.expires_at,
            selectors=result.selectors,
            can_reattest=result.can_reattest,
        )
        stored = await self._in_thread(self._record_unless_banned, record)
        if stored is None or stored.banned:  # banned before, or between the check and the write
            raise BannedError("failed to attest: agent is banned")
        response = agent_pb2.AttestAgentResponse(
            result=agent_pb2.AttestAgentResponse.Result(
                svid=x509svid_pb2.X509SVID(
                    cert_chain=list(svid.chain_der),
                    id=spiffeid_pb2.SPIFFEID(
                        trust_domain=result.agent_id.trust_domain, path=result.agent_id.path
                    ),
                    expires_at=svid.expires_at,
                ),
                reattestable=result.can_reattest,
            )
        )
        yield response
        attempt.fields.update(svid_serial=str(svid.serial), svid_expires_at=svid.expires_at)
        self._finish(attempt, "ok", "attested", "OK", "attested")

    def _record_unless_banned(self, record: AgentRecord) -> AgentRecord | None:
        """In the store's thread: None for a banned agent (nothing written), else the stored row."""
        try:
            banned = self.store.is_banned(record.spiffe_id)
        except Exception as exc:
            raise StoreError(f"could not check the ban list: {exc}") from exc
        if banned:
            return None
        try:
            return self.store.record_attestation(record)
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"could not record the attestation: {exc}") from exc

    def _finish(self, attempt: _Attempt, result: str, reason: str, code: str, message: str) -> None:
        elapsed = time.monotonic() - attempt.started
        self.metrics.attestations.labels(result=result, reason=reason).inc()
        self.metrics.attestation_seconds.labels(result=result).observe(elapsed)
        self.audit.write(
            "attest",
            result=result,
            reason=reason,
            status=code,
            message=message,
            peer=attempt.peer,
            attestor=attempt.attestor,
            spiffe_id=attempt.agent_id,
            ek_hash=attempt.ek_hash,
            ek_trust=attempt.ek_method,
            duration_ms=round(elapsed * 1000, 1),
            **attempt.fields,
        )
        if result == "ok":
            log.debug("attested %s from %s in %.0f ms", attempt.agent_id, attempt.peer, elapsed * 1000)
        else:
            log.warning("attestation from %s refused (%s): %s", attempt.peer, reason, message)

    async def RenewAgent(
        self, request: agent_pb2.RenewAgentRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.RenewAgentResponse:
        # TPM-attested agents are reattestable: like SPIRE >= 1.10 they renew by attesting again.
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "agent must reattest to renew its SVID")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _admin_only(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "agent administration is not served over gRPC; use `nodeserver agents list|ban|unban|delete` on the server",
        )

    async def CountAgents(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def ListAgents(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def GetAgent(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def DeleteAgent(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def BanAgent(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def CreateJoinToken(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admin_only(context)

    async def PostStatus(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "PostStatus is not implemented by this server")
