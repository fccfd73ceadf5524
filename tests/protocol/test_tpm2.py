"""TPM 2.0 structure parsers: round trips, truncation, trailing bytes, unknown algorithms."""

from __future__ import annotations

import pytest

from protocol import tpm2
from protocol.errors import TpmStructureError
from tests.support.simtpm import SimulatedTpm


@pytest.fixture(scope="module")
def sim() -> SimulatedTpm:
    return SimulatedTpm.create(None)


def test_ak_structures_parse(sim: SimulatedTpm) -> None:
    ak = sim.ak_parameters()
    pub = tpm2.parse_public(ak.public)
    assert pub.type == tpm2.Alg.RSA and pub.rsa_key_bits == 2048 and pub.rsa_exponent == 65537
    assert pub.has(tpm2.ObjectAttr.FIXED_TPM) and pub.has(tpm2.ObjectAttr.RESTRICTED)
    assert pub.scheme == tpm2.Scheme(tpm2.Alg.RSASSA, tpm2.Alg.SHA256)
    assert pub.name()[:2] == b"\x00\x0b" and len(pub.name()) == 34
    attest = tpm2.parse_attest(ak.create_attestation)
    assert attest.magic == tpm2.TPM_GENERATED_VALUE and attest.type == tpm2.TPM_ST_ATTEST_CREATION
    assert attest.object_name == pub.name()
    creation = tpm2.parse_creation_data(ak.create_data)
    assert creation.parent_name_alg == tpm2.Alg.SHA256 and creation.pcr_select == ()
    sig = tpm2.parse_signature(ak.create_signature)
    assert sig.sig_alg == tpm2.Alg.RSASSA and len(sig.rsa_signature) == 256


def test_spki_of_public_matches_key(sim: SimulatedTpm) -> None:
    from cryptography.hazmat.primitives import serialization

    spki = tpm2.spki_der(tpm2.parse_public(sim.ak_public()))
    assert spki == sim.ak.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.mark.parametrize(
    "parser",
    [tpm2.parse_public, tpm2.parse_attest, tpm2.parse_creation_data, tpm2.parse_signature],
    ids=lambda p: p.__name__,
)
def test_truncated_and_trailing(sim: SimulatedTpm, parser: object) -> None:
    ak = sim.ak_parameters()
    blob = {
        tpm2.parse_public: ak.public,
        tpm2.parse_attest: ak.create_attestation,
        tpm2.parse_creation_data: ak.create_data,
        tpm2.parse_signature: ak.create_signature,
    }[parser]  # type: ignore[index]
    assert callable(parser)
    parser(blob)
    for cut in (0, 1, len(blob) // 2, len(blob) - 1):
        with pytest.raises(TpmStructureError):
            parser(blob[:cut])
    with pytest.raises(TpmStructureError, match="trailing"):
        parser(blob + b"\x00")


def test_unknown_algorithm_refused(sim: SimulatedTpm) -> None:
    pub = bytearray(sim.ak_public())
    pub[0:2] = b"\x7f\x7f"
    with pytest.raises(TpmStructureError, match="unknown algorithm"):
        tpm2.parse_public(bytes(pub))


def test_ecc_public_round_trip() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    nums = key.public_numbers()
    raw = tpm2.encode_ecc_public(
        x=nums.x.to_bytes(32, "big"),
        y=nums.y.to_bytes(32, "big"),
        attributes=0x00050472,
        scheme=tpm2.Scheme(tpm2.Alg.ECDSA, tpm2.Alg.SHA256),
    )
    pub = tpm2.parse_public(raw)
    assert pub.type == tpm2.Alg.ECC and pub.ecc_curve == tpm2.EccCurve.NIST_P256
    assert tpm2.public_key(pub).public_numbers() == nums


def test_point_off_curve_refused() -> None:
    raw = tpm2.encode_ecc_public(x=b"\x01" * 32, y=b"\x02" * 32, attributes=0)
    with pytest.raises(TpmStructureError, match="not on the curve"):
        tpm2.public_key(tpm2.parse_public(raw))
