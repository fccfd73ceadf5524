"""The reason slugs that cross the wire: why the server refused a request.

Every refusal from ``nodeserver`` carries, beside its gRPC status code and a message for
people, a structured detail (see :mod:`protocol.status_details`) naming one of the reasons
below. Programs decide from the (status, reason) pair, never from the message text.

A reason belongs to a :class:`Family`, which says what kind of thing went wrong and so what a
client can do about it; a client that does not know a newer reason still knows its family.
The slug is also the ``reason`` field of the server's audit line and the ``reason`` label of
its metrics, so the three never disagree.

Slugs are lowercase ``[a-z0-9_]``; on the wire (``google.rpc.ErrorInfo.reason``) they are
upper case, as AIP-193 asks, and :func:`from_wire` maps them back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

DOMAIN = "nodetrust.io"
_SLUG_RE = re.compile(r"[a-z][a-z0-9_]{0,62}")


class Family(StrEnum):
    """What kind of refusal a reason is; decides what a client may do next."""

    REQUEST = "request"  # the request itself is malformed: retrying it unchanged cannot help
    EVIDENCE = "evidence"  # TPM evidence that is well-formed but does not prove what it claims
    EK_TRUST = "ek_trust"  # the server does not trust this TPM's EK (an operator adds the CA or hash)
    BAN = "ban"  # an operator banned this agent
    IDENTITY = "identity"  # the caller's identity is missing, foreign or unknown here: attest again
    POLICY = "policy"  # the node's report or request fails its pool's rules
    TIMEOUT = "timeout"  # a step took too long: retry
    LIMIT = "limit"  # a server limit (rate, size, concurrency): back off and retry
    SERVER = "server"  # the server could not do its part (store, token backend, audit log): retry
    CANCELLED = "cancelled"  # the client went away: nothing to do
    INTERNAL = "internal"  # a bug: see the server log


@dataclass(frozen=True)
class Reason:
    slug: str
    family: Family
    summary: str

    @property
    def wire(self) -> str:
        return self.slug.upper()


def _r(slug: str, family: Family, summary: str) -> Reason:
    if not _SLUG_RE.fullmatch(slug):  # pragma: no cover - guarded by a test over the table
        raise ValueError(f"bad reason slug {slug!r}")
    return Reason(slug, family, summary)


F = Family
REASONS: dict[str, Reason] = {
    r.slug: r
    for r in (
        # -- any RPC ----------------------------------------------------------------------
        _r("malformed_message", F.REQUEST, "the request is not a valid protobuf message of its type"),
        _r("message_too_large", F.LIMIT, "a request message exceeds the server's size limit"),
        _r("params_timeout", F.TIMEOUT, "the first message did not arrive within first_message_timeout"),
        _r("peer_limit", F.LIMIT, "too many concurrent requests or connections from one address"),
        _r("rate_limited", F.LIMIT, "too many attestations from one address per second"),
        _r("audit_unavailable", F.SERVER, "the server cannot write its audit log (disk full?)"),
        _r("store", F.SERVER, "the server's store is unavailable"),
        _r("internal", F.INTERNAL, "an unexpected server error"),
        _r("unimplemented", F.REQUEST, "the method is not served by nodeserver"),
        _r("cancelled", F.CANCELLED, "the client cancelled the request"),
        _r("invalid_argument", F.REQUEST, "the request is invalid"),
        _r("not_found", F.REQUEST, "what the request names does not exist here"),
        _r("denied", F.EVIDENCE, "the evidence is well-formed but not acceptable"),
        _r("integrity", F.SERVER, "the store refused a write"),
        _r("token_id_taken", F.SERVER, "a bootstrap token id collided with a recorded one"),
        _r("config", F.INTERNAL, "the server's configuration is invalid"),
        # -- AttestAgent --------------------------------------------------------------------
        _r("malformed_params", F.REQUEST, "the first message lacks params, attestation data or a CSR"),
        _r("stream_ended", F.REQUEST, "the client closed its side before the protocol was complete"),
        _r("unexpected_params", F.REQUEST, "a second params message instead of the challenge response"),
        _r("unknown_attestor", F.REQUEST, "the node attestor type is not served here"),
        _r("payload_malformed", F.REQUEST, "the attestation payload is not the attestor's JSON"),
        _r("payload_too_large", F.LIMIT, "the attestation payload exceeds max_payload_bytes"),
        _r("response_malformed", F.REQUEST, "the challenge response is not the attestor's JSON"),
        _r("bad_csr", F.REQUEST, "the CSR cannot be parsed or uses an unsupported key"),
        _r("bad_csr_signature", F.REQUEST, "the CSR's self-signature does not verify"),
        _r("ak_malformed", F.EVIDENCE, "the AK's TPM structures are truncated or inconsistent"),
        _r("ak_invalid", F.EVIDENCE, "the AK certification is not valid"),
        _r(
            "ak_attributes",
            F.EVIDENCE,
            "the AK lacks fixedTPM, restricted, fixedParent or sensitiveDataOrigin",
        ),
        _r("ak_weak_key", F.EVIDENCE, "the AK's key is too weak"),
        _r("ak_bad_signature", F.EVIDENCE, "the AK's creation certification signature does not verify"),
        _r("ak_not_tpm_generated", F.EVIDENCE, "the AK's certification is not TPM-generated"),
        _r("ak_name_mismatch", F.EVIDENCE, "the certification names another object than the AK"),
        _r("ak_creation_mismatch", F.EVIDENCE, "the creation data does not match the certification"),
        _r("wrong_secret", F.EVIDENCE, "the challenge answer is wrong: the EK and AK are not in one TPM"),
        _r("challenge_timeout", F.TIMEOUT, "the challenge was not answered within challenge_timeout"),
        _r("ek_unsupported", F.EVIDENCE, "the EK's algorithm or parameters are not supported"),
        _r("ek_not_trusted", F.EK_TRUST, "the EK is neither listed nor certified by a trusted CA"),
        _r("ek_hash_not_listed", F.EK_TRUST, "the EK hash is not in the server's hash allowlist"),
        _r("ek_cert_missing", F.EK_TRUST, "no EK certificate was sent and the mode needs one"),
        _r("ek_cert_unparsable", F.EK_TRUST, "the EK certificate cannot be parsed"),
        _r("ek_cert_profile", F.EK_TRUST, "the EK certificate breaks the TCG EK profile"),
        _r("ek_cert_key_mismatch", F.EK_TRUST, "the EK certificate is for another key than the EK"),
        _r("ek_cert_expired", F.EK_TRUST, "the EK certificate has expired"),
        _r("ek_cert_not_yet_valid", F.EK_TRUST, "the EK certificate is not valid yet"),
        _r("ek_issuer_unknown", F.EK_TRUST, "the EK certificate's issuer is not a trusted manufacturer CA"),
        _r("ek_chain_incomplete", F.EK_TRUST, "an intermediate CA of the EK certificate is missing"),
        _r("ek_chain_signature_invalid", F.EK_TRUST, "a signature in the EK certificate chain is invalid"),
        _r("ek_signature_algorithm_unsupported", F.EK_TRUST, "the EK chain uses an unsupported algorithm"),
        _r("ek_chain_invalid", F.EK_TRUST, "the EK certificate chain is invalid"),
        _r("banned", F.BAN, "an operator banned this agent"),
        _r("must_reattest", F.IDENTITY, "the agent renews its SVID by attesting again"),
        # -- tpm_devid attestation and DevID enrolment ---------------------------------------
        _r("devid_cert_malformed", F.REQUEST, "a DevID certificate of the chain cannot be parsed"),
        _r(
            "devid_cert_untrusted",
            F.EVIDENCE,
            "the DevID certificate does not chain to a trusted DevID CA (or is expired)",
        ),
        _r("devid_key_malformed", F.REQUEST, "DevIDPub is not a TPMT_PUBLIC of an RSA or ECC key"),
        _r(
            "devid_key_attributes",
            F.EVIDENCE,
            "the DevID key is not a TPM-generated, fixedTPM signing key with a SHA-256 scheme",
        ),
        _r("devid_key_mismatch", F.EVIDENCE, "the DevID certificate is for another key than DevIDPub"),
        _r(
            "devid_signature",
            F.EVIDENCE,
            "the DevID key's signature over the server's nonce does not verify",
        ),
        _r("ek_public_malformed", F.REQUEST, "EKPub is not a TPMT_PUBLIC of an RSA key"),
        _r(
            "certify_malformed",
            F.REQUEST,
            "the DevID certification is not a TPMS_ATTEST with a TPMT_SIGNATURE",
        ),
        _r("certify_invalid", F.EVIDENCE, "the DevID certification is not a TPM-generated TPM2_Certify"),
        _r("certify_signature", F.EVIDENCE, "the DevID certification is not signed by the AK"),
        _r("certify_name_mismatch", F.EVIDENCE, "the certification names another object than the DevID key"),
        _r("devid_unavailable", F.REQUEST, "this server does not enrol DevIDs"),
        _r("not_joined", F.POLICY, "a DevID is issued only to a machine this server admitted by a join"),
        # -- Join ---------------------------------------------------------------------------
        _r("unauthenticated", F.IDENTITY, "no agent SVID of this trust domain was presented"),
        _r("not_attested", F.IDENTITY, "the server does not know this agent as attested"),
        _r("unknown_pool", F.POLICY, "the pool is not configured on the server"),
        _r("bad_node_name", F.REQUEST, "the node name is not a valid Kubernetes node name"),
        _r("stale_request", F.REQUEST, "the request's time is outside the server's clock-skew window"),
        _r("bad_request_id", F.REQUEST, "the request id is not 32 lowercase hex characters"),
        _r("bad_report", F.REQUEST, "the verification report is malformed"),
        _r("policy", F.POLICY, "the verification report fails the pool's policy"),
        _r("replay", F.REQUEST, "the request id was already used"),
        _r("join_rate_limited", F.LIMIT, "too many join requests from this agent in the window"),
        _r("token_backend", F.SERVER, "the bootstrap-token backend failed"),
        _r("token_conflict", F.SERVER, "the backend already holds a token with this id"),
        _r("unknown_token", F.REQUEST, "the token is not this agent's live token"),
        # -- measured boot and identity (Join) -------------------------------------------------
        _r("quote_missing", F.REQUEST, "the pool checks measured boot and the request carries no quote"),
        _r("quote_no_ak", F.IDENTITY, "the server holds no AK for this agent: attest again"),
        _r("quote_malformed", F.REQUEST, "the quote or its signature is not a TPM structure"),
        _r("quote_signature", F.EVIDENCE, "the quote is not signed by the AK this agent attested with"),
        _r(
            "quote_nonce",
            F.EVIDENCE,
            "the quote is not over this request's nonce (stale, foreign or replayed)",
        ),
        _r("quote_selection", F.EVIDENCE, "the quote does not cover the PCRs the pool requires"),
        _r("quote_bank", F.EVIDENCE, "the quote or the log lacks the PCR bank the pool requires"),
        _r("eventlog_malformed", F.REQUEST, "the event log is not a TCG crypto-agile log"),
        _r("eventlog_replay", F.EVIDENCE, "the event log does not replay to the quoted PCRs"),
        _r("boot_not_accepted", F.POLICY, "the node booted something the pool's releases do not measure"),
        _r("node_name_taken", F.POLICY, "the node name belongs to another machine's EK"),
        _r("not_enrolled", F.POLICY, "the pool admits only enrolled machines and this EK is not"),
        _r("enrolment_mismatch", F.POLICY, "the machine is enrolled with another node name or pool"),
        _r("measurement_changed", F.POLICY, "a joined node's boot measurements changed"),
    )
}


def get(slug: str) -> Reason:
    """The registered reason; an unregistered slug is a bug (KeyError)."""
    return REASONS[slug]


def from_wire(value: str) -> Reason | None:
    """The reason for an ``ErrorInfo.reason`` (upper case); None for one this build does not know."""
    return REASONS.get(value.lower()) if value else None
