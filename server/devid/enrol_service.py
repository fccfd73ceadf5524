"""``nodetrust.devid.v1.DevId/Enrol``: LDevID certificates for TPM keys of EK-attested machines.

The stream (protocol/proto/nodetrust/devid/v1/devid.proto) proves, in the order of
:mod:`server.devid.evidence`: the DevID key is a fixedTPM signing key; the EK is trusted
(``ek_trust``) and its agent ``spire/agent/tpm/<EK hash>`` is attested here and not banned; the AK is
a restricted fixedTPM signing key whose TPM2_Certify names the DevID key; then, answering the one
challenge, that the AK shares the EK's TPM (credential activation) and the DevID key signs. Only
then does the DevID CA (:mod:`server.devid.ca`) sign an LDevID for the key, with one audit line
(``event: devid``) carrying the serial, the EK hash and the identity SPIRE's ``tpm_devid`` will give.

Like AttestAgent, everything CPU-heavy and the store run in worker threads, and the boundary
(:mod:`server.boundary`) admits, audits and maps errors.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric import rsa

from protocol import reasons
from protocol._gen.nodetrust.devid.v1 import devid_pb2
from protocol.spiffe import tpm_agent_id
from protocol.tpm_payload import EkData
from server.boundary import Call, Context, Method, Undecodable
from server.devid import evidence as ev
from server.devid.attestor import devid_agent_id
from server.devid.ca import DevidCa
from server.errors import (
    AgentNotAttestedError,
    AttestationDeniedError,
    BannedError,
    CancelledByClientError,
    ChallengeTimeoutError,
    InvalidRequestError,
    NotJoinedError,
    StoreError,
)
from server.store import Store
from server.tpm_attestor import EkTrustLike

log = logging.getLogger(__name__)
T = TypeVar("T")
_PARAM_FIELDS = (
    "ek_certificate",
    "ek_public",
    "ak_public",
    "devid_public",
    "certify_info",
    "certify_signature",
)


@dataclass(frozen=True, repr=False)
class _Pending:
    ek_hash: str
    devid_key: ev.DevidKey
    residency: ev.Residency
    nonce: bytes


class DevidEnrolService:
    def __init__(
        self,
        *,
        trust_domain: str,
        ca: DevidCa,
        ek_trust: EkTrustLike,
        store: Store,
        certificate_ttl: dt.timedelta,
        challenge_timeout: float,
        first_message_timeout: float,
        executor: Executor | None = None,
        require_join: bool = True,
    ) -> None:
        self.trust_domain = trust_domain
        self.ca = ca
        self.ek_trust = ek_trust
        self.store = store
        self.certificate_ttl = certificate_ttl
        self.require_join = require_join
        self.challenge_timeout = challenge_timeout
        self.first_message_timeout = first_message_timeout
        self.executor = executor

    def methods(self) -> dict[str, Method]:
        return {"Enrol": Method("devid", self.enrol, rated=True)}

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _next(
        self, it: AsyncIterator[Any], context: Context, *, first: bool
    ) -> devid_pb2.EnrolRequest:
        timeout = self.first_message_timeout if first else self.challenge_timeout
        try:
            async with asyncio.timeout(timeout):
                msg = await it.__anext__()
        except TimeoutError:
            raise ChallengeTimeoutError(
                f"no {'params' if first else 'proof'} within {timeout:g} s",
                reason="params_timeout" if first else "challenge_timeout",
            ) from None
        except StopAsyncIteration:
            await asyncio.sleep(0.01)  # a reset stream is cancelled right after: tell it from a half-close
            if context.cancelled():
                raise CancelledByClientError("the client cancelled the stream") from None
            raise InvalidRequestError(
                f"the stream ended before the {'params' if first else 'proof'}", reason="stream_ended"
            ) from None
        if isinstance(msg, Undecodable):
            raise msg.error("DevId/Enrol")
        if not isinstance(msg, devid_pb2.EnrolRequest):  # pragma: no cover - the deserializer's type
            raise InvalidRequestError("unexpected message type", reason="malformed_message")
        return msg

    async def enrol(
        self, it: AsyncIterator[Any], context: Context, call: Call
    ) -> AsyncIterator[devid_pb2.EnrolResponse]:
        first = await self._next(it, context, first=True)
        if first.WhichOneof("step") != "params":
            raise InvalidRequestError("the first message must carry params", reason="malformed_params")
        pending = await self._in_thread(self._begin, first.params, call)
        yield devid_pb2.EnrolResponse(
            challenge=devid_pb2.EnrolResponse.Challenge(
                credential=pending.residency.credential,
                secret=pending.residency.secret,
                devid_nonce=pending.nonce,
            )
        )
        reply = await self._next(it, context, first=False)
        if reply.WhichOneof("step") != "proof":
            raise InvalidRequestError(
                "expected the proof; got a second params message", reason="unexpected_params"
            )
        yield await self._in_thread(self._finish, pending, reply.proof, call)

    def _begin(self, params: devid_pb2.EnrolRequest.Params, call: Call) -> _Pending:
        missing = [f for f in _PARAM_FIELDS if not getattr(params, f)]
        if missing:
            raise InvalidRequestError(f"params lack {', '.join(missing)}", reason="malformed_params")
        devid = ev.parse_devid_key(params.devid_public)
        ek_public = ev.parse_ek_public(params.ek_public)
        ak = ev.parse_ak(params.ak_public)
        certification = ev.parse_certification(params.certify_info, params.certify_signature)
        ev.check_devid_key(devid)
        ek = EkData(public_key_der=ev.ek_spki(ek_public), certificate_der=params.ek_certificate)
        call.set(ek_hash=ek.pub_hash)
        verdict = self.ek_trust.verify(ek)
        if not verdict.trusted:
            code = verdict.reason_code if verdict.reason_code in reasons.REASONS else "ek_not_trusted"
            raise AttestationDeniedError(
                f"could not validate EK: {reasons.get(code).summary}", reason=code, detail=verdict.reason
            )
        agent_id = str(tpm_agent_id(self.trust_domain, ek.pub_hash))
        call.set(spiffe_id=agent_id, ek_trust=verdict.method)
        try:
            record = self.store.get_agent(agent_id)
        except Exception as exc:
            raise StoreError("failed to fetch agent", detail=str(exc)) from exc
        if record is None:
            raise AgentNotAttestedError(
                f"{agent_id} has not attested with its EK here: run the EK attestation (tpm) first"
            )
        if record.banned:
            raise BannedError("this machine's agent is banned")
        if self.require_join and not self._joined(agent_id):
            raise NotJoinedError(
                f"{agent_id} has not been admitted by a join here: a DevID is issued only to a joined machine "
                "(devid.require_join)"
            )
        ev.check_ak(ak)
        ev.check_certification(ak, devid, certification)
        return _Pending(
            ek_hash=ek.pub_hash,
            devid_key=ev.devid_public_key(devid),
            residency=ev.residency_challenge(ak, ek_public),
            nonce=os.urandom(ev.NONCE_BYTES),
        )

    def _joined(self, agent_id: str) -> bool:
        """A grant in the join history, or (past its retention) the node name its first grant bound to it."""
        try:
            return bool(self.store.joins_for(agent_id)) or any(
                b.agent_id == agent_id for b in self.store.node_names()
            )
        except Exception as exc:
            raise StoreError("failed to read the join history", detail=str(exc)) from exc

    def _finish(
        self, pending: _Pending, proof: devid_pb2.EnrolRequest.Proof, call: Call
    ) -> devid_pb2.EnrolResponse:
        if not proof.activated or not proof.devid_signature:
            raise InvalidRequestError(
                "the proof lacks activated or devid_signature", reason="response_malformed"
            )
        ev.check_activation(pending.residency, proof.activated)
        ev.verify_possession(pending.devid_key, pending.nonce, proof.devid_signature)
        with call.committing():
            if self.store.is_banned(str(tpm_agent_id(self.trust_domain, pending.ek_hash))):
                raise BannedError("this machine's agent is banned")
            issued = self.ca.issue(pending.devid_key, pending.ek_hash, self.certificate_ttl)
            devid_id = devid_agent_id(self.trust_domain, issued.chain_der[0])
            call.set(
                devid_serial=str(issued.serial),
                devid_agent_id=str(devid_id),
                devid_expires_at=int(issued.not_after.timestamp()),
                devid_alg=_key_kind(pending.devid_key),
            )
            call.commit("devid_issued", "issued an LDevID certificate")
        log.info("issued LDevID %x for EK %s (%s)", issued.serial, pending.ek_hash, devid_id)
        return devid_pb2.EnrolResponse(
            result=devid_pb2.EnrolResponse.Result(
                certificate_chain=list(issued.chain_der),
                ca_certificate=self.ca.cert_der,
                agent_id=str(devid_id),
                expires_at=int(issued.not_after.timestamp()),
            )
        )


def _key_kind(key: ev.DevidKey) -> str:
    if isinstance(key, rsa.RSAPublicKey):
        return f"rsa-{key.key_size}"
    return f"ecc-{key.curve.name}"
