"""agent.refusals: every reason the server can send maps to a class, a hint and a permanence, from real trailers."""

from __future__ import annotations

import inspect

import pytest

import agent.errors
from agent.errors import (
    EXIT_STATUSES,
    Action,
    AttestationRefusedError,
    BannedError,
    JoinRefusedError,
    NotAttestedError,
    RefusalError,
    RefusedForNowError,
)
from agent.refusals import RULES, SPIRE_REASONS, DetailsCodec, Rpc, lookup, refusal
from protocol import status_details
from protocol.reasons import REASONS, Family

# The status the server sends each family with (and a few others: the table must not care).
STATUSES = ("PERMISSION_DENIED", "INVALID_ARGUMENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "NOT_FOUND")
TRANSIENT_FAMILIES = {Family.TIMEOUT, Family.LIMIT, Family.SERVER, Family.CANCELLED, Family.INTERNAL}
# Reasons whose row differs from their family's on purpose, and why.
EXCEPTIONS = {
    "stale_request": "a clock that is off gets synchronised: retry",
    "replay": "the next attempt has a new request id: retry",
    "payload_too_large": "the same payload is too large every time: permanent",
    "message_too_large": "the same message is too large every time: permanent",
    "must_reattest": "at AttestAgent, attesting again is the retry",
    "unauthenticated": "identity at the join step: attest again",
    "not_attested": "identity: attest again",
    "quote_nonce": "an expired or used nonce: the next attempt asks BeginJoin for a new one",
    "eventlog_replay": "a PCR extended between reading the log and quoting: the next quote may match",
}


def decoded(slug: str, status: str = "PERMISSION_DENIED") -> status_details.ErrorDetail:
    """Through the real wire encoding and the agent's grpclib codec."""
    raw = status_details.encode(status, "a message for people", REASONS[slug])
    return DetailsCodec().decode(None, "a message for people", raw)


@pytest.mark.parametrize("slug", sorted(REASONS))
@pytest.mark.parametrize("rpc", list(Rpc))
def test_every_reason_maps_to_a_class_a_hint_and_a_permanence(slug: str, rpc: Rpc) -> None:
    reason = REASONS[slug]
    for status in STATUSES:
        error = refusal(rpc, status, "whatever the server says", decoded(slug, status))
        assert isinstance(error, RefusalError)
        assert error.hint.strip(), f"{slug} at {rpc}: no hint"
        assert isinstance(error.permanent, bool)
        assert error.reason == slug and error.code == status
        assert error.exit_code in {e.code for e in EXIT_STATUSES}
        if slug in EXCEPTIONS:
            continue
        if reason.family in TRANSIENT_FAMILIES:
            assert not error.permanent, f"{slug} ({reason.family}) must be retried"
        elif reason.family is Family.BAN:
            assert type(error) is BannedError
        elif reason.family is Family.IDENTITY:
            assert not error.permanent
        else:
            assert error.permanent, f"{slug} ({reason.family}) cannot be fixed by retrying"
            expected = AttestationRefusedError if rpc is Rpc.ATTEST else JoinRefusedError
            assert isinstance(error, expected), f"{slug} at {rpc}: {type(error).__name__}"


def test_the_exceptions_are_real_reasons() -> None:
    assert set(EXCEPTIONS) <= set(REASONS)


def test_every_slug_row_names_a_known_reason() -> None:
    for _rpc, _status, match in RULES:
        if isinstance(match, str) and not isinstance(match, Family):
            assert match in REASONS, (
                f"the table has a row for {match!r}, which protocol.reasons does not define"
            )


def test_identity_at_the_broker_attests_again() -> None:
    for slug in ("not_attested", "unauthenticated"):
        error = refusal(Rpc.JOIN, "PERMISSION_DENIED", "", decoded(slug))
        assert isinstance(error, NotAttestedError) and error.action is Action.ATTEST_AGAIN


@pytest.mark.parametrize("spire", sorted(SPIRE_REASONS))
def test_spire_details_alone(spire: str) -> None:
    """spire-server sends only PermissionDeniedDetails; the agent maps it to the same slug."""
    detail = status_details.ErrorDetail(reason=None, spire_reason=spire)
    found = lookup(Rpc.ATTEST, "PERMISSION_DENIED", detail)
    assert found.reason is not None and found.reason.slug == SPIRE_REASONS[spire]
    # And our own server sends both, which must agree.
    both = decoded(SPIRE_REASONS[spire])
    assert both.spire_reason == spire


@pytest.mark.parametrize("status", sorted(status_details.CODES))
@pytest.mark.parametrize("rpc", list(Rpc))
def test_without_detail_every_status_has_a_row(rpc: Rpc, status: str) -> None:
    for detail in (None, status_details.decode(b"\x0a\xff garbage"), status_details.decode(b"x" * 20000)):
        error = refusal(rpc, status, "m", detail)
        assert error.hint and error.reason  # the exit class's name when the server gave no reason


def test_messages_do_not_decide() -> None:
    """Same status and detail, any message: the same class, reason, permanence and action."""
    messages = ["", "agent is banned", "has not attested", "fails pool gpu", "unknown pool", "x" * 10_000]
    for rpc in Rpc:
        for detail in (None, decoded("policy"), decoded("not_attested"), decoded("store", "UNAVAILABLE")):
            seen = {
                (type(e), e.reason, e.permanent, e.action)
                for e in (refusal(rpc, "PERMISSION_DENIED", m, detail) for m in messages)
            }
            assert len(seen) == 1, (rpc, detail, seen)


def test_server_messages_are_bounded() -> None:
    error = refusal(Rpc.JOIN, "PERMISSION_DENIED", "y" * 100_000 + "\nforged: line", decoded("policy"))
    assert len(error.message) < 700 and "\n" not in error.message


def test_an_unknown_family_still_gets_the_status_row() -> None:
    detail = status_details.ErrorDetail(reason=None, wire_reason="FUTURE", family="not-a-family")
    assert type(refusal(Rpc.JOIN, "UNAVAILABLE", "", detail)) is RefusedForNowError


def test_refusal_classes_are_the_errors_tables() -> None:
    classes = {
        c for _, c in inspect.getmembers(agent.errors, inspect.isclass) if issubclass(c, RefusalError)
    }
    assert {rule.error for rule in RULES.values()} <= classes


def test_a_corrupt_packed_detail_is_no_detail() -> None:
    """A Status whose ErrorInfo bytes are corrupt must not escape the codec as a DecodeError."""
    from google.protobuf import any_pb2
    from google.rpc import status_pb2

    corrupt = any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff\xff")
    raw = status_pb2.Status(code=7, details=[corrupt]).SerializeToString()
    detail = DetailsCodec().decode(None, "m", raw)
    assert detail.reason is None
    assert type(refusal(Rpc.JOIN, "PERMISSION_DENIED", "m", detail)) is JoinRefusedError
