"""The SPIRE Agent API's AttestAgent stream, for the ``tpm`` and ``tpm_devid`` attestors, and RenewAgent.

The flow, as SPIRE runs it (spire/pkg/server/api/agent/v1/service.go): the
first message carries the attestation data and a CSR; the attestor answers
with one challenge; the agent answers it; the server issues the agent
X509-SVID, records the agent and closes the stream with the result.

Statuses and message prefixes follow SPIRE's where an agent or an operator's
tooling sees them (docs/attestation.md, "Status codes"). The attestation logic (payload
decoding, EK chain building, the AK checks, the credential, the CSR, the answer's check, the SVID
signature) is pure computation on a bounded payload and runs on the event loop, about 0.4 ms per
step: a thread hop costs more than it would spare the loop. The store write and the audit line,
which are I/O, run in the group-commit writer thread (:mod:`server.commit`).
The admission limits, the audit line, the metrics and the mapping of errors to
statuses are :mod:`server.boundary`'s; this module raises and yields.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric import ec, rsa

from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.types import spiffeid_pb2, x509svid_pb2
from server.boundary import Call, Context, Method, Undecodable
from server.ca import CertificateAuthority, IssuedSvid
from server.commit import GroupCommit
from server.errors import (
    AttestationDeniedError,
    CancelledByClientError,
    ChallengeTimeoutError,
    InvalidRequestError,
    PayloadTooLargeError,
    ServerError,
    UnknownAttestorError,
)
from server.node_attestor import NodeAttestor
from server.store import AgentRecord, Store
from server.tpm_attestor import AttestResult, PendingAttestation

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ATTESTOR_NAME = 64


@dataclass(frozen=True)
class _Started:
    pending: PendingAttestation
    csr_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey


class AgentService:
    """``spire.api.server.agent.v1.Agent``: AttestAgent and RenewAgent; the admin RPCs are not served."""

    def __init__(
        self,
        *,
        ca: CertificateAuthority,
        store: Store,
        attestors: dict[str, NodeAttestor],
        svid_ttl: dt.timedelta,
        challenge_timeout: float,
        first_message_timeout: float,
        max_payload_bytes: int,
        commit: GroupCommit,
    ) -> None:
        self.ca = ca
        self.store = store
        self.attestors = attestors
        self.svid_ttl = svid_ttl
        self.challenge_timeout = challenge_timeout
        self.first_message_timeout = first_message_timeout
        self.max_payload_bytes = max_payload_bytes
        self.commit = commit

    def methods(self) -> dict[str, Method]:
        return {
            "AttestAgent": Method("attest", self.attest_agent, rated=True),
            "RenewAgent": Method("renew", self.renew_agent),
        }

    async def _next(
        self, it: AsyncIterator[Any], context: Context, *, first: bool
    ) -> agent_pb2.AttestAgentRequest:
        timeout = self.first_message_timeout if first else self.challenge_timeout
        try:
            async with asyncio.timeout(timeout):
                msg = await it.__anext__()
        except TimeoutError:
            if first:
                raise ChallengeTimeoutError(
                    f"failed to receive request from stream: no params within {timeout:g} s",
                    reason="params_timeout",
                ) from None
            raise ChallengeTimeoutError(
                f"failed to receive challenge from agent: no answer within {timeout:g} s"
            ) from None
        except StopAsyncIteration:
            # A client's RST_STREAM also ends the iterator; gRPC cancels this task right after.
            # Give that a moment, so a cancellation is told apart from a half-close.
            await asyncio.sleep(0.01)
            if context.cancelled():
                raise CancelledByClientError("the client cancelled the stream") from None
            # The client half-closed without sending what the protocol needs next: SPIRE answers
            # InvalidArgument for the first message and Internal after the challenge.
            if first:
                raise InvalidRequestError(
                    "failed to receive request from stream: EOF", reason="stream_ended"
                ) from None
            err = ServerError("failed to receive challenge from agent: EOF", reason="stream_ended")
            raise err from None
        if isinstance(msg, Undecodable):
            raise msg.error("failed to receive request from stream" if first else "challenge response")
        if not isinstance(msg, agent_pb2.AttestAgentRequest):  # pragma: no cover - the deserializer's type
            raise InvalidRequestError("unexpected message type", reason="malformed_message")
        return msg

    async def attest_agent(
        self, it: AsyncIterator[Any], context: Context, call: Call
    ) -> AsyncIterator[agent_pb2.AttestAgentResponse]:
        first = await self._next(it, context, first=True)
        params = _checked_params(first)
        call.set(attestor=params.data.type[:MAX_ATTESTOR_NAME])
        if len(params.data.type) > MAX_ATTESTOR_NAME:
            raise UnknownAttestorError(
                "error getting node attestor: the attestor type name is too long", reason="unknown_attestor"
            )
        if len(params.data.payload) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"malformed param: attestation payload of {len(params.data.payload)} bytes exceeds "
                f"the limit of {self.max_payload_bytes}"
            )
        attestor = self.attestors.get(params.data.type)
        if attestor is None:
            raise UnknownAttestorError(
                f"error getting node attestor: could not find node attestor type {params.data.type!r}; "
                "this server supports: " + ", ".join(sorted(self.attestors))
            )
        started = self._begin(attestor, params, call)
        yield agent_pb2.AttestAgentResponse(challenge=started.pending.challenge)
        reply = await self._next(it, context, first=False)
        if reply.WhichOneof("step") != "challenge_response":
            raise InvalidRequestError(
                "expected a challenge_response; got a second params message on the same stream",
                reason="unexpected_params",
            )
        svid, result, record = self._prove(attestor, started, reply.challenge_response)

        def stored() -> None:  # in the writer thread, inside the call's commit section
            call.set(svid_serial=str(svid.serial), svid_expires_at=svid.expires_at)
            call.commit("attested", "attested")

        # A banned agent proves its identity like any other, then is refused before anything leaves
        # the server: nothing is written and its SVID is dropped unsent.
        await self.commit.record(call, record, result.also_unbanned, stored)
        yield agent_pb2.AttestAgentResponse(
            result=agent_pb2.AttestAgentResponse.Result(
                svid=x509svid_pb2.X509SVID(
                    cert_chain=list(svid.chain_der),
                    id=spiffeid_pb2.SPIFFEID(trust_domain=result.agent_id.trust_domain, path=result.agent_id.path),
                    expires_at=svid.expires_at,
                ),
                reattestable=result.can_reattest,
            )
        )  # fmt: skip

    def _begin(self, attestor: NodeAttestor, params: Any, call: Call) -> _Started:
        """On the event loop: decode, check the CSR, validate the EK and the AK, build the challenge.

        Pure computation on a bounded payload (about 0.5 ms): a thread hop would cost more than it
        spares the loop, and the challenge then leaves in the same write as the transport's replies.
        """
        evidence = attestor.decode(params.data.payload)
        call.set(spiffe_id=str(evidence.agent_id), ek_hash=evidence.ek.pub_hash)
        # Check the CSR now, so a bad one fails before the challenge; only its public key is used.
        csr_key = self.ca.verify_csr(params.params.csr)
        pending = attestor.begin(evidence)
        call.set(ek_trust=pending.ek_method)
        return _Started(pending, csr_key)

    def _prove(
        self, attestor: NodeAttestor, started: _Started, response: bytes
    ) -> tuple[IssuedSvid, AttestResult, AgentRecord]:
        """On the event loop: check the answer, sign the SVID, build the agent's record (pure computation)."""
        result = attestor.finish(started.pending, response)
        svid = self.ca.issue_agent_svid(started.csr_key, result.agent_id, self.svid_ttl)
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
            ak_public=result.ak_public.hex(),
            ak_qualified_name=result.ak_qualified_name.hex(),
        )
        return svid, result, record

    async def renew_agent(self, request: Any, context: Context, call: Call) -> agent_pb2.RenewAgentResponse:
        # TPM-attested agents are reattestable: like SPIRE >= 1.10 they renew by attesting again, and
        # spire-agent switches to re-attestation when it sees PermissionDeniedDetails AGENT_MUST_REATTEST.
        raise AttestationDeniedError("agent must reattest instead of renew", reason="must_reattest")


def _checked_params(first: agent_pb2.AttestAgentRequest) -> agent_pb2.AttestAgentRequest.Params:
    """SPIRE's validateAttestAgentParams, with its messages."""
    if first.WhichOneof("step") != "params":
        raise InvalidRequestError("malformed param: missing params", reason="malformed_params")
    params = first.params
    if not params.HasField("data"):
        raise InvalidRequestError("malformed param: missing attestation data", reason="malformed_params")
    if not params.HasField("params"):
        raise InvalidRequestError("malformed param: missing X509-SVID params", reason="malformed_params")
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
    return params
