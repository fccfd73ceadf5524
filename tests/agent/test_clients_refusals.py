"""The agent's gRPC clients against a real gRPC server that refuses with real ``grpc-status-details-bin`` trailers.

Each refusal becomes the error class, reason, permanence and action of agent.refusals' table,
decided from the status and the detail: a message that says one thing while the detail says
another follows the detail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.attest_client import ServerTarget, attest_async
from agent.errors import (
    Action,
    AttestationRefusedError,
    BannedError,
    JoinConfigError,
    JoinRefusedError,
    NotAttestedError,
    RefusedForNowError,
)
from agent.join_client import report_joined_async, request_join_async, token_id
from agent.svid import SvidStore
from protocol import status_details
from protocol.reasons import get
from tests.agent.conftest import AGENT_ID, TRUST_DOMAIN, TinyServer, abort_with, joined_reply
from tests.support.simtpm import SimulatedTpm

PD = grpc.StatusCode.PERMISSION_DENIED


def details(slug: str, code: str = "PERMISSION_DENIED", **kwargs: Any) -> bytes:
    return status_details.encode(code, "refused", get(slug), **kwargs)


def join(srv: TinyServer, timeout: float = 10) -> Any:
    return asyncio.run(
        request_join_async(
            srv.address,
            trust_domain=TRUST_DOMAIN,
            bundle_pem=srv.bundle,
            svid_cert=srv.svid_cert,
            svid_key=srv.svid_key,
            pool="cpu",
            node_name="worker-1",
            report=b"{}",
            timeout=timeout,
        )
    )


def report(srv: TinyServer, public_id: str = "abcdef") -> bool:
    return asyncio.run(
        report_joined_async(
            srv.address,
            trust_domain=TRUST_DOMAIN,
            bundle_pem=srv.bundle,
            svid_cert=srv.svid_cert,
            svid_key=srv.svid_key,
            token_id=public_id,
            node_name="worker-1",
        )
    )


Servers = Callable[..., TinyServer]


def test_banned_detail_is_a_banned_error_with_its_own_exit_status(tiny_server: Servers) -> None:
    srv = tiny_server(RequestJoin=abort_with(PD, "agent x is banned", details("banned")))
    with pytest.raises(BannedError) as err:
        join(srv)
    e = err.value
    assert (e.code, e.reason, e.permanent, e.exit_code) == ("PERMISSION_DENIED", "banned", True, 11)
    assert "unban" in e.hint
    assert "agent x is banned" in e.message  # the server's words are kept for people


def test_not_attested_detail_attests_again(tiny_server: Servers) -> None:
    srv = tiny_server(RequestJoin=abort_with(PD, "who are you", details("not_attested")))
    with pytest.raises(NotAttestedError) as err:
        join(srv)
    assert err.value.action is Action.ATTEST_AGAIN and not err.value.permanent
    assert err.value.exit_code == 15


def test_the_detail_decides_not_the_message(tiny_server: Servers) -> None:
    """A message that reads like "not attested" with a policy detail is a policy refusal, and the reverse."""
    srv = tiny_server(RequestJoin=abort_with(PD, "has not attested; banned", details("policy")))
    with pytest.raises(JoinRefusedError) as err:
        join(srv)
    assert type(err.value) is JoinRefusedError and err.value.reason == "policy"
    assert err.value.action is Action.STEP
    srv2 = tiny_server(RequestJoin=abort_with(PD, "fails pool gpu: banned", details("not_attested")))
    with pytest.raises(NotAttestedError):
        join(srv2)


def test_no_detail_falls_back_on_the_status(tiny_server: Servers) -> None:
    srv = tiny_server(RequestJoin=abort_with(PD, "agent x has not attested to this server"))
    with pytest.raises(JoinRefusedError) as err:
        join(srv)
    # Permanent, but the lifecycle attests anew once first (it cannot tell "not attested" apart).
    assert (
        err.value.permanent
        and err.value.action is Action.ATTEST_AGAIN
        and err.value.reason == "join_refused"
    )
    unavailable = tiny_server(RequestJoin=abort_with(grpc.StatusCode.UNAVAILABLE, "store down"))
    with pytest.raises(RefusedForNowError):
        join(unavailable)


def test_garbage_details_are_no_details(tiny_server: Servers) -> None:
    srv = tiny_server(RequestJoin=abort_with(PD, "refused", b"\xff\x00 not a google.rpc.Status"))
    with pytest.raises(JoinRefusedError) as err:
        join(srv)
    assert err.value.action is Action.ATTEST_AGAIN  # the no-detail row


def test_retry_info_is_carried(tiny_server: Servers) -> None:
    raw = details("join_rate_limited", "RESOURCE_EXHAUSTED", retry_after_s=42.5)
    srv = tiny_server(RequestJoin=abort_with(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", raw))
    with pytest.raises(RefusedForNowError) as err:
        join(srv)
    assert err.value.retry_after_s == pytest.approx(42.5) and err.value.reason == "join_rate_limited"


def test_an_unknown_reason_lands_on_its_family(tiny_server: Servers) -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    info = error_details_pb2.ErrorInfo(
        reason="SOMETHING_NEWER", domain="nodetrust.io", metadata={"family": "ek_trust"}
    )
    packed = any_pb2.Any()
    packed.Pack(info)
    raw = status_pb2.Status(code=7, message="newer", details=[packed]).SerializeToString()
    srv = tiny_server(require_client_auth=False, AttestAgent=abort_with(PD, "newer", raw))
    with pytest.raises(AttestationRefusedError) as err:
        _attest(srv, srv.base / "state")
    assert "ek_trust.ca_dir" in err.value.hint and err.value.wire_reason == "SOMETHING_NEWER"


def _attest(srv: TinyServer, state: Path) -> Any:
    target = ServerTarget.parse(srv.address, TRUST_DOMAIN, srv.bundle)
    return asyncio.run(attest_async(target, SimulatedTpm.create(None), SvidStore(state), timeout=10))  # type: ignore[arg-type]


def test_attestation_refusals_keep_no_pending_key(tiny_server: Servers) -> None:
    srv = tiny_server(
        require_client_auth=False,
        AttestAgent=abort_with(PD, "EK not trusted", details("ek_hash_not_listed")),
    )
    state = srv.base / "state"
    with pytest.raises(AttestationRefusedError) as err:
        _attest(srv, state)
    assert err.value.exit_code == 6 and err.value.reason == "ek_hash_not_listed"
    assert "--print-ek-hash" in err.value.hint
    assert not list(state.glob("svid.key*")), "the key of a refused attestation must not be kept"
    banned = tiny_server(require_client_auth=False, AttestAgent=abort_with(PD, "banned", details("banned")))
    with pytest.raises(BannedError):
        _attest(banned, banned.base / "state")


def test_spire_permission_denied_details_alone(tiny_server: Servers) -> None:
    """A real spire-server sends only SPIRE's PermissionDeniedDetails: AGENT_BANNED is still a ban."""
    from google.protobuf import any_pb2
    from google.rpc import status_pb2

    from protocol._gen.spire.api.types import status_pb2 as spire_status_pb2

    packed = any_pb2.Any()
    packed.Pack(
        spire_status_pb2.PermissionDeniedDetails(
            reason=spire_status_pb2.PermissionDeniedDetails.AGENT_BANNED
        )
    )
    raw = status_pb2.Status(code=7, message="agent is banned", details=[packed]).SerializeToString()
    srv = tiny_server(require_client_auth=False, AttestAgent=abort_with(PD, "agent is banned", raw))
    with pytest.raises(BannedError) as err:
        _attest(srv, srv.base / "state")
    assert err.value.reason == "banned"


# -- Join.ReportJoined ------------------------------------------------------------------------


def test_report_joined_sends_the_public_id_over_mtls(tiny_server: Servers) -> None:
    srv = tiny_server(ReportJoined=joined_reply(revoked=True))
    assert report(srv, "abcdef") is True
    [(method, request, peer)] = srv.calls.seen
    assert method == "ReportJoined" and peer == AGENT_ID
    assert (request.token_id, request.node_name) == ("abcdef", "worker-1")
    gone = tiny_server(ReportJoined=joined_reply(revoked=False))
    assert report(gone) is False


def test_report_joined_refusals(tiny_server: Servers) -> None:
    srv = tiny_server(
        ReportJoined=abort_with(
            grpc.StatusCode.NOT_FOUND, "not yours", details("unknown_token", "NOT_FOUND")
        )
    )
    with pytest.raises(JoinRefusedError) as err:
        report(srv)
    assert err.value.permanent and err.value.reason == "unknown_token"
    old_broker = tiny_server()  # serves no ReportJoined: UNIMPLEMENTED
    with pytest.raises(JoinRefusedError) as old:
        report(old_broker)
    assert old.value.code == "UNIMPLEMENTED" and old.value.permanent
    busy = tiny_server(
        ReportJoined=abort_with(grpc.StatusCode.UNAVAILABLE, "busy", details("store", "UNAVAILABLE"))
    )
    with pytest.raises(RefusedForNowError):
        report(busy)


def test_token_id_is_the_public_half_only() -> None:
    assert token_id("abcdef.0123456789abcdef") == "abcdef"
    for bad in (
        "abcdef",
        "ABCDEF.0123456789abcdef",
        ".0123456789abcdef",
        "abcdefg.0123456789abcdef",
        "abcde\n.x",
    ):
        with pytest.raises(JoinConfigError) as err:
            token_id(bad)
        assert "0123456789abcdef" not in err.value.message
    with pytest.raises(JoinConfigError):
        asyncio.run(
            report_joined_async(
                "127.0.0.1:1", trust_domain=TRUST_DOMAIN, bundle_pem=b"", svid_cert=Path("x"), svid_key=Path("y"),
                token_id="abcdef\n", node_name="n",
            )
        )  # fmt: skip
