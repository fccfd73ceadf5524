"""The SPIRE Agent API stubs are wire-identical to spire-api-sdk, and the committed stubs are current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.server.bundle.v1 import bundle_pb2
from protocol._gen.spire.api.types import agent_pb2 as types_agent_pb2
from protocol._gen.spire.api.types import attestation_pb2, selector_pb2, spiffeid_pb2, x509svid_pb2

ROOT = Path(__file__).resolve().parents[2]

# (message, field) -> (number, type, label) from spire-api-sdk (reference: spire-tpm-attestation.md §1.2-1.3).
EXPECTED = {
    ("spire.api.server.agent.v1.AttestAgentRequest", "params"): (1, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.AttestAgentRequest", "challenge_response"): (2, F.TYPE_BYTES),
    ("spire.api.server.agent.v1.AttestAgentRequest.Params", "data"): (1, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.AttestAgentRequest.Params", "params"): (2, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.AgentX509SVIDParams", "csr"): (1, F.TYPE_BYTES),
    ("spire.api.server.agent.v1.AttestAgentResponse", "result"): (1, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.AttestAgentResponse", "challenge"): (2, F.TYPE_BYTES),
    ("spire.api.server.agent.v1.AttestAgentResponse.Result", "svid"): (1, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.AttestAgentResponse.Result", "reattestable"): (2, F.TYPE_BOOL),
    ("spire.api.server.agent.v1.RenewAgentRequest", "params"): (1, F.TYPE_MESSAGE),
    ("spire.api.server.agent.v1.RenewAgentResponse", "svid"): (1, F.TYPE_MESSAGE),
    ("spire.api.types.AttestationData", "type"): (1, F.TYPE_STRING),
    ("spire.api.types.AttestationData", "payload"): (2, F.TYPE_BYTES),
    ("spire.api.types.X509SVID", "cert_chain"): (1, F.TYPE_BYTES),
    ("spire.api.types.X509SVID", "id"): (2, F.TYPE_MESSAGE),
    ("spire.api.types.X509SVID", "expires_at"): (3, F.TYPE_INT64),
    ("spire.api.types.X509SVID", "hint"): (4, F.TYPE_STRING),
    ("spire.api.types.SPIFFEID", "trust_domain"): (1, F.TYPE_STRING),
    ("spire.api.types.SPIFFEID", "path"): (2, F.TYPE_STRING),
    ("spire.api.types.Selector", "type"): (1, F.TYPE_STRING),
    ("spire.api.types.Selector", "value"): (2, F.TYPE_STRING),
    ("spire.api.types.Agent", "id"): (1, F.TYPE_MESSAGE),
    ("spire.api.types.Agent", "attestation_type"): (2, F.TYPE_STRING),
    ("spire.api.types.Agent", "x509svid_serial_number"): (3, F.TYPE_STRING),
    ("spire.api.types.Agent", "x509svid_expires_at"): (4, F.TYPE_INT64),
    ("spire.api.types.Agent", "selectors"): (5, F.TYPE_MESSAGE),
    ("spire.api.types.Agent", "banned"): (6, F.TYPE_BOOL),
    ("spire.api.types.Agent", "can_reattest"): (7, F.TYPE_BOOL),
    ("spire.api.types.Agent", "agent_version"): (8, F.TYPE_STRING),
    ("spire.api.types.Bundle", "trust_domain"): (1, F.TYPE_STRING),
    ("spire.api.types.Bundle", "x509_authorities"): (2, F.TYPE_MESSAGE),
    ("spire.api.types.Bundle", "jwt_authorities"): (3, F.TYPE_MESSAGE),
    ("spire.api.types.Bundle", "refresh_hint"): (4, F.TYPE_INT64),
    ("spire.api.types.Bundle", "sequence_number"): (5, F.TYPE_UINT64),
    ("spire.api.types.X509Certificate", "asn1"): (1, F.TYPE_BYTES),
    ("spire.api.server.bundle.v1.GetBundleRequest", "output_mask"): (1, F.TYPE_MESSAGE),
}
MODULES = [agent_pb2, bundle_pb2, types_agent_pb2, attestation_pb2, selector_pb2, spiffeid_pb2, x509svid_pb2]


def _message(full_name: str):  # type: ignore[no-untyped-def]
    for mod in MODULES:
        pool = mod.DESCRIPTOR.pool
        try:
            return pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise KeyError(full_name)


@pytest.mark.parametrize(
    ("key", "expected"),
    sorted(EXPECTED.items()),
    ids=lambda v: ".".join(v) if isinstance(v, tuple) and isinstance(v[0], str) else "",
)
def test_field_numbers_and_types(key: tuple[str, str], expected: tuple[int, int]) -> None:
    msg = _message(key[0])
    field = msg.fields_by_name[key[1]]
    assert (field.number, field.type) == expected


def test_step_oneofs() -> None:
    for name in (
        "spire.api.server.agent.v1.AttestAgentRequest",
        "spire.api.server.agent.v1.AttestAgentResponse",
    ):
        msg = _message(name)
        assert [o.name for o in msg.oneofs] == ["step"]
        assert sorted(f.name for f in msg.oneofs_by_name["step"].fields) == sorted(
            f.name for f in msg.fields
        )


def test_service_and_method() -> None:
    service = agent_pb2.DESCRIPTOR.services_by_name["Agent"]
    assert service.full_name == "spire.api.server.agent.v1.Agent"
    method = service.methods_by_name["AttestAgent"]
    assert method.input_type.full_name == "spire.api.server.agent.v1.AttestAgentRequest"
    assert method.output_type.full_name == "spire.api.server.agent.v1.AttestAgentResponse"
    assert method.client_streaming and method.server_streaming


def test_generated_stubs_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "genproto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
