"""The lenient DER/X.509 parser: units, every real CA signature relation, and fuzzing."""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import der
from protocol.der import DerError
from protocol.tpm_payload import EkData
from server.ek.certificate import Certificate, parse_certificate, parse_name
from server.ek.keys import parse_spki
from server.ek.store import CaStore, ChainPolicy
from server.ek_trust import EkTrust
from tests.server.conftest import ca_relations, read_cert_der
from tests.server.ekpki import CA_FROM, make_ca, make_ek, tlv

ALL_SHA = ChainPolicy(allow_sha1=True)


@pytest.fixture(scope="module")
def real_store(manufacturer_ca: Path) -> CaStore:
    return CaStore.load(manufacturer_ca, generation=1, lenient=True)


def _by_file(store: CaStore) -> dict[str, Certificate]:
    return {store.source[cert.sha256].name: cert for certs in store.by_subject.values() for cert in certs}


def test_every_real_ca_signature_relation(real_store: CaStore, tpm_data: Path) -> None:
    """Each 'chain check' of SOURCES.md, re-done over the original TBS bytes (RSA, ECDSA P-256/384/521)."""
    by_file = _by_file(real_store)
    counts = {"issued": 0, "verifies": 0, "broken": 0, "root": 0, "orphan": 0}
    for name, check in ca_relations(tpm_data):
        cert = by_file[name]
        issued = re.match(r"issued by manufacturer-ca/(\S+) \(OpenSSL", check)
        verifies = re.match(r"issuer manufacturer-ca/(\S+?): signature VERIFIES", check)
        broken = re.match(r"issuer manufacturer-ca/(\S+?): signature does NOT verify", check)
        if issued or verifies:
            match = issued or verifies
            assert match is not None
            issuer_file = match.group(1)
            assert real_store.check_link(cert, by_file[issuer_file], ALL_SHA) is None, name
            assert real_store.build_paths(cert, ALL_SHA).paths, name
            counts["issued" if issued else "verifies"] += 1
        elif broken:
            error = real_store.check_link(cert, by_file[broken.group(1)], ALL_SHA)
            assert error is not None and not error.unsupported and "does not verify" in str(error)
            counts["broken"] += 1
        elif check.startswith("self-signed root"):
            assert real_store.is_root(cert), name
            counts["root"] += 1
        else:
            assert check == "issuer not in this collection"
            failure = real_store.build_paths(cert, ALL_SHA).failure
            assert failure is not None and failure.code == "ek_issuer_unknown"
            counts["orphan"] += 1
    assert counts == {"issued": 298, "verifies": 17, "broken": 1, "root": 26, "orphan": 3}


def test_sha1_links_need_allow_sha1(real_store: CaStore) -> None:
    by_file = _by_file(real_store)
    child = by_file["infineon-ifx-tpm-ek-intermediate-ca-01.pem"]
    issuer = real_store.issuers_of(child)[0]
    error = real_store.check_link(child, issuer, ChainPolicy())
    assert error is not None and error.unsupported and "SHA-1" in str(error)


@pytest.mark.parametrize(
    ("name", "quirk"),
    [
        ("amd-prg-phx-ecc.der", "trailing_data"),
        ("amd-prg-phx-rsa.der", "trailing_data"),
        ("intel-ondie-ca-csme-intermediate-ca.der", "ecdsa_sigalg_null_params"),
        ("intel-ondie-ca-root-cert-signing.pem", "ecdsa_sigalg_null_params"),
        ("nuvoton-ntc-tpm-ek-root-ca-01.pem", "unsorted_rdn_set"),
    ],
)
def test_real_ca_quirks(manufacturer_ca: Path, name: str, quirk: str) -> None:
    raw = read_cert_der(manufacturer_ca / name)
    with pytest.raises(ValueError, match="error parsing asn1 value"):
        x509.load_der_x509_certificate(raw)
    assert quirk in parse_certificate(raw).quirks


def test_tbs_is_kept_byte_for_byte(manufacturer_ca: Path) -> None:
    raw = read_cert_der(manufacturer_ca / "stmicro-tpm-ek-root-ca.pem")
    cert = parse_certificate(raw)
    assert cert.tbs == x509.load_der_x509_certificate(raw).tbs_certificate_bytes
    assert cert.der == raw and cert.trailing_bytes == 0


def test_name_normalisation() -> None:
    """String type, case and inner whitespace do not matter, nor attribute order inside an RDN."""

    def name(*rdns: list[tuple[str, int, bytes]]) -> bytes:
        oids = {
            "CN": bytes.fromhex("0603550403"),
            "O": bytes.fromhex("060355040a"),
            "C": bytes.fromhex("0603550406"),
        }
        sets = [tlv(0x31, b"".join(tlv(0x30, oids[k] + tlv(t, v)) for k, t, v in rdn)) for rdn in rdns]
        return tlv(0x30, b"".join(sets))

    def parsed(data: bytes) -> tuple[tuple[str, ...], ...]:
        quirks: set[str] = set()
        return parse_name(der.read_tlv(data, 0, len(data), quirks), quirks).key

    a = name([("CN", 0x0C, b"Vendor  EK CA")], [("O", 0x13, b"Vendor")])
    b = name([("CN", 0x13, b"vendor ek ca")], [("O", 0x0C, b"VENDOR")])
    c = name([("CN", 0x1E, "Vendor EK CA".encode("utf-16-be"))], [("O", 0x0C, b"Vendor")])
    assert parsed(a) == parsed(b) == parsed(c)
    assert parsed(a) != parsed(
        name([("O", 0x13, b"Vendor")], [("CN", 0x0C, b"Vendor EK CA")])
    )  # RDN order counts
    multi = name([("CN", 0x0C, b"XYZ"), ("C", 0x13, b"TW")])
    quirks: set[str] = set()
    text = parse_name(der.read_tlv(multi, 0, len(multi), quirks), quirks).text
    assert text == "CN=XYZ+C=TW" and quirks == {"unsorted_rdn_set"}
    assert parsed(multi) == parsed(name([("C", 0x13, b"TW"), ("CN", 0x0C, b"XYZ")]))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated"),
        (b"\x30", "truncated"),
        (b"\x30\x80\x00\x00", "indefinite length"),
        (b"\x30\x85\x01\x00\x00\x00\x00", "too long"),
        (b"\x30\x05\x02\x01", "claims 5 bytes"),
        (b"\x02\x00", "expected tag 0x30"),
        (b"\x30\x03\x02\x01\x01", "3 elements"),
    ],
)
def test_parse_errors(data: bytes, message: str) -> None:
    with pytest.raises(DerError, match=message):
        parse_certificate(data)


def test_non_minimal_length_is_a_quirk() -> None:
    quirks: set[str] = set()
    element = der.read_tlv(b"\x04\x81\x01\xaa", 0, 4, quirks)
    assert element.value == b"\xaa" and quirks == {"non_minimal_length"}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes_raise_only_der_error(data: bytes) -> None:
    for parse in (parse_certificate, lambda d: parse_spki(d, set())):
        with contextlib.suppress(DerError):  # anything else fails the test
            parse(data)


@functools.cache
def _seed() -> bytes:
    """A small deterministic ECC certificate to mutate."""
    key = ec.derive_private_key(0x5EED, ec.SECP256R1())
    root = make_ca("Fuzz Root", key, not_before=CA_FROM)
    return make_ek(root, key, serial=7).der


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_fuzz_mutated_certificates_raise_only_der_error(data: st.DataObject) -> None:
    raw = bytearray(_seed())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(DerError):  # anything else fails the test
        parse_certificate(bytes(raw[:cut]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_modified_real_ek_is_never_trusted(
    real_trust: EkTrust, tpm_data: Path, data: st.DataObject
) -> None:
    """Whatever bytes change in the certificate proper, verify() returns a denial and never raises."""
    original = read_cert_der(tpm_data / "ek-certs" / "stmicro-st33htph-ecc-ek.der")
    key = parse_certificate(original).public_key.der
    raw = bytearray(original)
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    verdict = real_trust.verify(EkData(public_key_der=key, certificate_der=bytes(raw)))
    assert not verdict.trusted
    assert verdict.reason_code in {
        "ek_cert_unparsable",
        "ek_chain_signature_invalid",
        "ek_cert_key_mismatch",
        "ek_issuer_unknown",
        "ek_cert_profile",
        "ek_cert_expired",
        "ek_cert_not_yet_valid",
        "ek_signature_algorithm_unsupported",
        "ek_chain_invalid",
    }
