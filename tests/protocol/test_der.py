"""protocol.der, the one DER reader: its structural helpers against python-cryptography and real EKs.

The server's lenient X.509 parser has its own tests (tests/server/test_ek_der.py); these cover what
the agent and the payload codec use, with python-cryptography as the independent oracle wherever it
can parse the certificate. The TPM data is read in place from shared/tpm-data.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from protocol import der
from protocol.errors import ProtocolError


def _ek_files(data_dir: Path) -> list[Path]:
    return sorted(p for p in (data_dir / "ek-certs").iterdir() if p.suffix in (".pem", ".der"))


def _cert_der(path: Path) -> bytes:
    raw = path.read_bytes()
    match = re.search(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", raw, re.DOTALL)
    return base64.b64decode(b"".join(match.group(1).split())) if match else raw


def test_spki_of_every_real_ek_matches_python_cryptography(tpm_data_dir: str) -> None:
    checked = 0
    for path in _ek_files(Path(tpm_data_dir)):
        raw = _cert_der(path)
        whole = der.first_element(raw)  # what the agent sends: the certificate without NV padding
        cert = x509.load_der_x509_certificate(whole)
        expected = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert der.certificate_spki(raw) == expected, path.name
        assert der.spki_key_material(expected)[1] == der.spki_key_material(der.certificate_spki(whole))[1]
        checked += 1
    assert checked >= 10


def test_first_element_drops_the_nv_padding(tpm_data_dir: str) -> None:
    raw = (Path(tpm_data_dir) / "ek-certs" / "stmicro-st33htph-rsa-ek-trailing-ff.der").read_bytes()
    with pytest.raises(ValueError, match="ExtraData"):
        x509.load_der_x509_certificate(raw)
    whole = der.first_element(raw)
    assert len(whole) == 1169 and raw[1169:] == b"\xff" * 431
    assert x509.load_der_x509_certificate(whole).serial_number == 0x4CBD0FE61EE762EDB28D50B268FC3586FF3D5E82


def test_rsa_key_material_ignores_the_oaep_algorithm_oid() -> None:
    body = der.read_tlv(bytes.fromhex("0303000102"), 0, 5, set()).raw  # a BIT STRING
    rsa = bytes.fromhex("300d06092a864886f70d0101010500")
    oaep = bytes.fromhex("300b06092a864886f70d010107")

    def spki(algorithm: bytes) -> bytes:
        content = algorithm + body
        return bytes([0x30, len(content)]) + content

    assert der.spki_key_material(spki(rsa)) == der.spki_key_material(spki(oaep)) == (b"rsa", b"\x00\x01\x02")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x30",
        b"\x30\x80",
        b"\x30\x85\x01\x00\x00\x00\x00",
        b"\x30\x05\x02\x01",
        b"\x04\x00",
        b"\x30\x00",
    ],
)
def test_malformed_input_raises_a_protocol_error(data: bytes) -> None:
    for helper in (der.first_element, der.certificate_spki, der.spki_key_material):
        if helper is der.first_element and data in (b"\x04\x00", b"\x30\x00"):
            assert helper(data) == data  # one whole element, whatever it is
            continue
        with pytest.raises(der.DerError) as caught:
            helper(data)
        assert isinstance(caught.value, ProtocolError)
