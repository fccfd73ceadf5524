"""What the AttestAgent stream needs from a node attestor (``tpm``, ``tpm_devid``).

:class:`server.attest_service.AgentService` runs every attestor the same way, in a worker
thread: ``decode`` the payload (nothing verified yet, but the agent it claims to be is
known), ``begin`` (verify the evidence and build the one challenge), then ``finish`` with
the agent's answer. Each raises :class:`server.errors.ServerError` subclasses only.
"""

from __future__ import annotations

from typing import Any, Protocol

from protocol.spiffe import SpiffeId
from protocol.tpm_payload import EkData
from server.tpm_attestor import AttestResult, PendingAttestation


class EvidenceLike(Protocol):
    @property
    def agent_id(self) -> SpiffeId: ...

    @property
    def ek(self) -> EkData: ...


class NodeAttestor(Protocol):
    @property
    def name(self) -> str: ...

    def decode(self, payload: bytes) -> EvidenceLike: ...

    def begin(self, evidence: Any) -> PendingAttestation: ...

    def finish(self, pending: Any, response: bytes) -> AttestResult: ...
