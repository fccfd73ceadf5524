"""SPIRE's built-in ``tpm_devid`` node attestor, server side, byte-compatible with spire-server v1.13.3.

:meth:`TpmDevidAttestor.decode` parses the payload (:mod:`protocol.tpm_devid`) and every structure in
it; :meth:`TpmDevidAttestor.begin` verifies, in spire-server's order, the DevID chain to the DevID
trust anchors, the EK (``ek_trust``: its certificate chain or hash, and that the certificate is for
EKPub), and the AK's TPM2_Certify of the DevID key, then builds the one challenge: a nonce for the
DevID key to sign (proof of possession) and a credential only the TPM holding the EK and the AK can
activate (proof of residency). :meth:`TpmDevidAttestor.finish` checks both answers.

Stricter than spire-server (server.devid.evidence): the AK must be a restricted, fixedTPM signing
key, the certification unqualified, TPM-generated and of type certify, the DevID key a fixedTPM
signing key, **and the DevID certificate's public key must be DevIDPub** (spire-server verifies the
possession signature with the certificate's key and the certification with DevIDPub's, without
tying the two). A machine whose EK identity (``spire/agent/tpm/<EK hash>``) is banned is refused.

Identity and selectors are spire-server's: ``spiffe://<td>/spire/agent/tpm_devid/<SHA-1 of the leaf
DER>``, ``tpm_devid:subject:cn:``, ``tpm_devid:issuer:cn:``, ``tpm_devid:ca:fingerprint:`` per CA.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cryptography import x509

from protocol import reasons, tpm2
from protocol.errors import ProtocolError
from protocol.spiffe import SpiffeId, tpm_agent_id
from protocol.tpm_devid import (
    ATTESTOR_TYPE,
    AttestationRequest,
    ChallengeRequest,
    decode_attestation_request,
    decode_challenge_response,
    encode_challenge,
)
from protocol.tpm_payload import EkData
from server.devid import evidence as ev
from server.devid.chain import (
    ChainError,
    VerifiedChain,
    fingerprint,
    parse_chain,
    selector_values,
    verify_chain,
)
from server.errors import AttestationDeniedError, InvalidRequestError
from server.tpm_attestor import AttestResult, EkTrustLike, PendingAttestation


@dataclass(frozen=True)
class DevidEvidence:
    """A decoded payload: every structure parsed, nothing verified yet."""

    agent_id: SpiffeId
    ek: EkData
    request: AttestationRequest
    ek_public: tpm2.Public
    ak_public: tpm2.Public
    devid_public: tpm2.Public
    certification: ev.Certification


@dataclass(frozen=True, repr=False)
class DevidPending(PendingAttestation):
    """What the server keeps between the challenge and the answer (memory only)."""

    nonce: bytes = b""
    residency: ev.Residency | None = None
    devid_key: ev.DevidKey | None = None
    selectors: tuple[str, ...] = field(default=())

    def __repr__(self) -> str:  # never print the nonces
        return f"DevidPending(agent_id={self.agent_id}, ek_method={self.ek_method})"


def devid_agent_id(trust_domain: str, leaf_der: bytes) -> SpiffeId:
    """``spiffe://<td>/spire/agent/tpm_devid/<hex SHA-1 of the DevID leaf DER>``."""
    return SpiffeId(trust_domain, f"/spire/agent/{ATTESTOR_TYPE}/{fingerprint(leaf_der)}")


class TpmDevidAttestor:
    """Server half of ``tpm_devid`` for one trust domain."""

    name = ATTESTOR_TYPE

    def __init__(
        self,
        trust_domain: str,
        ek_trust: EkTrustLike,
        devid_roots: Callable[[], Sequence[x509.Certificate]],
        *,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.trust_domain = trust_domain
        self.ek_trust = ek_trust
        self.devid_roots = devid_roots
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))

    def decode(self, payload: bytes) -> DevidEvidence:
        try:
            req = decode_attestation_request(payload)
        except ProtocolError as exc:
            raise InvalidRequestError(f"tpm_devid payload: {exc}", reason="payload_malformed") from exc
        try:
            parse_chain(req.devid_cert)
        except ChainError as exc:
            raise InvalidRequestError(str(exc), reason="devid_cert_malformed") from exc
        devid = ev.parse_devid_key(req.devid_pub)
        ek_public = ev.parse_ek_public(req.ek_pub)
        ak = ev.parse_ak(req.ak_pub)
        cert = ev.parse_certification(req.certified_devid, req.certification_signature)
        try:
            ek = EkData(public_key_der=ev.ek_spki(ek_public), certificate_der=req.ek_cert)
        except ProtocolError as exc:  # pragma: no cover - parse_ek_public built the key already
            raise InvalidRequestError(str(exc), reason="ek_public_malformed") from exc
        return DevidEvidence(
            agent_id=devid_agent_id(self.trust_domain, req.devid_cert[0]),
            ek=ek,
            request=req,
            ek_public=ek_public,
            ak_public=ak,
            devid_public=devid,
            certification=cert,
        )

    def _verified_chain(self, req: AttestationRequest) -> VerifiedChain:
        try:
            return verify_chain(req.devid_cert, self.devid_roots(), self.clock())
        except ChainError as exc:
            code = "devid_cert_malformed" if exc.malformed else "devid_cert_untrusted"
            raise AttestationDeniedError(str(exc), reason=code) from exc

    def begin(self, evidence: DevidEvidence) -> DevidPending:
        chain = self._verified_chain(evidence.request)
        ev.check_devid_key(evidence.devid_public)
        key = ev.devid_public_key(evidence.devid_public)
        if ev.spki_of(key) != ev.cert_spki(chain.leaf):
            raise AttestationDeniedError(
                "the DevID certificate is for another key than DevIDPub", reason="devid_key_mismatch"
            )
        verdict = self.ek_trust.verify(evidence.ek)
        if not verdict.trusted:
            code = verdict.reason_code if verdict.reason_code in reasons.REASONS else "ek_not_trusted"
            raise AttestationDeniedError(
                f"cannot verify EK signature: {reasons.get(code).summary}",
                reason=code,
                detail=verdict.reason,
            )
        ek_hash = evidence.ek.pub_hash
        ev.check_ak(evidence.ak_public)
        ev.check_certification(evidence.ak_public, evidence.devid_public, evidence.certification)
        residency = ev.residency_challenge(evidence.ak_public, evidence.ek_public)
        nonce = os.urandom(ev.NONCE_BYTES)
        challenge = encode_challenge(ChallengeRequest(nonce, residency.credential, residency.secret))
        return DevidPending(
            agent_id=evidence.agent_id,
            ek_hash=ek_hash,
            ek_method=verdict.method,
            challenge=challenge,
            _secret=b"",
            nonce=nonce,
            residency=residency,
            devid_key=key,
            selectors=tuple(f"{self.name}:{v}" for v in selector_values(chain)),
        )

    def finish(self, pending: DevidPending, response: bytes) -> AttestResult:
        try:
            answer = decode_challenge_response(response)
        except ProtocolError as exc:
            raise InvalidRequestError(
                f"tpm_devid challenge response: {exc}", reason="response_malformed"
            ) from exc
        if pending.devid_key is None or pending.residency is None:  # pragma: no cover - begin sets both
            raise InvalidRequestError("no challenge is pending", reason="response_malformed")
        ev.verify_possession(pending.devid_key, pending.nonce, answer.signature)
        ev.check_activation(pending.residency, answer.cert_info)
        return AttestResult(
            agent_id=pending.agent_id,
            ek_hash=pending.ek_hash,
            selectors=pending.selectors,
            can_reattest=True,
            # A machine whose EK identity is banned is refused in the store step (AgentService).
            also_unbanned=(str(tpm_agent_id(self.trust_domain, pending.ek_hash)),),
        )
