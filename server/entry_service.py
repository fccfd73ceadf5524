"""``spire.api.server.entry.v1.Entry``: the two calls a spire-agent makes to learn its registration entries.

spire-agent v1.13.3 syncs its entries every few seconds after it has attested, with
``SyncAuthorizedEntries`` (``GetAuthorizedEntries`` where an older agent or a configuration asks for
it), and exits when the first sync fails. nodeserver holds no registration entries (it attests nodes
and brokers joins; workload identities come from a SPIRE server), so both calls answer what
spire-server answers an agent with no entries: a well-formed, empty list. The request is validated
the way spire-server validates it (``pkg/server/api/entry/v1/service.go``).

Both calls are reads that reveal nothing and run every few seconds per agent: admitted per address by
the boundary, not audited. The administrative Entry calls stay UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from protocol._gen.spire.api.server.entry.v1 import entry_pb2
from server.boundary import Call, Context, Method, Undecodable
from server.errors import ChallengeTimeoutError, InvalidRequestError


class EntryService:
    """GetAuthorizedEntries and SyncAuthorizedEntries over an empty set of entries."""

    def __init__(self, *, first_message_timeout: float) -> None:
        self.first_message_timeout = first_message_timeout

    def methods(self) -> dict[str, Method]:
        return {
            "GetAuthorizedEntries": Method("entries", self.get_authorized_entries, audited=False),
            "SyncAuthorizedEntries": Method("entries", self.sync_authorized_entries, audited=False),
        }

    async def get_authorized_entries(
        self, request: Any, context: Context, call: Call
    ) -> entry_pb2.GetAuthorizedEntriesResponse:
        return entry_pb2.GetAuthorizedEntriesResponse(entries=[])

    async def sync_authorized_entries(
        self, requests: AsyncIterator[Any], context: Context, call: Call
    ) -> AsyncIterator[entry_pb2.SyncAuthorizedEntriesResponse]:
        try:
            async with asyncio.timeout(self.first_message_timeout):
                first = await requests.__anext__()
        except TimeoutError:
            raise ChallengeTimeoutError(
                f"no SyncAuthorizedEntries request within {self.first_message_timeout:g} s",
                reason="params_timeout",
            ) from None
        except StopAsyncIteration:
            raise InvalidRequestError(
                "the stream ended before the initial request", reason="stream_ended"
            ) from None
        if isinstance(first, Undecodable):
            raise first.error("SyncAuthorizedEntries")
        if first.ids:
            raise InvalidRequestError(
                "specifying IDs on initial request is not supported", reason="invalid_argument"
            )
        if first.HasField("output_mask") and not first.output_mask.revision_number:
            raise InvalidRequestError("revision number cannot be masked", reason="invalid_argument")
        # No entries: fewer than one page, so spire-server sends the whole (empty) list and ends.
        yield entry_pb2.SyncAuthorizedEntriesResponse(entries=[], more=False)
