"""EK trust against real TPM data: every real EK certificate, its real chain, and what breaks it.

The data is read in place from shared/tpm-data (never copied into the project);
directories with subsets of the CA collection are made of symlinks in tmp_path.
The clock is fixed (``NOW``) so the results do not depend on the day the tests run.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from protocol.tpm_payload import EkData, decode_ek, pub_hash
from server.ek.certificate import parse_certificate
from server.ek.profile import security_problem, tcg_profile_issues
from server.ek.store import ChainPolicy
from server.ek_trust import EkNotTrustedError, EkTrust, EkTrustConfig
from server.errors import AttestationDeniedError
from tests.conftest import TPM_DATA
from tests.server.conftest import RealEk, read_cert_der, real_eks
from tests.server.ekpki import NOW


def _collection_data_dir() -> Path:
    for candidate in (os.environ.get("NODETRUST_TPM_DATA", ""), TPM_DATA, "/work/shared/tpm-data"):
        if candidate and os.path.isdir(candidate):
            return Path(candidate)
    return Path(TPM_DATA)  # missing: the tpm_data fixture fails the tests with a clear message


DATA = _collection_data_dir()
REAL_EKS = real_eks(DATA) if (DATA / "SOURCES.md").is_file() else []
NUVOTON_ROOT = "nuvoton-tpm-root-ca-2111.pem"


def ek_of(cert_der: bytes, key_der: bytes | None = None) -> EkData:
    """What an honest agent sends: the certificate and the PUBLIC KEY block taken from it."""
    key = key_der or parse_certificate(cert_der).public_key.der
    return EkData(public_key_der=key, certificate_der=cert_der)


def subject_of(path: Path) -> str:
    """The subject as python-cryptography renders it (an independent oracle for our chain text)."""
    with warnings.catch_warnings():  # Google's CAs have CNs longer than 64 characters
        warnings.simplefilter("ignore", UserWarning)
        return x509.load_der_x509_certificate(read_cert_der(path)).subject.rfc4514_string()


def nuvoton_ek() -> EkData:
    """The Nuvoton NPCT75x EK (PUBLIC KEY + CERTIFICATE) from spire-tpm-plugin's tests (vectors.json)."""
    vectors = json.loads((DATA / "vectors.json").read_text())
    return decode_ek(vectors["ek_public_key_sha256_spki"][0]["input_pem"].encode())


def test_every_real_ek_file_is_in_the_table(tpm_data: Path) -> None:
    listed = {ek.file for ek in REAL_EKS}
    present = {p.name for p in (tpm_data / "ek-certs").iterdir() if p.suffix in (".pem", ".der")}
    assert present and present == listed


@pytest.mark.parametrize("real", REAL_EKS, ids=str)
def test_real_ek_chains_to_its_manufacturer(real: RealEk, real_trust: EkTrust, tpm_data: Path) -> None:
    cert_der = read_cert_der(tpm_data / "ek-certs" / real.file)
    verdict = real_trust.verify(ek_of(cert_der))
    assert verdict.trusted, verdict.reason
    assert (verdict.method, verdict.reason_code) == ("ca", "ok")
    expected = [subject_of(tpm_data / "manufacturer-ca" / name) for name in real.chain]
    assert list(verdict.chain[1:]) == expected
    assert verdict.ek_hash == pub_hash(parse_certificate(cert_der).public_key.der)


# Google's CAS-issued ("pca") EK certificates name the instance in the subject instead of a TCG SAN.
_GOOGLE_CAS_DEVIATIONS = (
    "subjectAltName (TPM manufacturer/model/version) is missing",
    "authorityKeyIdentifier (with a key identifier) is missing",
)


@pytest.mark.parametrize("real", REAL_EKS, ids=str)
def test_real_ek_passes_the_profile_rules(real: RealEk, tpm_data: Path) -> None:
    """Real vendor certificates are the ground truth for the profile rules (issue 11, Intel PTT ECC)."""
    cert = parse_certificate(read_cert_der(tpm_data / "ek-certs" / real.file))
    assert security_problem(cert, ChainPolicy()) is None
    issues = tcg_profile_issues(cert)
    if real.file.startswith("google-gce-vtpm-") and real.file.endswith("-pca.pem"):
        assert set(issues) <= set(_GOOGLE_CAS_DEVIATIONS) and issues, issues
    else:
        assert issues == ()


def test_the_nuvoton_ek_passes_the_profile_rules() -> None:
    nuvoton = nuvoton_ek()
    assert nuvoton.certificate_der is not None
    cert = parse_certificate(nuvoton.certificate_der)
    assert security_problem(cert, ChainPolicy()) is None and tcg_profile_issues(cert) == ()


@pytest.mark.parametrize("real", REAL_EKS, ids=str)
def test_real_ek_denied_when_cas_are_missing(
    real: RealEk, tpm_data: Path, link_dir: Callable[..., Path]
) -> None:
    ca = tpm_data / "manufacturer-ca"
    ek = ek_of(read_cert_der(tpm_data / "ek-certs" / real.file))
    chain = [ca / name for name in real.chain]

    def verdict(files: list[Path], *, anchors: bool = True) -> tuple[bool, str, str]:
        config = EkTrustConfig(ca_dir=link_dir(files), intermediates_as_anchors=anchors)
        result = EkTrust.load(config, clock=lambda: NOW).verify(ek)
        return result.trusted, result.reason_code, result.reason

    trusted, code, reason = verdict([])
    assert (trusted, code) == (False, "ek_issuer_unknown")
    assert "not found in ca_dir" in reason and "add the manufacturer's CA certificates" in reason

    # The direct issuer missing: nothing else can stand in for it.
    trusted, code, _ = verdict(chain[1:])
    assert (trusted, code) == (False, "ek_issuer_unknown")

    # Only the root missing: upstream semantics (every file is an anchor) still trust the intermediate...
    trusted, code, _ = verdict(chain[:-1])
    assert (trusted, code) == (True, "ok")
    # ...but not with intermediates_as_anchors false: a path must reach a self-signed root.
    trusted, code, reason = verdict(chain[:-1], anchors=False)
    assert (trusted, code) == (False, "ek_chain_incomplete")
    assert "is not in ca_dir" in reason
    assert verdict(chain, anchors=False)[:2] == (True, "ok")


@pytest.mark.parametrize("real", REAL_EKS, ids=str)
def test_real_ek_time_window(real: RealEk, real_trust: EkTrust, tpm_data: Path) -> None:
    cert_der = read_cert_der(tpm_data / "ek-certs" / real.file)
    cert = parse_certificate(cert_der)
    ek = ek_of(cert_der)
    late = real_trust.verify(ek, now=cert.not_after + dt.timedelta(seconds=1))
    assert (late.trusted, late.reason_code) == (False, "ek_cert_expired")
    assert "EK certificate" in late.reason and cert.serial_hex in late.reason
    early = real_trust.verify(ek, now=cert.not_before - dt.timedelta(seconds=1))
    assert (early.trusted, early.reason_code) == (False, "ek_cert_not_yet_valid")
    assert real_trust.verify(ek, now=cert.not_before).trusted  # the bounds are inclusive
    ca = tpm_data / "manufacturer-ca"
    chain_end = min(parse_certificate(read_cert_der(ca / name)).not_after for name in real.chain)
    at_end = real_trust.verify(ek, now=cert.not_after)
    if cert.not_after <= chain_end:
        assert at_end.trusted
    else:  # e.g. STM's 2049 EK under an intermediate that ends in 2038: the CA expires first
        assert at_end.reason_code == "ek_cert_expired" and at_end.reason.startswith("CA certificate")
        assert real_trust.verify(ek, now=chain_end).trusted


@pytest.mark.parametrize("real", REAL_EKS, ids=str)
def test_real_ek_tampering_is_detected(real: RealEk, real_trust: EkTrust, tpm_data: Path) -> None:
    original = read_cert_der(tpm_data / "ek-certs" / real.file)
    cert = parse_certificate(original)
    key = cert.public_key.der
    # One byte of the signature flipped (the last byte of the certificate proper).
    end = len(cert.der) - 1
    flipped = original[:end] + bytes([original[end] ^ 0x01]) + original[end + 1 :]
    verdict = real_trust.verify(ek_of(flipped, key))
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_chain_signature_invalid"), verdict.reason
    assert "does not verify" in verdict.reason
    # The TBS altered: one digit of notBefore changed, still well-formed DER.
    stamp = cert.not_before.strftime("%y%m%d%H%M").encode()
    assert original.count(stamp) >= 1
    at = original.index(stamp) + len(stamp) - 1
    altered = original[:at] + bytes([original[at] ^ 0x01]) + original[at + 1 :]
    assert parse_certificate(altered).tbs != cert.tbs
    verdict = real_trust.verify(ek_of(altered, key))
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_chain_signature_invalid")


def test_real_ek_with_another_tpms_key_is_refused(real_trust: EkTrust, tpm_data: Path) -> None:
    stm = read_cert_der(tpm_data / "ek-certs" / "stmicro-rsa-ek-ca06-guard.pem")
    other_key = parse_certificate(read_cert_der(tpm_data / "ek-certs" / "infineon-slb9670-rsa-ek-ca007.der"))
    verdict = real_trust.verify(ek_of(stm, other_key.public_key.der))
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_cert_key_mismatch")
    assert "differs from the EK PUBLIC KEY block" in verdict.reason
    with pytest.raises(EkNotTrustedError) as caught:
        verdict.raise_if_denied()
    assert isinstance(caught.value, AttestationDeniedError)
    assert caught.value.reason == "ek_cert_key_mismatch" and caught.value.grpc_code == "PERMISSION_DENIED"
    # An ECC certificate with an RSA PUBLIC KEY block: also a mismatch, never a crash.
    ecc = read_cert_der(tpm_data / "ek-certs" / "stmicro-st33htph-ecc-ek.der")
    assert real_trust.verify(ek_of(ecc, other_key.public_key.der)).reason_code == "ek_cert_key_mismatch"


def test_nuvoton_needs_the_lenient_parser(tpm_data: Path, link_dir: Callable[..., Path]) -> None:
    """python-cryptography refuses both the Nuvoton root and the EK (multi-valued RDN not in DER order)."""
    root = tpm_data / "manufacturer-ca" / NUVOTON_ROOT
    ek = nuvoton_ek()
    assert ek.certificate_der is not None
    with pytest.raises(ValueError, match="InvalidSetOrdering"):
        x509.load_pem_x509_certificate(root.read_bytes())
    with pytest.raises(ValueError, match="InvalidSetOrdering"):
        x509.load_der_x509_certificate(ek.certificate_der)

    ca_dir = link_dir([root])
    verdict = EkTrust.load(EkTrustConfig(ca_dir=ca_dir), clock=lambda: NOW).verify(ek)
    assert verdict.trusted, verdict.reason
    assert verdict.chain[-1] == "CN=Nuvoton TPM Root CA 2111+O=Nuvoton Technology Corporation+C=TW"
    assert "unsorted_rdn_set" in verdict.quirks
    assert verdict.tpm.startswith("manufacturer id:4E544300")  # "NTC"

    strict = EkTrust.load(EkTrustConfig(ca_dir=ca_dir, lenient_parsing=False), clock=lambda: NOW)
    assert [s.path.name for s in strict.skipped_files] == [NUVOTON_ROOT]
    assert "needs lenient parsing (unsorted_rdn_set)" in strict.skipped_files[0].reason
    denied = strict.verify(ek)
    assert (denied.trusted, denied.reason_code) == (False, "ek_cert_unparsable")


def test_trailing_bytes_are_stripped_like_go_attestation(real_trust: EkTrust, tpm_data: Path) -> None:
    raw = (tpm_data / "ek-certs" / "stmicro-st33htph-rsa-ek-trailing-ff.der").read_bytes()
    with pytest.raises(ValueError, match="ExtraData"):
        x509.load_der_x509_certificate(raw)
    cert = parse_certificate(raw)
    assert (len(cert.der), cert.trailing_bytes) == (1169, 431) and raw[1169:] == b"\xff" * 431
    verdict = real_trust.verify(ek_of(raw))
    assert verdict.trusted and verdict.quirks == ("trailing_data",)


def test_the_whole_real_collection_loads(real_trust: EkTrust) -> None:
    assert real_trust.ca_certificate_count == 367
    assert real_trust.skipped_files == ()


def test_unparsable_ca_file_is_skipped_and_reported(
    tpm_data: Path, link_dir: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    real = next(ek for ek in REAL_EKS if ek.file == "infineon-slb9670-rsa-ek-ca007.der")
    ca_dir = link_dir([tpm_data / "manufacturer-ca" / name for name in real.chain])
    (ca_dir / "broken.pem").write_bytes(
        b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----"
    )
    (ca_dir / "garbage.der").write_bytes(b"\x30\x82\xff\xff" + os.urandom(64))
    (ca_dir / "notes.txt").write_text("vendor bundle downloaded 2026-05-01\n")
    (ca_dir / "gone.pem").symlink_to(ca_dir / "deleted-vendor-file.pem")
    (ca_dir / "subdir").mkdir()  # not a file: ignored
    with caplog.at_level(logging.WARNING, logger="server.ek"):
        trust = EkTrust.load(EkTrustConfig(ca_dir=ca_dir), clock=lambda: NOW)
    skipped = {item.path.name: item.reason for item in trust.skipped_files}
    assert set(skipped) == {"broken.pem", "garbage.der", "notes.txt", "gone.pem"}
    assert "broken symbolic link" in skipped["gone.pem"]
    assert "invalid base64" in skipped["broken.pem"]
    assert "not a certificate" in skipped["garbage.der"]
    assert all(name in caplog.text for name in skipped)
    assert trust.ca_certificate_count == len(real.chain)
    verdict = trust.verify(ek_of(read_cert_der(tpm_data / "ek-certs" / real.file)))
    assert verdict.trusted, verdict.reason


def test_pem_bundle_with_several_certificates(tpm_data: Path, tmp_path: Path) -> None:
    real = next(ek for ek in REAL_EKS if ek.file == "stmicro-rsa-ek-ca06-guard.pem")
    ca_dir = tmp_path / "bundle"
    ca_dir.mkdir()
    pems = [
        x509.load_der_x509_certificate(read_cert_der(tpm_data / "manufacturer-ca" / name)).public_bytes(
            serialization.Encoding.PEM
        )
        for name in real.chain
    ]
    (ca_dir / "stm-bundle.pem").write_bytes(b"# STMicro EK chain\n" + b"\n".join(pems))
    trust = EkTrust.load(EkTrustConfig(ca_dir=ca_dir), clock=lambda: NOW)
    assert trust.ca_certificate_count == 3
    verdict = trust.verify(ek_of(read_cert_der(tpm_data / "ek-certs" / real.file)))
    assert verdict.trusted and len(verdict.chain) == 4


def test_vectors_hashes_are_reproduced(tpm_data: Path) -> None:
    vectors = json.loads((tpm_data / "vectors.json").read_text())
    checked = 0
    for vector in vectors["ek_public_key_sha256_spki"]:
        text = vector.get("input_pem")
        if not text:
            continue
        blocks = dict(re.findall(r"-----BEGIN ([A-Z ]+)-----(.*?)-----END", text, re.DOTALL))
        if "PUBLIC KEY" in blocks:
            ek = decode_ek(text.encode())
            assert ek.pub_hash == vector["expected_sha256_hex"]
        if "CERTIFICATE" in blocks:  # the certificate's own key gives the same hash (GetPubHash)
            cert = parse_certificate(base64.b64decode("".join(blocks["CERTIFICATE"].split())))
            assert pub_hash(cert.public_key.der) == vector["expected_sha256_hex"]
        checked += 1
    for vector in vectors["ek_public_area_tpm2b"]:
        pem = vector["computed_spki_pem"]
        der = base64.b64decode("".join(pem.split("-----")[2].split()))
        assert pub_hash(der) == vector["computed_sha256_der_spki_hex"]
        checked += 1
    assert checked >= 6


def test_nuvoton_vector_hash_mode(tmp_path: Path) -> None:
    ek = nuvoton_ek()
    hashes = tmp_path / "hashes"
    hashes.mkdir()
    (hashes / "5f4f4e37a35ed4d11ae72587e5f0c87b3ce784fa372767f9f986b0b7bf29a328").touch()
    trust = EkTrust.load(EkTrustConfig(hash_dir=hashes))
    verdict = trust.verify(ek)
    assert (verdict.trusted, verdict.method, verdict.reason_code) == (True, "hash", "ok")
