"""The one table from a server's refusal to what the agent does about it.

A refusal is a gRPC status plus, from ``nodeserver``, a structured detail in the
``grpc-status-details-bin`` trailer naming a reason slug and its family
(:mod:`protocol.reasons`, :mod:`protocol.status_details`). A real spire-server sends
only SPIRE's ``PermissionDeniedDetails`` (``AGENT_BANNED``, ...), sometimes nothing; an
older nodeserver sends nothing. :func:`refusal` looks the refusal up in :data:`RULES`
and returns the :class:`~agent.errors.AgentError` to raise: its class (and so its
permanence and exit status), its hint, and the lifecycle action.

Lookup, most specific first; the first row that exists wins::

    (rpc, status, slug)  (rpc, -, slug)  (-, status, slug)  (-, -, slug)       the reason
    (rpc, status, family) (rpc, -, family) (-, status, family) (-, -, family)   its family
    (rpc, status, -)  (-, status, -)  (rpc, -, -)  (-, -, -)                    no usable detail

A reason this build does not know still has its family (sent in the detail's
metadata), so a newer server's refusals land on the family row. The server's message
is for people: it is shown (shortened) and stored, and nothing here looks inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from google.protobuf.message import DecodeError
from grpclib.encoding.base import StatusDetailsCodecBase

from agent.errors import (
    Action,
    AttestationRefusedError,
    BannedError,
    JoinRefusedError,
    NotAttestedError,
    RefusalError,
    RefusedForNowError,
)
from protocol import status_details
from protocol.reasons import REASONS, Family, Reason

MAX_MESSAGE_CHARS = 512  # of the server's message kept in errors, logs and the state file


class Rpc(StrEnum):
    ATTEST = "attest"  # spire.api.server.agent.v1.Agent/AttestAgent
    JOIN = "join"  # nodetrust.join.v1.Join/BeginJoin and RequestJoin
    REPORT_JOINED = "report_joined"  # nodetrust.join.v1.Join/ReportJoined
    RECHECK = "recheck"  # nodetrust.join.v1.Join/Recheck (a joined node's measured boot, again)


@dataclass(frozen=True)
class Rule:
    """What a refusal becomes. Permanence and the exit status come with the class."""

    error: type[RefusalError]
    hint: str
    action: Action | None = None  # None: the class's own action

    @property
    def permanent(self) -> bool:
        return self.error.permanent

    @property
    def effective_action(self) -> Action:
        return self.action if self.action is not None else self.error.action


Match = str | Family | None  # a reason slug, a family, or None for "no usable detail"
Key = tuple[Rpc | None, str | None, Match]

# SPIRE's PermissionDeniedDetails.Reason -> our slug (protocol.status_details sends both).
SPIRE_REASONS = {
    "AGENT_BANNED": "banned",
    "AGENT_MUST_REATTEST": "must_reattest",
    "AGENT_NOT_ATTESTED": "not_attested",
}

A, J, R, C = Rpc.ATTEST, Rpc.JOIN, Rpc.REPORT_JOINED, Rpc.RECHECK
_AUDIT = "see the server's audit log for this attempt"
_VERSIONS = "the agent and the server may be of different versions: " + _AUDIT
_EK_TRUST = (
    "the server does not trust this TPM's EK: add the manufacturer CA to the server's ek_trust.ca_dir, "
    "or add the EK hash (nodeagent attest --print-ek-hash) to ek_trust.hash_dir"
)
_FOR_NOW = "the server cannot do its part right now (see its log); the agent retries with backoff"
_LIMIT = "the server is limiting this node or address; the agent backs off and retries"
_SLOW = "the TPM or the network was too slow; the agent retries"
_ATTEST_AGAIN = "the server does not know this node (its store was reset?): the agent attests again"
_BANNED = (
    "an operator banned this node: `nodeserver agents unban <SPIFFE ID>` lifts it; "
    "then `systemctl reset-failed nodeagent && systemctl start nodeagent`"
)
_PERMANENT_STATUSES = (
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "UNIMPLEMENTED",
    "NOT_FOUND",
    "OUT_OF_RANGE",
    "PERMISSION_DENIED",
)

_PERMANENT_FAMILY_HINTS = {
    Family.REQUEST: _VERSIONS,
    Family.EVIDENCE: "the TPM's evidence did not verify: " + _AUDIT,
    Family.EK_TRUST: _EK_TRUST,
    Family.POLICY: "the server's policy refuses this node: fix what the message names, or join another pool",
}

# Reasons of the measured-boot check and of the name binding, at BeginJoin, RequestJoin and Recheck.
_MEASURED_BOOT: dict[str, Rule] = {
    "quote_missing": Rule(
        JoinRefusedError,
        "the pool checks measured boot but the request had no quote: BeginJoin named no PCRs, so the broker "
        "and its pools disagree (restart nodeserver after changing pools); " + _AUDIT,
    ),
    "quote_no_ak": Rule(
        NotAttestedError,
        "the server holds no AK for this agent (it attested before quotes): the agent attests again",
    ),
    "quote_signature": Rule(
        JoinRefusedError,
        "the quote is not signed by the AK the server recorded: the agent attests again once (its kept AK and "
        "the server's record may be of different attestations); if it is refused again, this TPM is not the one "
        "that attested: " + _AUDIT,
        action=Action.ATTEST_AGAIN,
    ),
    "quote_nonce": Rule(
        RefusedForNowError,
        "the nonce expired or was used before the quote arrived: the agent asks for a new one",
    ),
    "quote_malformed": Rule(JoinRefusedError, _VERSIONS),
    "quote_selection": Rule(JoinRefusedError, _VERSIONS),
    "quote_bank": Rule(
        JoinRefusedError,
        "this TPM (or its firmware's event log) lacks the PCR bank the pool quotes: enable the SHA-256 PCR bank in "
        "the firmware's TPM settings (SHA-1-only TPMs cannot join a pool that checks measured boot)",
    ),
    "eventlog_malformed": Rule(
        JoinRefusedError,
        "the firmware's event log is not a TCG crypto-agile log (a TPM 1.2-style SHA-1 log?): update the firmware "
        "or check event_log",
    ),
    "eventlog_replay": Rule(
        RefusedForNowError,
        "the event log does not replay to the quoted PCRs (a PCR extended between reading the log and quoting, or "
        "a log that is not this boot's): the agent retries; " + _AUDIT,
    ),
    "boot_not_accepted": Rule(
        JoinRefusedError,
        "this node booted something the pool's releases do not measure (the message names the PCR and the event): "
        "reinstall it with a release the pool lists, or list this release's boot-measurements.json in "
        "pools.<pool>.measured_boot.releases",
    ),
    "measurement_changed": Rule(
        JoinRefusedError,
        "this joined node's boot measurements changed since it was admitted (a new kernel, initrd, command line or "
        "boot configuration): reinstall an accepted release, or have an operator admit the new one",
    ),
    "node_name_taken": Rule(
        JoinRefusedError,
        "another machine joined under this node name first: set node_name to this machine's own name, or an "
        "operator releases the name (`nodeserver names release`)",
    ),
    "not_enrolled": Rule(
        JoinRefusedError,
        "the pool admits only enrolled machines: an operator enrols this EK (`nodeserver enrol add`, the EK hash "
        "from `nodeagent attest --print-ek-hash`)",
    ),
    "enrolment_mismatch": Rule(
        JoinRefusedError,
        "this machine is enrolled with another node name or pool: set node_name and pool to its enrolment",
    ),
}

RULES: dict[Key, Rule] = {
    # -- reasons that need their own hint or class -------------------------------------------
    (None, None, "banned"): Rule(BannedError, _BANNED),
    (None, None, "not_attested"): Rule(NotAttestedError, _ATTEST_AGAIN),
    (A, None, "not_joined"): Rule(
        AttestationRefusedError,
        "nodeserver issues a DevID only to a machine it admitted by a join: join first (`nodeagent run`), or the "
        "operator turns devid.require_join off",
    ),
    (J, None, "unauthenticated"): Rule(
        NotAttestedError, "the broker saw no SVID of its trust domain: the agent attests again"
    ),
    (A, None, "must_reattest"): Rule(RefusedForNowError, "the server asks for a new attestation: retrying"),
    (A, None, "payload_too_large"): Rule(
        AttestationRefusedError,
        "the attestation payload (EK certificate and AK) exceeds the server's max_payload_bytes: raise it there",
    ),
    (A, None, "message_too_large"): Rule(
        AttestationRefusedError, "the request exceeds the server's message size limit: raise it there"
    ),
    (J, None, "message_too_large"): Rule(
        JoinRefusedError,
        "the verification report exceeds the broker's message size limit: raise it there, or check fewer GPUs",
    ),
    (A, None, "unknown_attestor"): Rule(
        AttestationRefusedError,
        'the server does not serve the tpm node attestor: enable it (SPIRE: the "tpm" NodeAttestor plugin)',
    ),
    (None, None, "unimplemented"): Rule(JoinRefusedError, "the server is older than this agent: upgrade it"),
    (A, None, "unimplemented"): Rule(
        AttestationRefusedError, "the server is older than this agent: upgrade it"
    ),
    (A, None, "ek_hash_not_listed"): Rule(
        AttestationRefusedError,
        "add this EK's hash (nodeagent attest --print-ek-hash) to the server's ek_trust.hash_dir",
    ),
    (A, None, "ek_cert_missing"): Rule(
        AttestationRefusedError,
        "this TPM has no EK certificate in NV (common on Intel PTT and AMD fTPM): trust it on the server by "
        "EK hash (nodeagent attest --print-ek-hash into ek_trust.hash_dir)",
    ),
    (A, None, "ek_chain_incomplete"): Rule(
        AttestationRefusedError, "add the manufacturer's intermediate CA to the server's ek_trust.ca_dir"
    ),
    (A, None, "ek_issuer_unknown"): Rule(
        AttestationRefusedError, "add the TPM manufacturer's CA certificates to the server's ek_trust.ca_dir"
    ),
    (A, None, "ek_cert_expired"): Rule(
        AttestationRefusedError,
        "the EK certificate has expired (check this node's and the server's clocks): trust this EK by hash",
    ),
    (A, None, "ek_cert_not_yet_valid"): Rule(
        AttestationRefusedError, "the EK certificate is not valid yet: check the server's clock"
    ),
    (A, None, "ek_unsupported"): Rule(
        AttestationRefusedError, "the server does not support this EK: try the other ek_alg (rsa or ecc)"
    ),
    (A, None, "wrong_secret"): Rule(
        AttestationRefusedError,
        "the EK and the AK did not answer as one TPM: check that the TCTI names this node's TPM; " + _AUDIT,
    ),
    **{
        (rpc, None, "unknown_pool"): Rule(
            JoinRefusedError, "set pool to one of the pools the server configures (docs/join.md)"
        )
        for rpc in (J, R)
    },
    **{
        (rpc, None, "policy"): Rule(
            JoinRefusedError,
            "fix the failing checks (nodeagent check --pool <profile>) or join another pool",
        )
        for rpc in (J, R)
    },
    **{
        (rpc, None, "bad_node_name"): Rule(
            JoinRefusedError, "set node_name to a Kubernetes node name (lower-case DNS-1123 subdomain)"
        )
        for rpc in (J, R)
    },
    (None, None, "stale_request"): Rule(
        RefusedForNowError,
        "this node's clock is off the server's: synchronise it (chrony, systemd-timesyncd)",
    ),
    (None, None, "replay"): Rule(RefusedForNowError, "the broker saw this request id before; retrying"),
    **{
        (rpc, None, "unknown_token"): Rule(
            JoinRefusedError, "the broker no longer holds this token (replaced or swept): nothing to revoke"
        )
        for rpc in (J, R)
    },
    (None, None, "challenge_timeout"): Rule(RefusedForNowError, _SLOW),
    # -- measured boot and identity (BeginJoin, RequestJoin, Recheck): rows of their own below --
    **{(rpc, None, slug): rule for rpc in (J, C) for slug, rule in _MEASURED_BOOT.items()},
    # -- families: reasons without a row of their own, including ones newer than this agent ---
    # The permanent families: each RPC's own class (exit 6 for attestation, 8 for the broker).
    **{
        (rpc, None, family): Rule(AttestationRefusedError if rpc is A else JoinRefusedError, hint)
        for rpc in Rpc
        for family, hint in _PERMANENT_FAMILY_HINTS.items()
    },
    (None, None, Family.BAN): Rule(BannedError, _BANNED),
    (A, None, Family.IDENTITY): Rule(RefusedForNowError, "the server asks for a new attestation: retrying"),
    (None, None, Family.IDENTITY): Rule(NotAttestedError, _ATTEST_AGAIN),
    (None, None, Family.TIMEOUT): Rule(RefusedForNowError, _SLOW),
    (None, None, Family.LIMIT): Rule(RefusedForNowError, _LIMIT),
    (None, None, Family.SERVER): Rule(RefusedForNowError, _FOR_NOW),
    (None, None, Family.CANCELLED): Rule(RefusedForNowError, "the request was cancelled; retrying"),
    (None, None, Family.INTERNAL): Rule(
        RefusedForNowError, "a server bug: see the server's log; the agent retries"
    ),
    # -- no usable detail (an older nodeserver, a spire-server, a proxy) -------------------------
    **{(A, s, None): Rule(AttestationRefusedError, _AUDIT) for s in _PERMANENT_STATUSES},
    (A, "UNAUTHENTICATED", None): Rule(AttestationRefusedError, _AUDIT),
    # Without the detail, "not attested" and "banned" or "policy" look alike: attest anew once,
    # and if the broker still refuses, stop.
    (J, "PERMISSION_DENIED", None): Rule(
        JoinRefusedError,
        "the broker gave no reason (an older nodeserver?): the agent attests again once, then stops; "
        + _AUDIT,
        action=Action.ATTEST_AGAIN,
    ),
    (J, "UNAUTHENTICATED", None): Rule(NotAttestedError, _ATTEST_AGAIN),
    **{
        (J, s, None): Rule(JoinRefusedError, _AUDIT) for s in _PERMANENT_STATUSES if s != "PERMISSION_DENIED"
    },
    **{
        (R, s, None): Rule(JoinRefusedError, "the broker did not take the report: " + _AUDIT)
        for s in (*_PERMANENT_STATUSES, "UNAUTHENTICATED")
    },
    (None, "DEADLINE_EXCEEDED", None): Rule(RefusedForNowError, _SLOW),
    (None, "RESOURCE_EXHAUSTED", None): Rule(RefusedForNowError, _LIMIT),
    (None, None, None): Rule(RefusedForNowError, _FOR_NOW),
}


@dataclass(frozen=True)
class Lookup:
    rule: Rule
    reason: Reason | None  # the reason the lookup went by (from the detail or SPIRE's detail)
    family: Family | None
    key: Key  # the row that matched


def _family(detail: status_details.ErrorDetail, reason: Reason | None) -> Family | None:
    if reason is not None:
        return reason.family
    try:
        return Family(detail.family) if detail.family else None
    except ValueError:
        return None


def lookup(rpc: Rpc, status: str, detail: status_details.ErrorDetail | None) -> Lookup:
    """The row for a refusal of ``rpc`` with gRPC status ``status`` and the decoded ``detail``."""
    detail = detail or status_details.ErrorDetail(reason=None)
    reason = detail.reason
    if reason is None and detail.spire_reason in SPIRE_REASONS:
        reason = REASONS[SPIRE_REASONS[detail.spire_reason]]
    family = _family(detail, reason)
    keys: list[Key] = []
    for match in (reason.slug if reason else None, family):
        if match is not None:
            keys += [(rpc, status, match), (rpc, None, match), (None, status, match), (None, None, match)]
    keys += [(rpc, status, None), (None, status, None), (rpc, None, None), (None, None, None)]
    for key in keys:
        rule = RULES.get(key)
        if rule is not None:
            return Lookup(rule, reason, family, key)
    raise AssertionError("RULES has no default row")  # pragma: no cover - the table has one


_WHAT = {
    Rpc.ATTEST: "attestation refused by the server",
    Rpc.JOIN: "join refused by the broker",
    Rpc.REPORT_JOINED: "the broker did not take the join report",
    Rpc.RECHECK: "the re-check of this node's boot was refused by the broker",
}


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A server's message bounded for logs and the state file (it is untrusted and unbounded)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


MAX_RETRY_AFTER_S = 3600.0  # a server's RetryInfo is honoured up to this long


def _bounded_delay(value: float | None) -> float | None:
    if value is None or not value > 0:  # also refuses NaN
        return None
    return min(value, MAX_RETRY_AFTER_S)


def refusal(rpc: Rpc, status: str, message: str, detail: status_details.ErrorDetail | None) -> RefusalError:
    """The error to raise for a refusal; see the module docstring."""
    found = lookup(rpc, status, detail)
    slug = found.reason.slug if found.reason else ""
    label = f"{status}, {slug}" if slug else status
    error = found.rule.error(
        f"{_WHAT[rpc]} ({label}): {shorten(message or status)}",
        hint=found.rule.hint,
        code=status,
        reason=slug,
        wire_reason=shorten(detail.wire_reason, 64) if detail else "",
        retry_after_s=_bounded_delay(detail.retry_after_s if detail else None),
    )
    if found.rule.action is not None:
        error.action = found.rule.action
    return error


def from_grpc_error(rpc: Rpc, exc: Any) -> RefusalError:
    """:func:`refusal` for a ``grpclib.exceptions.GRPCError`` from a channel with :class:`DetailsCodec`."""
    detail = exc.details if isinstance(exc.details, status_details.ErrorDetail) else None
    return refusal(rpc, exc.status.name, exc.message or "", detail)


class DetailsCodec(StatusDetailsCodecBase):
    """grpclib's ``status_details_codec``: the trailer decoded into a :class:`ErrorDetail`.

    Decoding is lenient (anything unreadable is no detail) and bounded
    (:data:`protocol.status_details.MAX_DETAILS_BYTES`). The agent never sends details.
    """

    def encode(self, status: Any, message: str | None, details: Any) -> bytes:
        raise TypeError("the agent never sends status details (they are the server's to send)")

    def decode(self, status: Any, message: str | None, data: bytes) -> status_details.ErrorDetail:
        try:
            return status_details.decode(data)
        except (DecodeError, ValueError, TypeError):  # a packed detail whose own bytes are corrupt
            return status_details.ErrorDetail(reason=None)
