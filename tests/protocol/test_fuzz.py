"""Fuzz the codec and the TPM structure parsers: arbitrary input raises only ProtocolError.

Bounded by hypothesis settings so it runs in CI in seconds; ``FUZZ_EXAMPLES``
raises the count for longer local runs.
"""

from __future__ import annotations

import contextlib
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import der, tpm2
from protocol.errors import ProtocolError
from protocol.tpm_payload import (
    decode_attestation_data,
    decode_challenge,
    decode_challenge_response,
    decode_ek,
)
from tests.support.simtpm import SimulatedTpm

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_SIM = SimulatedTpm.create(None)
_AK = _SIM.ak_parameters()
SEEDS = [_AK.public, _AK.create_data, _AK.create_attestation, _AK.create_signature]
PARSERS = [
    tpm2.parse_public,
    tpm2.parse_creation_data,
    tpm2.parse_attest,
    tpm2.parse_signature,
    der.certificate_spki,
    der.first_element,
    der.spki_key_material,
]
DECODERS = [decode_attestation_data, decode_challenge, decode_challenge_response, decode_ek]


def _mutations() -> st.SearchStrategy[bytes]:
    def mutate(args: tuple[bytes, list[tuple[int, int]], int]) -> bytes:
        seed, flips, cut = args
        data = bytearray(seed)
        for pos, val in flips:
            if data:
                data[pos % len(data)] = val
        return bytes(data[: cut % (len(data) + 2)])

    return st.tuples(
        st.sampled_from(SEEDS),
        st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=6),
        st.integers(0, 4096),
    ).map(mutate)


@FUZZ
@given(st.one_of(st.binary(max_size=600), _mutations()))
def test_tpm_parsers_raise_only_protocol_errors(data: bytes) -> None:
    for parser in PARSERS:
        with contextlib.suppress(ProtocolError):
            parser(data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=20)
    | st.binary(max_size=40).map(lambda b: __import__("base64").b64encode(b).decode()),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "EK",
                    "AK",
                    "EC",
                    "Public",
                    "CreateData",
                    "CreateAttestation",
                    "CreateSignature",
                    "Secret",
                    "Credential",
                    "UseTCSDActivationFormat",
                    "x",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=20,
)


@FUZZ
@given(st.one_of(st.binary(max_size=400), json_values.map(lambda v: json.dumps(v).encode())))
def test_decoders_raise_only_protocol_errors(data: bytes) -> None:
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):
            decode(data)
