"""The bad-input table: each malformed or dishonest attempt gets its own gRPC status and audit line,
stores nothing, and the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from agent.svid import make_csr, new_key
from protocol import tpm2
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol.tpm_payload import (
    AttestationData,
    EkData,
    decode_challenge,
    encode_attestation_data,
    encode_challenge_response,
)
from tests.support.rawclient import RpcFailed, params, run_stream
from tests.support.server import ServerThread, server_config
from tests.support.simtpm import SimCa, SimulatedTpm


@dataclass
class Env:
    srv: ServerThread
    ca: SimCa
    good: SimulatedTpm


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("bad-input")
    ca = SimCa.create()
    (base / "ca").mkdir()
    (base / "ca" / "sim-ca.pem").write_bytes(ca.pem())
    cfg = server_config(
        base / "server",
        ek_trust={"ca_dir": str(base / "ca")},
        challenge_timeout="1s",
        max_payload_bytes=8192,
    )
    srv = ServerThread(cfg).start()
    yield Env(srv, ca, SimulatedTpm.create(ca))
    srv.stop()


def _payload(data: AttestationData) -> bytes:
    return encode_attestation_data(data)


async def _honest(stream: Any, sim: SimulatedTpm, payload: bytes, csr: bytes, attestor: str = "tpm") -> Any:
    await stream.send_message(params(payload, csr, attestor))
    challenge = await stream.recv_message()
    secret = sim.activate(decode_challenge(challenge.challenge))
    await stream.send_message(
        agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
    )
    return await stream.recv_message()


def _attempt(env: Env, script: Callable[[Any], Any]) -> RpcFailed | Any:
    try:
        return run_stream(env.srv.address, env.srv.bundle, script)
    except RpcFailed as failed:
        return failed


def _csr() -> bytes:
    return make_csr(new_key())


def _json_payload(sim: SimulatedTpm) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_payload(sim.attestation_data()))
    return doc


def case_malformed_json(env: Env) -> Callable[[Any], Any]:
    return lambda s: _honest(s, env.good, b"{this is not json", _csr())


def case_bad_base64(env: Env) -> Callable[[Any], Any]:
    doc = _json_payload(env.good)
    doc["AK"]["Public"] = "%%%not-base64%%%"
    return lambda s: _honest(s, env.good, json.dumps(doc).encode(), _csr())


def case_missing_public_key_block(env: Env) -> Callable[[Any], Any]:
    doc = _json_payload(env.good)
    pem = base64.b64decode(doc["EK"])
    doc["EK"] = base64.b64encode(pem.split(b"-----BEGIN PUBLIC KEY-----")[0]).decode()
    return lambda s: _honest(s, env.good, json.dumps(doc).encode(), _csr())


def case_ek_not_trusted(env: Env) -> Callable[[Any], Any]:
    stranger = SimulatedTpm.create(SimCa.create("Unknown vendor CA"))
    return lambda s: _honest(s, stranger, _payload(stranger.attestation_data()), _csr())


def case_ek_cert_key_mismatch(env: Env) -> Callable[[Any], Any]:
    # A genuine certificate from a trusted CA, sent with another EK public key.
    liar = SimulatedTpm.create(None)
    assert env.good.ek_cert_der is not None
    data = AttestationData(
        ek=EkData(public_key_der=liar.ek_spki, certificate_der=env.good.ek_cert_der), ak=liar.ak_parameters()
    )
    return lambda s: _honest(s, liar, _payload(data), _csr())


def _without(attr: tpm2.ObjectAttr) -> Callable[[Env], Callable[[Any], Any]]:
    def make(env: Env) -> Callable[[Any], Any]:
        sim = SimulatedTpm.create(env.ca).with_ak_attrs(0x00050472 & ~int(attr))
        return lambda s: _honest(s, sim, _payload(sim.attestation_data()), _csr())

    return make


def case_ak_name_mismatch(env: Env) -> Callable[[Any], Any]:
    sim = SimulatedTpm.create(env.ca)
    other_name = b"\x00\x0b" + bytes(32)
    data = AttestationData(ek=sim.attestation_data().ek, ak=sim.ak_parameters(name=other_name))
    return lambda s: _honest(s, sim, _payload(data), _csr())


def case_bad_create_signature(env: Env) -> Callable[[Any], Any]:
    sim = SimulatedTpm.create(env.ca)
    data = AttestationData(
        ek=sim.attestation_data().ek, ak=sim.ak_parameters(sign_with=rsa.generate_private_key(65537, 2048))
    )
    return lambda s: _honest(s, sim, _payload(data), _csr())


def case_unknown_attestor(env: Env) -> Callable[[Any], Any]:
    return lambda s: _honest(s, env.good, _payload(env.good.attestation_data()), _csr(), attestor="aws_iid")


def case_wrong_secret(env: Env) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        await stream.send_message(params(_payload(env.good.attestation_data()), _csr()))
        await stream.recv_message()
        await stream.send_message(
            agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(b"\x00" * 32)),
            end=True,
        )
        return await stream.recv_message()

    return script


def case_challenge_timeout(env: Env) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        await stream.send_message(params(_payload(env.good.attestation_data()), _csr()))
        await stream.recv_message()
        await asyncio.sleep(3)  # the server's challenge_timeout is 1 s here
        return await stream.recv_message()

    return script


def case_payload_too_large(env: Env) -> Callable[[Any], Any]:
    doc = _json_payload(env.good)
    doc["padding"] = "x" * 9000
    return lambda s: _honest(s, env.good, json.dumps(doc).encode(), _csr())


def case_second_params(env: Env) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        payload = _payload(env.good.attestation_data())
        await stream.send_message(params(payload, _csr()))
        await stream.recv_message()
        await stream.send_message(params(payload, _csr()), end=True)
        return await stream.recv_message()

    return script


def case_bad_csr_signature(env: Env) -> Callable[[Any], Any]:
    csr = bytearray(_csr())
    csr[-3] ^= 0xFF  # inside the ECDSA signature
    return lambda s: _honest(s, env.good, _payload(env.good.attestation_data()), bytes(csr))


def case_not_a_csr(env: Env) -> Callable[[Any], Any]:
    return lambda s: _honest(s, env.good, _payload(env.good.attestation_data()), b"\x30\x03\x02\x01\x00")


def case_no_csr(env: Env) -> Callable[[Any], Any]:
    return lambda s: _honest(s, env.good, _payload(env.good.attestation_data()), b"")


def case_banned(env: Env) -> Callable[[Any], Any]:
    sim = SimulatedTpm.create(env.ca)
    assert env.srv.app.store is not None
    env.srv.app.store.ban_agent(f"spiffe://example.org/spire/agent/tpm/{sim.ek_hash}")
    return lambda s: _honest(s, sim, _payload(sim.attestation_data()), _csr())


def case_huge_json_integer(env: Env) -> Callable[[Any], Any]:
    # 5,000 digits: Python's int() refuses more than 4,300, which once escaped as INTERNAL.
    return lambda s: _honest(s, env.good, b'{"EK":' + b"7" * 5000 + b"}", _csr())


def case_half_close_after_params(env: Env) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        await stream.send_message(params(_payload(env.good.attestation_data()), _csr()), end=True)
        await stream.recv_message()  # the challenge
        return await stream.recv_message()

    return script


def case_half_close_before_params(env: Env) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        await stream.send_request(end=True)
        return await stream.recv_message()

    return script


def case_pem_flood(env: Env) -> Callable[[Any], Any]:
    # Repeated BEGIN lines once cost the event loop seconds of regex backtracking per request.
    doc = _json_payload(env.good)
    doc["EK"] = base64.b64encode(b"-----BEGIN A-----\n" * 150).decode()
    return lambda s: _honest(s, env.good, json.dumps(doc).encode(), _csr())


CASES: list[tuple[str, Callable[[Env], Callable[[Any], Any]], str, str]] = [
    ("malformed JSON", case_malformed_json, "INVALID_ARGUMENT", "payload_malformed"),
    ("bad base64", case_bad_base64, "INVALID_ARGUMENT", "payload_malformed"),
    ("missing PUBLIC KEY block", case_missing_public_key_block, "INVALID_ARGUMENT", "payload_malformed"),
    ("EK not trusted", case_ek_not_trusted, "PERMISSION_DENIED", "ek_"),
    (
        "EK certificate and public key mismatch",
        case_ek_cert_key_mismatch,
        "PERMISSION_DENIED",
        "ek_cert_key_mismatch",
    ),
    ("AK without fixedTPM", _without(tpm2.ObjectAttr.FIXED_TPM), "PERMISSION_DENIED", "ak_attributes"),
    ("AK without restricted", _without(tpm2.ObjectAttr.RESTRICTED), "PERMISSION_DENIED", "ak_attributes"),
    (
        "AK without sensitiveDataOrigin",
        _without(tpm2.ObjectAttr.SENSITIVE_DATA_ORIGIN),
        "PERMISSION_DENIED",
        "ak_attributes",
    ),
    ("AK name mismatch", case_ak_name_mismatch, "PERMISSION_DENIED", "ak_name_mismatch"),
    ("bad CreateSignature", case_bad_create_signature, "PERMISSION_DENIED", "ak_bad_signature"),
    ("unknown attestor type", case_unknown_attestor, "FAILED_PRECONDITION", "unknown_attestor"),
    ("wrong secret", case_wrong_secret, "PERMISSION_DENIED", "wrong_secret"),
    ("challenge not answered in time", case_challenge_timeout, "DEADLINE_EXCEEDED", "challenge_timeout"),
    ("payload over the size limit", case_payload_too_large, "RESOURCE_EXHAUSTED", "payload_too_large"),
    ("second params message on one stream", case_second_params, "INVALID_ARGUMENT", "unexpected_params"),
    ("CSR with a bad signature", case_bad_csr_signature, "INVALID_ARGUMENT", "bad_csr_signature"),
    ("CSR that is not a CSR", case_not_a_csr, "INVALID_ARGUMENT", "bad_csr"),
    ("no CSR", case_no_csr, "INVALID_ARGUMENT", "malformed_params"),
    ("banned agent", case_banned, "PERMISSION_DENIED", "banned"),
    ("JSON integer of 5,000 digits", case_huge_json_integer, "INVALID_ARGUMENT", "payload_malformed"),
    ("PEM of repeated BEGIN lines", case_pem_flood, "INVALID_ARGUMENT", "payload_malformed"),
    ("half-close after params (SPIRE: Internal)", case_half_close_after_params, "INTERNAL", "stream_ended"),
    ("half-close before params", case_half_close_before_params, "INVALID_ARGUMENT", "stream_ended"),
]


@pytest.mark.parametrize(("name", "make", "status", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    env: Env, name: str, make: Callable[[Env], Callable[[Any], Any]], status: str, reason: str
) -> None:
    store = env.srv.app.store
    assert store is not None
    script = make(env)  # may set up state (the ban) before the snapshot
    before_agents = {a.spiffe_id: a for a in store.list_agents()}
    before_audit = len(env.srv.audit_lines())
    outcome = _attempt(env, script)
    assert isinstance(outcome, RpcFailed), f"{name}: expected a failure, got {outcome}"
    assert outcome.status == status, outcome
    audit = env.srv.audit_lines()[before_audit:]
    assert len(audit) == 1, audit
    assert audit[0]["status"] == status and audit[0]["reason"].startswith(reason), audit[0]
    # The same reason travels to the client as a structured detail (google.rpc.ErrorInfo).
    assert outcome.detail is not None and outcome.detail.reason is not None, outcome
    assert outcome.reason == audit[0]["reason"], (outcome.detail, audit[0])
    assert outcome.detail.family == str(outcome.detail.reason.family)
    assert audit[0]["result"] in ("denied", "error")
    # Nothing stored for the failed attempt (a ban placeholder is the operator's, not the attempt's).
    assert {a.spiffe_id: a for a in store.list_agents()} == before_agents
    # No secret in the audit trail.
    assert "Secret" not in json.dumps(audit)
    # The server keeps serving.
    ok = _attempt(env, lambda s: _honest(s, env.good, _payload(env.good.attestation_data()), _csr()))
    assert not isinstance(ok, RpcFailed), ok
    assert ok.WhichOneof("step") == "result"


def test_cancelled_stream_is_audited_and_stores_nothing(env: Env) -> None:
    sim = SimulatedTpm.create(env.ca)
    before = len(env.srv.audit_lines())

    async def script(stream: Any) -> Any:
        await stream.send_message(params(_payload(sim.attestation_data()), _csr()))
        await stream.recv_message()
        await stream.cancel()
        return None

    _attempt(env, script)
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(env.srv.audit_lines()) == before:
        time.sleep(0.05)
    line = env.srv.audit_lines()[before]
    assert line["result"] == "cancelled" and line["spiffe_id"].endswith(sim.ek_hash)
    assert env.srv.app.store is not None and env.srv.app.store.get_agent(line["spiffe_id"]) is None


def test_audit_log_is_private(env: Env) -> None:
    import stat

    mode = stat.S_IMODE(Path(env.srv.config.audit_path).stat().st_mode)
    assert mode == 0o600
