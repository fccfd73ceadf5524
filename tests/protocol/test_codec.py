"""The tpm attestor JSON: exact Go encoding, round trips, and every malformed input refused with PayloadError."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from protocol.credential import Credential
from protocol.errors import PayloadError
from protocol.tpm_payload import (
    AttestationData,
    AttestationParameters,
    EkData,
    decode_attestation_data,
    decode_challenge,
    decode_challenge_response,
    decode_ek,
    encode_attestation_data,
    encode_challenge,
    encode_challenge_response,
    encode_ek,
    pub_hash,
)
from tests.support.simtpm import SimCa, SimulatedTpm


@pytest.fixture(scope="module")
def sim() -> SimulatedTpm:
    return SimulatedTpm.create(SimCa.create())


def test_payload_is_go_style_json(sim: SimulatedTpm) -> None:
    data = sim.attestation_data()
    raw = encode_attestation_data(data)
    # Go's encoding/json: field order of the structs, no spaces, padded standard base64.
    assert raw.startswith(b'{"EK":"')
    keys = list(json.loads(raw)["AK"].keys())
    assert keys == [
        "Public",
        "UseTCSDActivationFormat",
        "CreateData",
        "CreateAttestation",
        "CreateSignature",
    ]
    assert b" " not in raw
    doc = json.loads(raw)
    assert doc["AK"]["UseTCSDActivationFormat"] is False
    assert base64.b64decode(doc["AK"]["Public"]) == data.ak.public
    pem = base64.b64decode(doc["EK"])
    assert pem.index(b"BEGIN CERTIFICATE") < pem.index(b"BEGIN PUBLIC KEY")
    assert decode_attestation_data(raw) == data


def test_challenge_and_response_round_trip() -> None:
    cred = Credential(credential_blob=b"\x00\x04abcd", encrypted_secret=b"\x00\x02xy")
    raw = encode_challenge(cred)
    assert raw == b'{"EC":{"Credential":"AARhYmNk","Secret":"AAJ4eQ=="}}'
    assert decode_challenge(raw) == cred
    assert encode_challenge_response(b"\x01" * 32).startswith(b'{"Secret":"')
    assert decode_challenge_response(encode_challenge_response(b"s3")) == b"s3"


def test_ek_pem_blocks_in_either_order(sim: SimulatedTpm) -> None:
    ek = EkData(public_key_der=sim.ek_spki, certificate_der=sim.ek_cert_der)
    pem = encode_ek(ek)
    cert_block, key_block = pem.split(b"-----END CERTIFICATE-----\n")
    swapped = key_block + cert_block + b"-----END CERTIFICATE-----\n"
    assert decode_ek(swapped) == ek
    assert decode_ek(pem).pub_hash == sim.ek_hash


def test_pub_hash_vectors(tpm_data_dir: str) -> None:
    vectors = json.loads(Path(tpm_data_dir, "vectors.json").read_text())["ek_public_key_sha256_spki"]
    checked = 0
    for v in vectors:
        pem = v["input_pem"]
        if not pem or "PUBLIC KEY" not in pem:
            continue
        ek = decode_ek(pem.encode())
        assert ek.pub_hash == v["expected_sha256_hex"], v["source"]
        assert pub_hash(ek.public_key_der) == v["expected_sha256_hex"]
        checked += 1
    assert checked >= 3


def _payload(sim: SimulatedTpm) -> dict[str, object]:
    result: dict[str, object] = json.loads(encode_attestation_data(sim.attestation_data()))
    return result


BAD_PAYLOADS: list[tuple[str, object, str]] = [
    ("not json", b"{not json", "not valid JSON"),
    ("json array", b"[1,2]", "expected a JSON object"),
    ("no EK", {"AK": {}}, "missing 'EK'"),
    ("EK null", {"EK": None, "AK": {}}, "missing 'EK'"),
    ("EK not a string", {"EK": 5, "AK": {}}, "expected a base64 string"),
    ("bad base64", {"EK": "!!!notbase64", "AK": {}}, "invalid base64"),
    ("EK without PEM", {"EK": base64.b64encode(b"hello").decode(), "AK": {}}, "no PEM block"),
    (
        "EK with a private key block",
        {
            "EK": base64.b64encode(
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
            ).decode(),
            "AK": {},
        },
        "unexpected PEM block type",
    ),
]


@pytest.mark.parametrize(("case", "doc", "message"), BAD_PAYLOADS, ids=[c[0] for c in BAD_PAYLOADS])
def test_bad_payloads(case: str, doc: object, message: str) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(PayloadError, match=message):
        decode_attestation_data(raw)


def test_missing_public_key_block(sim: SimulatedTpm) -> None:
    doc = _payload(sim)
    assert sim.ek_cert_der is not None
    only_cert = encode_ek(EkData(public_key_der=sim.ek_spki, certificate_der=sim.ek_cert_der)).split(
        b"-----BEGIN PUBLIC KEY"
    )[0]
    doc["EK"] = base64.b64encode(only_cert).decode()
    with pytest.raises(PayloadError, match="PUBLIC KEY block is missing"):
        decode_attestation_data(json.dumps(doc).encode())


@pytest.mark.parametrize("field", ["Public", "CreateData", "CreateAttestation", "CreateSignature"])
def test_missing_ak_fields(sim: SimulatedTpm, field: str) -> None:
    doc = _payload(sim)
    ak = doc["AK"]
    assert isinstance(ak, dict)
    del ak[field]
    with pytest.raises(PayloadError, match=f"missing '{field}'"):
        decode_attestation_data(json.dumps(doc).encode())


def test_tcsd_format_refused(sim: SimulatedTpm) -> None:
    doc = _payload(sim)
    ak = doc["AK"]
    assert isinstance(ak, dict)
    ak["UseTCSDActivationFormat"] = True
    with pytest.raises(PayloadError, match=r"TPM 1\.2"):
        decode_attestation_data(json.dumps(doc).encode())


def test_attestation_parameters_are_plain_bytes() -> None:
    data = AttestationData(
        ek=EkData(public_key_der=b"x"),
        ak=AttestationParameters(
            public=b"p", create_data=b"d", create_attestation=b"a", create_signature=b"s"
        ),
    )
    with pytest.raises(PayloadError):  # the EK key is not a SubjectPublicKeyInfo
        decode_attestation_data(encode_attestation_data(data))


@pytest.mark.parametrize(
    "bad",
    [
        "spiffe://example.org\n/spire/agent/tpm/" + "a" * 64,
        "spiffe://example.org/spire/agent\n/tpm/" + "a" * 64,
        "spiffe://example.org/spire/agent/tpm/" + "a" * 64 + "\n",
    ],
    ids=["trust domain", "path segment", "EK hash"],
)
def test_spiffe_ids_with_a_trailing_newline_are_refused(bad: str) -> None:
    """`^...$` accepted a trailing newline in each part (issue 11's class of defect)."""
    from protocol.errors import SpiffeIdError
    from protocol.spiffe import SpiffeId, is_tpm_agent_id, tpm_agent_id, validate_trust_domain

    with pytest.raises(SpiffeIdError):
        validate_trust_domain("example.org\n")
    with pytest.raises(SpiffeIdError):
        tpm_agent_id("example.org", "a" * 64 + "\n")
    try:
        parsed = SpiffeId.parse(bad)
    except SpiffeIdError:
        return
    assert not is_tpm_agent_id(parsed, "example.org")
