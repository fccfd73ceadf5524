"""``spire.api.server.svid.v1.SVID``: the workload SVID calls a spire-agent makes for its entries.

nodeserver holds no registration entries, so it never signs a workload SVID: ``BatchNewX509SVID``
answers each parameter with the per-entry status spire-server gives an entry the agent is not
authorized for (``pkg/server/api/svid/v1/service.go``): ``InvalidArgument`` "missing entry ID" /
"missing CSR" for an incomplete parameter, ``NotFound`` "entry not found or not authorized" for every
other; ``NewJWTSVID`` fails the same way. A spire-agent with no entries never calls them; one that
does (an operator's stale cache) logs ``Failed to mint X509 SVID`` per entry and stays up. Each call
gets one audit line. Minting and downstream CAs are SPIRE's administration API: UNIMPLEMENTED.
"""

from __future__ import annotations

from typing import Any

from protocol._gen.spire.api.server.svid.v1 import svid_pb2
from protocol._gen.spire.api.types import status_pb2
from protocol.status_details import CODES
from server.boundary import Call, Context, Method
from server.errors import InvalidRequestError, NotFoundError

MAX_ENTRY_ID_CHARS = 255
NOT_AUTHORIZED = "entry not found or not authorized"


def _status(code: str, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=CODES[code], message=message)


def _result(param: svid_pb2.NewX509SVIDParams) -> svid_pb2.BatchNewX509SVIDResponse.Result:
    if not param.entry_id:
        return svid_pb2.BatchNewX509SVIDResponse.Result(
            status=_status("INVALID_ARGUMENT", "missing entry ID")
        )
    if not param.csr:
        return svid_pb2.BatchNewX509SVIDResponse.Result(status=_status("INVALID_ARGUMENT", "missing CSR"))
    return svid_pb2.BatchNewX509SVIDResponse.Result(status=_status("NOT_FOUND", NOT_AUTHORIZED))


class SvidService:
    def methods(self) -> dict[str, Method]:
        return {
            "BatchNewX509SVID": Method("svid", self.batch_new_x509_svid),
            "NewJWTSVID": Method("svid", self.new_jwt_svid),
        }

    async def batch_new_x509_svid(
        self, request: Any, context: Context, call: Call
    ) -> svid_pb2.BatchNewX509SVIDResponse:
        if not request.params:
            raise InvalidRequestError("missing parameters", reason="invalid_argument")
        results = [_result(p) for p in request.params]
        call.set(
            requested=len(results),
            entry_ids=[p.entry_id[:MAX_ENTRY_ID_CHARS] for p in request.params[:16]],
            issued=0,
        )
        call.commit(
            "ok", f"{len(results)} X509-SVID request(s), none authorized: this server has no entries"
        )
        return svid_pb2.BatchNewX509SVIDResponse(results=results)

    async def new_jwt_svid(self, request: Any, context: Context, call: Call) -> svid_pb2.NewJWTSVIDResponse:
        call.set(entry_id=request.entry_id[:MAX_ENTRY_ID_CHARS])
        if not request.entry_id:
            raise InvalidRequestError("missing entry ID", reason="invalid_argument")
        if not request.audience:
            raise InvalidRequestError("at least one audience is required", reason="invalid_argument")
        raise NotFoundError(NOT_AUTHORIZED)
