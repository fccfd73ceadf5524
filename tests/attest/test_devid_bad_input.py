"""The ``tpm_devid`` bad-input table: every malformed or dishonest field of SPIRE's tpm_devid wire gets
its own status and reason, one audit line, nothing stored, and the server keeps serving.

The honest attempt is what spire-agent v1.13.3 sends (protocol.tpm_devid; tests/support/simdevid.py
builds it in software); each case changes one thing. Where spire-server is lax (the AK's attributes,
the certification's type and extraData, the DevID key's attributes, the DevID certificate's key
against DevIDPub) nodeserver refuses, and the test says which.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from agent.svid import make_csr, new_key
from protocol import tpm2
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol.tpm_devid import (
    AttestationRequest,
    ChallengeResponse,
    decode_challenge,
    encode_attestation_request,
    encode_challenge_response,
)
from tests.support.rawclient import RpcFailed, params, run_stream
from tests.support.server import ServerThread, server_config
from tests.support.simdevid import DevidPki, SimDevidTpm
from tests.support.simtpm import SimCa


@dataclass
class Env:
    srv: ServerThread
    ek_ca: SimCa
    pki: DevidPki

    def sim(self, alg: str = "rsa") -> SimDevidTpm:
        return SimDevidTpm.create(self.ek_ca, self.pki, alg=alg)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("devid-bad-input")
    ek_ca, pki = SimCa.create(), DevidPki.create()
    (base / "ek-ca").mkdir()
    (base / "ek-ca" / "sim.pem").write_bytes(ek_ca.pem())
    (base / "devid-root.pem").write_bytes(pki.root_pem())
    cfg = server_config(
        base / "server",
        ek_trust={"ca_dir": str(base / "ek-ca")},
        devid={"trusted_ca_files": [str(base / "devid-root.pem")]},
        challenge_timeout="2s",
    )
    srv = ServerThread(cfg).start()
    yield Env(srv, ek_ca, pki)
    srv.stop()


def _csr() -> bytes:
    return make_csr(new_key())


def _honest(
    sim: SimDevidTpm, payload: bytes, *, answer: Callable[[Any], bytes] | None = None
) -> Callable[[Any], Any]:
    async def script(stream: Any) -> Any:
        await stream.send_message(params(payload, _csr(), "tpm_devid"))
        reply = await stream.recv_message()
        ch = decode_challenge(reply.challenge)
        body = answer(ch) if answer is not None else encode_challenge_response(sim.answer(ch))
        await stream.send_message(agent_pb2.AttestAgentRequest(challenge_response=body), end=True)
        return await stream.recv_message()

    return script


def _req(sim: SimDevidTpm, **changes: Any) -> Callable[[Any], Any]:
    return _honest(sim, encode_attestation_request(sim.request(**changes)))


def _doc(sim: SimDevidTpm) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(encode_attestation_request(sim.request()))
    return doc


def _raw(sim: SimDevidTpm, edit: Callable[[dict[str, Any]], Any]) -> Callable[[Any], Any]:
    doc = _doc(sim)
    edit(doc)
    return _honest(sim, json.dumps(doc).encode())


# -- the JSON --------------------------------------------------------------------------------------------
def case_not_json(env: Env) -> Callable[[Any], Any]:
    return _honest(env.sim(), b"{not json")


def case_json_array(env: Env) -> Callable[[Any], Any]:
    return _honest(env.sim(), b"[]")


def case_unknown_key(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.update(Extra="AA=="))


def case_missing_ek_cert(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.pop("EKCert"))


def case_null_devid_cert(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.update(DevIDCert=None))


def case_devid_cert_not_a_list(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.update(DevIDCert=d["DevIDCert"][0]))


def case_empty_chain(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.update(DevIDCert=[]))


def case_bad_base64(env: Env) -> Callable[[Any], Any]:
    return _raw(env.sim(), lambda d: d.update(AKPub="%%%"))


def case_lowercase_key(env: Env) -> Callable[[Any], Any]:
    # Go's decoder would take "akpub" for AKPub; the real agent writes the Go name exactly.
    return _raw(env.sim(), lambda d: d.update(akpub=d.pop("AKPub")))


# -- the DevID certificate -------------------------------------------------------------------------------
def case_leaf_garbage(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    return _req(sim, devid_cert=(b"\x30\x03\x02\x01\x00", *sim.chain[1:]))


def case_intermediate_garbage(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    return _req(sim, devid_cert=(sim.chain[0], b"not a certificate"))


def case_untrusted_ca(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    other = DevidPki.create("Stranger")
    sim.chain = other.chain(sim.devid.public_key())
    return _req(sim)


def case_intermediate_missing(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    return _req(sim, devid_cert=sim.chain[:1])


def case_expired(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    sim.chain = env.pki.chain(sim.devid.public_key(), expired=True)
    return _req(sim)


def case_cert_for_another_key(env: Env) -> Callable[[Any], Any]:
    # spire-server would accept this: it checks the possession signature with the certificate's key and
    # the certification against DevIDPub, and never ties the two. A stolen software key + any TPM key.
    sim = env.sim()
    thief = rsa.generate_private_key(65537, 2048)
    sim.chain = env.pki.chain(thief.public_key())
    return _req(sim)


# -- DevIDPub ---------------------------------------------------------------------------------------------
def case_devid_pub_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), devid_pub=b"\x00\x01\x00")


def _devid_attrs(attrs: int) -> Callable[[Env], Callable[[Any], Any]]:
    def make(env: Env) -> Callable[[Any], Any]:
        sim = env.sim()
        sim.devid_attrs = attrs
        return _req(sim)

    return make


# -- EK ----------------------------------------------------------------------------------------------------
def case_ek_pub_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), ek_pub=b"\x00\x01")


def case_ek_pub_ecc(env: Env) -> Callable[[Any], Any]:
    k = ec.generate_private_key(ec.SECP256R1()).public_key().public_numbers()
    pub = tpm2.encode_ecc_public(
        x=k.x.to_bytes(32, "big"),
        y=k.y.to_bytes(32, "big"),
        attributes=0x000300B2,
        symmetric=tpm2.SymDef(tpm2.Alg.AES, 128, tpm2.Alg.CFB),
    )
    return _req(env.sim(), ek_pub=pub)


def case_ek_pub_not_the_certificate(env: Env) -> Callable[[Any], Any]:
    sim, other = env.sim(), env.sim()
    return _req(sim, ek_pub=other.ek_public())


def case_ek_cert_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), ek_cert=b"\x30\x82\x01\x00garbage")


def case_ek_cert_unknown_vendor(env: Env) -> Callable[[Any], Any]:
    stranger = SimDevidTpm.create(SimCa.create("Unknown vendor"), env.pki)
    return _req(stranger)


def case_banned_ek(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    assert env.srv.app.store is not None
    env.srv.app.store.ban_agent(f"spiffe://example.org/spire/agent/tpm/{sim.ek_hash()}")
    return _req(sim)


# -- AK and the certification ------------------------------------------------------------------------------
def case_ak_pub_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), ak_pub=b"\xff" * 10)


def _ak_attrs(attrs: int) -> Callable[[Env], Callable[[Any], Any]]:
    def make(env: Env) -> Callable[[Any], Any]:
        sim = env.sim()
        sim.ak_attrs = attrs
        return _req(sim)

    return make


def _certify(**changes: Any) -> Callable[[Env], Callable[[Any], Any]]:
    def make(env: Env) -> Callable[[Any], Any]:
        sim = env.sim()
        att, sig = sim.certification(**changes)
        return _req(sim, certified_devid=att, certification_signature=sig)

    return make


def case_certify_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), certified_devid=b"\xff\x54\x43\x47")


def case_certify_signature_garbage(env: Env) -> Callable[[Any], Any]:
    return _req(env.sim(), certification_signature=b"\x00\x14")


def case_certify_by_another_key(env: Env) -> Callable[[Any], Any]:
    return _certify(sign_with=rsa.generate_private_key(65537, 2048))(env)


def case_certify_other_object(env: Env) -> Callable[[Any], Any]:
    return _certify(object_name=b"\x00\x0b" + bytes(32))(env)


# -- the answer ------------------------------------------------------------------------------------------
def case_response_not_json(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    return _honest(sim, encode_attestation_request(sim.request()), answer=lambda ch: b"nope")


def case_response_missing_cred(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()
    return _honest(
        sim,
        encode_attestation_request(sim.request()),
        answer=lambda ch: json.dumps({"DevID": base64.b64encode(sim.sign(ch.nonce)).decode()}).encode(),
    )


def case_wrong_possession_signature(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()

    def answer(ch: Any) -> bytes:
        good = sim.answer(ch)
        return encode_challenge_response(replace(good, signature=sim.sign(b"another nonce")))

    return _honest(sim, encode_attestation_request(sim.request()), answer=answer)


def case_wrong_secret(env: Env) -> Callable[[Any], Any]:
    sim = env.sim()

    def answer(ch: Any) -> bytes:
        return encode_challenge_response(
            ChallengeResponse(signature=sim.sign(ch.nonce), cert_info=bytes(32))
        )

    return _honest(sim, encode_attestation_request(sim.request()), answer=answer)


A = tpm2.ObjectAttr
DEVID, AK = 0x00040072, 0x00050072  # the real agent's DevID and AK attributes
CASES: list[tuple[str, Callable[[Env], Callable[[Any], Any]], str, str]] = [
    ("payload not JSON", case_not_json, "INVALID_ARGUMENT", "payload_malformed"),
    ("payload a JSON array", case_json_array, "INVALID_ARGUMENT", "payload_malformed"),
    ("unknown key", case_unknown_key, "INVALID_ARGUMENT", "payload_malformed"),
    ("key in another case (Go would accept)", case_lowercase_key, "INVALID_ARGUMENT", "payload_malformed"),
    ("EKCert missing", case_missing_ek_cert, "INVALID_ARGUMENT", "payload_malformed"),
    ("DevIDCert null", case_null_devid_cert, "INVALID_ARGUMENT", "payload_malformed"),
    ("DevIDCert not a list", case_devid_cert_not_a_list, "INVALID_ARGUMENT", "payload_malformed"),
    ("DevIDCert empty", case_empty_chain, "INVALID_ARGUMENT", "payload_malformed"),
    ("AKPub not base64", case_bad_base64, "INVALID_ARGUMENT", "payload_malformed"),
    ("DevID leaf not a certificate", case_leaf_garbage, "INVALID_ARGUMENT", "devid_cert_malformed"),
    ("DevID intermediate not a certificate", case_intermediate_garbage, "INVALID_ARGUMENT", "devid_cert_malformed"),
    ("DevID from an untrusted CA", case_untrusted_ca, "PERMISSION_DENIED", "devid_cert_untrusted"),
    ("DevID intermediate not sent", case_intermediate_missing, "PERMISSION_DENIED", "devid_cert_untrusted"),
    ("DevID certificate expired", case_expired, "PERMISSION_DENIED", "devid_cert_untrusted"),
    ("DevID certificate for another key (SPIRE: accepted)", case_cert_for_another_key, "PERMISSION_DENIED", "devid_key_mismatch"),
    ("DevIDPub not a TPMT_PUBLIC", case_devid_pub_garbage, "INVALID_ARGUMENT", "devid_key_malformed"),
    ("DevID key without fixedTPM (SPIRE: ok)", _devid_attrs(DEVID & ~A.FIXED_TPM), "PERMISSION_DENIED", "devid_key_attributes"),
    ("DevID key that also decrypts (SPIRE: ok)", _devid_attrs(DEVID | A.DECRYPT), "PERMISSION_DENIED", "devid_key_attributes"),
    ("EKPub not a TPMT_PUBLIC", case_ek_pub_garbage, "INVALID_ARGUMENT", "ek_public_malformed"),
    ("EKPub an ECC key", case_ek_pub_ecc, "PERMISSION_DENIED", "ek_unsupported"),
    ("EKPub not the certificate's key", case_ek_pub_not_the_certificate, "PERMISSION_DENIED", "ek_cert_key_mismatch"),
    ("EKCert not a certificate", case_ek_cert_garbage, "PERMISSION_DENIED", "ek_cert_unparsable"),
    ("EKCert of an unknown vendor", case_ek_cert_unknown_vendor, "PERMISSION_DENIED", "ek_"),
    ("the machine's EK identity is banned", case_banned_ek, "PERMISSION_DENIED", "banned"),
    ("AKPub not a TPMT_PUBLIC", case_ak_pub_garbage, "INVALID_ARGUMENT", "ak_malformed"),
    ("AK not restricted (SPIRE: accepted)", _ak_attrs(AK & ~A.RESTRICTED), "PERMISSION_DENIED", "ak_attributes"),
    ("AK without fixedTPM (SPIRE: accepted)", _ak_attrs(AK & ~A.FIXED_TPM), "PERMISSION_DENIED", "ak_attributes"),
    ("certification not a TPMS_ATTEST", case_certify_garbage, "INVALID_ARGUMENT", "certify_malformed"),
    ("certification signature not a TPMT_SIGNATURE", case_certify_signature_garbage, "INVALID_ARGUMENT", "certify_malformed"),
    ("certification not TPM-generated (SPIRE: accepted)", _certify(magic=0x12345678), "PERMISSION_DENIED", "certify_invalid"),
    ("certification with qualifying data (SPIRE: ok)", _certify(extra_data=b"x" * 8), "PERMISSION_DENIED", "certify_invalid"),
    ("certification signed by another key", case_certify_by_another_key, "PERMISSION_DENIED", "certify_signature"),
    ("certification of another object", case_certify_other_object, "PERMISSION_DENIED", "certify_name_mismatch"),
    ("answer not JSON", case_response_not_json, "INVALID_ARGUMENT", "response_malformed"),
    ("answer without CredActivation", case_response_missing_cred, "INVALID_ARGUMENT", "response_malformed"),
    ("possession signature over another nonce", case_wrong_possession_signature, "PERMISSION_DENIED", "devid_signature"),
    ("credential activation answer wrong", case_wrong_secret, "PERMISSION_DENIED", "wrong_secret"),
]  # fmt: skip


def _attempt(env: Env, script: Callable[[Any], Any]) -> Any:
    try:
        return run_stream(env.srv.address, env.srv.bundle, script)
    except RpcFailed as failed:
        return failed


@pytest.mark.parametrize(("name", "make", "status", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    env: Env, name: str, make: Callable[[Env], Callable[[Any], Any]], status: str, reason: str
) -> None:
    store = env.srv.app.store
    assert store is not None
    script = make(env)
    before_agents = {a.spiffe_id: a for a in store.list_agents()}
    before_audit = len(env.srv.audit_lines())
    outcome = _attempt(env, script)
    assert isinstance(outcome, RpcFailed), f"{name}: expected a failure, got {outcome}"
    assert outcome.status == status, outcome
    audit = env.srv.audit_lines()[before_audit:]
    assert len(audit) == 1, audit
    assert audit[0]["status"] == status and audit[0]["reason"].startswith(reason), audit[0]
    assert audit[0]["attestor"] == "tpm_devid"
    assert outcome.reason == audit[0]["reason"], (outcome.detail, audit[0])
    assert {a.spiffe_id: a for a in store.list_agents()} == before_agents
    ok = _attempt(env, _req(env.sim()))
    assert not isinstance(ok, RpcFailed), ok


@pytest.mark.parametrize("alg", ["rsa", "ecc"])
def test_honest_attempt_gets_spire_servers_identity_and_selectors(env: Env, alg: str) -> None:
    import hashlib

    sim = env.sim(alg)
    out = _attempt(env, _req(sim))
    assert not isinstance(out, RpcFailed), out
    leaf_sha1 = hashlib.sha1(sim.chain[0], usedforsecurity=False).hexdigest()
    path = f"/spire/agent/tpm_devid/{leaf_sha1}"
    assert out.result.svid.id.path == path and out.result.reattestable
    assert env.srv.app.store is not None
    record = env.srv.app.store.get_agent(f"spiffe://example.org{path}")
    assert record is not None and record.attestation_type == "tpm_devid" and record.ek_hash == sim.ek_hash()
    fingerprints = [hashlib.sha1(c, usedforsecurity=False).hexdigest() for c in sim.chain[1:]]
    from cryptography.hazmat.primitives import serialization

    fingerprints.append(
        hashlib.sha1(
            env.pki.root.public_bytes(serialization.Encoding.DER), usedforsecurity=False
        ).hexdigest()
    )
    assert record.selectors == (
        "tpm_devid:subject:cn:devid-node-1",
        "tpm_devid:issuer:cn:Test DevID Intermediate CA",
        *(f"tpm_devid:ca:fingerprint:{fp}" for fp in fingerprints),
    )


def test_attestation_request_round_trips() -> None:
    from protocol.tpm_devid import decode_attestation_request

    req = AttestationRequest((b"a", b"b"), b"c", b"d", b"e", b"f", b"g", b"h")
    assert decode_attestation_request(encode_attestation_request(req)) == req
    doc = json.loads(encode_attestation_request(req))
    assert list(doc) == [
        "DevIDCert",
        "DevIDPub",
        "EKCert",
        "EKPub",
        "AKPub",
        "CertifiedDevID",
        "CertificationSignature",
    ]
