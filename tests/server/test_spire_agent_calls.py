"""What spire-agent v1.13.3 calls after it has attested, answered as spire-server answers an agent with
no registration entries: the Entry sync (and its fallback), the batch X509-SVID call's per-entry
statuses, the JWT-SVID call; PostStatus is UNIMPLEMENTED as in spire-server v1.13.3; RenewAgent says
AGENT_MUST_REATTEST. The real agent against these answers: tests/peers/test_spire_devid.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from agent.refusals import DetailsCodec
from agent.tls import SpiffeTLSContext
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.server.entry.v1 import entry_pb2
from protocol._gen.spire.api.server.svid.v1 import svid_pb2
from protocol._gen.spire.api.types import entry_pb2 as types_entry_pb2
from protocol.spiffe import server_id
from protocol.status_details import ErrorDetail
from tests.support.server import ServerThread, server_config


class Failed(Exception):
    def __init__(self, status: str, message: str, detail: ErrorDetail | None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.detail = status, message, detail


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    base = tmp_path_factory.mktemp("spire-calls")
    (base / "hashes").mkdir()
    s = ServerThread(server_config(base / "srv", ek_trust={"hash_dir": str(base / "hashes")})).start()
    yield s
    s.stop()


def _call(
    srv: ServerThread, path: str, req_cls: Any, resp_cls: Any, messages: list[Any], *, stream: bool = False
) -> list[Any]:
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    async def go() -> list[Any]:
        host, _, port = srv.address.rpartition(":")
        channel = Channel(
            host,
            int(port),
            ssl=SpiffeTLSContext(srv.bundle, [server_id("example.org")]),
            status_details_codec=DetailsCodec(),
        )
        card = Cardinality.STREAM_STREAM if stream else Cardinality.UNARY_UNARY
        try:
            async with channel.request(path, card, req_cls, resp_cls, timeout=20) as st:
                for i, m in enumerate(messages):
                    await st.send_message(m, end=i == len(messages) - 1)
                out = []
                while (msg := await st.recv_message()) is not None:
                    out.append(msg)
                return out
        except GRPCError as exc:
            detail = exc.details if isinstance(exc.details, ErrorDetail) else None
            raise Failed(exc.status.name, exc.message or "", detail) from exc
        finally:
            channel.close()

    return asyncio.run(go())


MASK = types_entry_pb2.EntryMask(spiffe_id=True, selectors=True, revision_number=True, created_at=True)
SYNC = "/spire.api.server.entry.v1.Entry/SyncAuthorizedEntries"
Req, Resp = entry_pb2.SyncAuthorizedEntriesRequest, entry_pb2.SyncAuthorizedEntriesResponse


def test_sync_authorized_entries_is_one_empty_page(srv: ServerThread) -> None:
    out = _call(srv, SYNC, Req, Resp, [Req(output_mask=MASK)], stream=True)
    assert out == [Resp(entries=[], more=False)]


@pytest.mark.parametrize(
    ("first", "message"),
    [
        (Req(output_mask=MASK, ids=["x"]), "specifying IDs on initial request is not supported"),
        (Req(output_mask=types_entry_pb2.EntryMask(spiffe_id=True)), "revision number cannot be masked"),
    ],
)
def test_sync_refuses_what_spire_server_refuses(srv: ServerThread, first: Any, message: str) -> None:
    with pytest.raises(Failed) as info:
        _call(srv, SYNC, Req, Resp, [first], stream=True)
    assert info.value.status == "INVALID_ARGUMENT" and info.value.message == message


def test_get_authorized_entries_is_empty(srv: ServerThread) -> None:
    out = _call(
        srv,
        "/spire.api.server.entry.v1.Entry/GetAuthorizedEntries",
        entry_pb2.GetAuthorizedEntriesRequest,
        entry_pb2.GetAuthorizedEntriesResponse,
        [entry_pb2.GetAuthorizedEntriesRequest(output_mask=MASK)],
    )
    assert out == [entry_pb2.GetAuthorizedEntriesResponse()]


def test_batch_new_x509_svid_gives_spire_servers_per_entry_statuses(srv: ServerThread) -> None:
    before = len(srv.audit_lines())
    params = [
        svid_pb2.NewX509SVIDParams(entry_id="", csr=b"x"),
        svid_pb2.NewX509SVIDParams(entry_id="e1", csr=b""),
        svid_pb2.NewX509SVIDParams(entry_id="e2", csr=b"0\x00"),
    ]
    (resp,) = _call(
        srv,
        "/spire.api.server.svid.v1.SVID/BatchNewX509SVID",
        svid_pb2.BatchNewX509SVIDRequest,
        svid_pb2.BatchNewX509SVIDResponse,
        [svid_pb2.BatchNewX509SVIDRequest(params=params)],
    )
    assert [(r.status.code, r.status.message, r.HasField("svid")) for r in resp.results] == [
        (3, "missing entry ID", False),
        (3, "missing CSR", False),
        (5, "entry not found or not authorized", False),
    ]
    (line,) = srv.audit_lines()[before:]
    assert line["event"] == "svid" and line["requested"] == 3 and line["issued"] == 0


def test_batch_new_x509_svid_without_params(srv: ServerThread) -> None:
    with pytest.raises(Failed) as info:
        _call(
            srv,
            "/spire.api.server.svid.v1.SVID/BatchNewX509SVID",
            svid_pb2.BatchNewX509SVIDRequest,
            svid_pb2.BatchNewX509SVIDResponse,
            [svid_pb2.BatchNewX509SVIDRequest()],
        )
    assert (info.value.status, info.value.message) == ("INVALID_ARGUMENT", "missing parameters")


def test_new_jwt_svid_is_not_found(srv: ServerThread) -> None:
    with pytest.raises(Failed) as info:
        _call(
            srv,
            "/spire.api.server.svid.v1.SVID/NewJWTSVID",
            svid_pb2.NewJWTSVIDRequest,
            svid_pb2.NewJWTSVIDResponse,
            [svid_pb2.NewJWTSVIDRequest(entry_id="e", audience=["a"])],
        )
    assert (info.value.status, info.value.message) == ("NOT_FOUND", "entry not found or not authorized")


def test_renew_agent_says_must_reattest_and_post_status_is_unimplemented(srv: ServerThread) -> None:
    with pytest.raises(Failed) as info:
        _call(
            srv,
            "/spire.api.server.agent.v1.Agent/RenewAgent",
            agent_pb2.RenewAgentRequest,
            agent_pb2.RenewAgentResponse,
            [agent_pb2.RenewAgentRequest()],
        )
    assert info.value.status == "PERMISSION_DENIED"
    assert info.value.detail is not None and info.value.detail.spire_reason == "AGENT_MUST_REATTEST"
    with pytest.raises(Failed) as info:
        _call(
            srv,
            "/spire.api.server.agent.v1.Agent/PostStatus",
            agent_pb2.PostStatusRequest,
            agent_pb2.PostStatusResponse,
            [agent_pb2.PostStatusRequest(current_bundle_serial=1)],
        )
    assert info.value.status == "UNIMPLEMENTED"


def test_the_administration_api_stays_unimplemented(srv: ServerThread) -> None:
    with pytest.raises(Failed) as info:
        _call(
            srv,
            "/spire.api.server.entry.v1.Entry/ListEntries",
            entry_pb2.ListEntriesRequest,
            entry_pb2.ListEntriesResponse,
            [entry_pb2.ListEntriesRequest()],
        )
    assert info.value.status == "UNIMPLEMENTED"
