"""Chain building and EK profile checks on generated hierarchies (RSA, ECC, RSA-PSS), deterministic clock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from protocol.tpm_payload import EkData
from server.ek_trust import EkTrust, EkTrustConfig, EkVerdict
from tests.server.ekpki import (
    NOW,
    Issued,
    PrivateKey,
    assemble,
    make_ca,
    make_ek,
    resign_with_tbs_edit,
    spki,
    tlv,
)

Keys = Callable[[str], PrivateKey]
RSA_ENCRYPTION = bytes.fromhex("06092a864886f70d010101")
RSAES_OAEP = bytes.fromhex("06092a864886f70d010107")


@pytest.fixture
def verify(tmp_path: Path) -> Callable[..., EkVerdict]:
    """verify(ek, cas, **config) with the CA certificates written to a fresh directory."""
    counter = iter(range(1000))

    def run(
        ek: Issued | tuple[bytes, bytes], cas: list[Issued], now: dt.datetime = NOW, **config: object
    ) -> EkVerdict:
        directory = tmp_path / f"ca{next(counter)}"
        directory.mkdir()
        for index, ca in enumerate(cas):
            (directory / f"{index:02d}.pem").write_bytes(ca.pem)
        trust = EkTrust.load(EkTrustConfig(ca_dir=directory, **config), clock=lambda: now)  # type: ignore[arg-type]
        cert_der, key_der = (ek.der, spki(ek.key)) if isinstance(ek, Issued) else ek
        return trust.verify(EkData(public_key_der=key_der, certificate_der=cert_der))

    return run


def cn(issued: Issued) -> str:
    return issued.cert.subject.rfc4514_string()


@pytest.mark.parametrize(
    "case",
    [
        ("rsa-root", "rsa-int", "rsa-ek", hashes.SHA256(), False),
        ("rsa-root", "rsa-int", "rsa-ek", hashes.SHA384(), True),  # RSASSA-PSS everywhere
        ("p384-root", "p256-int", "p256-ek", hashes.SHA256(), False),
        ("p384-root", "p384-int", "rsa-ek", hashes.SHA512(), False),
        ("p521-root", "p384-int", "p256-ek", hashes.SHA384(), False),
    ],
    ids=["rsa", "rsa-pss", "ecc-p256", "ecc-p384-sha512", "ecc-p521"],
)
def test_generated_hierarchies(
    keys: Keys, verify: Callable[..., EkVerdict], case: tuple[str, str, str, hashes.SHA256, bool]
) -> None:
    root_key, int_key, ek_key, hash_alg, pss = case
    root = make_ca("Root", keys(root_key), hash_alg=hash_alg, pss=pss and root_key.startswith("rsa"))
    inter = make_ca("Intermediate", keys(int_key), root, hash_alg=hash_alg, pss=pss, path_length=0)
    ek = make_ek(inter, keys(ek_key), hash_alg=hash_alg, pss=pss)
    verdict = verify(ek, [root, inter])
    assert verdict.trusted, verdict.reason
    assert verdict.chain == ("(empty subject, serial 4E4B)", cn(inter), cn(root))
    assert verdict.tpm == "manufacturer id:54455354 model TESTTPM version id:00010002"
    assert verdict.warnings == ()


def test_expiry_and_not_yet_valid_anywhere_in_the_chain(
    keys: Keys, verify: Callable[..., EkVerdict]
) -> None:
    root = make_ca("Root", keys("p384-root"), not_before=dt.datetime(2027, 1, 1, tzinfo=dt.UTC))
    inter = make_ca("Intermediate", keys("p256-int"), root, not_after=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    ek = make_ek(inter, keys("p256-ek"))
    verdict = verify(ek, [root, inter], intermediates_as_anchors=False)
    assert verdict.reason_code == "ek_cert_expired"
    assert verdict.reason.startswith(f"CA certificate '{cn(inter)}'")
    inter_ok = make_ca("Intermediate", keys("p256-int"), root)
    verdict = verify(make_ek(inter_ok, keys("p256-ek")), [root, inter_ok], intermediates_as_anchors=False)
    assert verdict.reason_code == "ek_cert_not_yet_valid" and "CN=Root" in verdict.reason
    assert "check the server's clock" in verdict.reason


def test_an_expired_root_falls_back_to_the_intermediate_anchor(
    keys: Keys, verify: Callable[..., EkVerdict]
) -> None:
    root = make_ca("Root", keys("p384-root"), not_after=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    inter = make_ca("Intermediate", keys("p256-int"), root)
    ek = make_ek(inter, keys("p256-ek"))
    verdict = verify(ek, [root, inter])
    assert verdict.trusted and verdict.chain[-1] == cn(inter)  # upstream semantics
    assert verify(ek, [root, inter], intermediates_as_anchors=False).reason_code == "ek_cert_expired"


@pytest.mark.parametrize(
    ("inter_kwargs", "reason"),
    [
        ({"ca": False}, "is not a CA"),
        ({"basic_constraints": False}, "is not a CA"),
        ({"key_cert_sign": False}, "keyUsage lacks keyCertSign"),
        ({"extra": (x509.InhibitAnyPolicy(0), True)}, "unsupported critical extensions 2.5.29.54"),
    ],
    ids=["ca-false", "no-basic-constraints", "no-keycertsign", "unknown-critical"],
)
def test_intermediate_must_be_a_ca(
    keys: Keys, verify: Callable[..., EkVerdict], inter_kwargs: dict[str, object], reason: str
) -> None:
    root = make_ca("Root", keys("p384-root"))
    inter = make_ca("Intermediate", keys("p256-int"), root, **inter_kwargs)  # type: ignore[arg-type]
    ek = make_ek(inter, keys("p256-ek"))
    verdict = verify(ek, [root, inter])
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_chain_invalid")
    assert reason in verdict.reason


def test_path_length_constraint(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"), path_length=0)
    inter = make_ca("Intermediate", keys("p256-int"), root)
    ek = make_ek(inter, keys("p256-ek"))
    strict = verify(ek, [root, inter], intermediates_as_anchors=False)
    assert strict.reason_code == "ek_chain_invalid" and "pathLenConstraint" in strict.reason
    relaxed = verify(ek, [root, inter])  # the intermediate is an anchor itself: the root is not needed
    assert relaxed.trusted and relaxed.chain[-1] == cn(inter)


def test_max_chain_depth(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    chain = [root]
    for level in range(3):
        chain.append(make_ca(f"Level {level}", keys(f"p256-level{level}"), chain[-1]))
    ek = make_ek(chain[-1], keys("p256-ek"))
    assert verify(ek, chain, intermediates_as_anchors=False).trusted
    deep = verify(ek, chain, intermediates_as_anchors=False, max_chain_depth=2)
    assert deep.reason_code == "ek_chain_invalid" and "max_chain_depth 2" in deep.reason


def test_issuer_selected_by_key_identifier(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    """Two CAs with one name (a key roll-over): the AKI picks the right one; the wrong one is not enough."""
    old = make_ca("Vendor EK CA", keys("p256-old"))
    new = make_ca("Vendor EK CA", keys("p256-new"), serial=0x2000)
    ek = make_ek(new, keys("p256-ek"))
    verdict = verify(ek, [old, new])
    assert verdict.trusted and verdict.chain[-1] == cn(new)
    missing = verify(ek, [old])
    assert missing.reason_code == "ek_issuer_unknown"
    assert "authorityKeyIdentifier" in missing.reason


def test_signature_by_an_impostor_ca(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    inter = make_ca("Intermediate", keys("p256-int"), root)
    impostor = make_ca("Root", keys("p384-impostor"))  # same name, other key
    forged = make_ca("Intermediate", keys("p256-int"), impostor)
    ek = make_ek(forged, keys("p256-ek"))
    # The forged intermediate's AKI names the impostor; the real root is tried anyway and does not verify.
    verdict = verify(ek, [root, forged], intermediates_as_anchors=False)
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_chain_incomplete")
    assert "does not verify" in verdict.reason and "authorityKeyIdentifier" in verdict.reason
    # The EK signed by the real intermediate key but presented under a tampered TBS: signature invalid.
    good = make_ek(inter, keys("p256-ek"))
    tampered = resign_with_tbs_edit(good, b"TESTTPM", b"EVILTPM", keys("p256-attacker"))
    bad = verify((tampered, spki(keys("p256-ek"))), [root, inter])
    assert bad.reason_code == "ek_chain_signature_invalid"


@pytest.mark.parametrize(
    ("ek_kwargs", "reason"),
    [
        ({"ca": True}, "is a CA certificate"),
        ({"key_usage": "signature"}, "keyEncipherment"),
        ({"extra": (x509.InhibitAnyPolicy(0), True)}, "unsupported critical extensions"),
    ],
    ids=["ek-is-ca", "rsa-without-keyencipherment", "unknown-critical"],
)
def test_ek_profile_security_checks(
    keys: Keys, verify: Callable[..., EkVerdict], ek_kwargs: dict[str, object], reason: str
) -> None:
    root = make_ca("Root", keys("p384-root"))
    ek = make_ek(root, keys("rsa-ek"), **ek_kwargs)  # type: ignore[arg-type]
    verdict = verify(ek, [root])
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_cert_profile")
    assert reason in verdict.reason


def test_ecc_ek_key_usage_follows_real_certificates(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    """The TCG profile says keyAgreement; Intel PTT ECC EK certificates say keyEncipherment only."""
    root = make_ca("Root", keys("p384-root"))
    assert verify(make_ek(root, keys("p256-ek"), key_usage="agreement"), [root]).trusted  # TCG profile
    intel_ptt = verify(make_ek(root, keys("p256-ek"), key_usage="encipherment"), [root])
    assert intel_ptt.trusted, intel_ptt.reason
    assert verify(make_ek(root, keys("p256-ek"), key_usage=None), [root]).trusted  # absent keyUsage: allowed
    signing = verify(make_ek(root, keys("p256-ek"), key_usage="signature"), [root])
    assert (signing.trusted, signing.reason_code) == (False, "ek_cert_profile")
    assert "neither keyAgreement nor keyEncipherment" in signing.reason


def test_ignored_critical_extension(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    ek = make_ek(root, keys("rsa-ek"), extra=(x509.InhibitAnyPolicy(0), True))
    assert verify(ek, [root], ignore_critical_extensions=("2.5.29.54",)).trusted


def test_tcg_profile_levels(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    ski = x509.SubjectKeyIdentifier.from_public_key(keys("rsa-ek").public_key())
    ek = make_ek(root, keys("rsa-ek"), san=False, extra=(ski, True))
    warned = verify(ek, [root])
    assert warned.trusted
    assert "subjectAltName (TPM manufacturer/model/version) is missing" in warned.warnings
    assert "subjectKeyIdentifier is critical" in warned.warnings
    enforced = verify(ek, [root], tcg_profile="enforce")
    assert enforced.reason_code == "ek_cert_profile" and "TCG EK profile" in enforced.reason
    assert verify(ek, [root], tcg_profile="ignore").warnings == ()
    assert verify(make_ek(root, keys("rsa-ek")), [root], tcg_profile="enforce").trusted


def test_sha1_signatures_are_refused_unless_allowed(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("rsa-root"))
    good = make_ek(root, keys("rsa-ek"))
    tbs = good.cert.tbs_certificate_bytes
    sha256_rsa = bytes.fromhex("06092a864886f70d01010b")
    sha1_rsa = bytes.fromhex("06092a864886f70d010105")
    sha1_tbs = tbs.replace(sha256_rsa, sha1_rsa)
    root_key = keys("rsa-root")
    assert isinstance(root_key, rsa.RSAPrivateKey)
    signature = root_key.sign(sha1_tbs, padding.PKCS1v15(), hashes.SHA1())  # noqa: S303 - the test input
    sigalg = tlv(0x30, sha1_rsa + b"\x05\x00")
    cert_der = tlv(0x30, sha1_tbs + sigalg + tlv(0x03, b"\x00" + signature))
    refused = verify((cert_der, spki(keys("rsa-ek"))), [root])
    assert refused.reason_code == "ek_signature_algorithm_unsupported" and "allow_sha1" in refused.reason
    assert verify((cert_der, spki(keys("rsa-ek"))), [root], allow_sha1=True).trusted


def test_rsa_oaep_typed_spki_matches_the_rsa_public_key_block(
    keys: Keys, verify: Callable[..., EkVerdict]
) -> None:
    """Some TPMs type their EK SPKI id-RSAES-OAEP; the PUBLIC KEY block is rsaEncryption. Same key."""
    root = make_ca("Root", keys("rsa-root"))
    good = make_ek(root, keys("rsa-ek"))
    tbs = good.cert.tbs_certificate_bytes
    assert tbs.count(RSA_ENCRYPTION) == 1
    cert_der = assemble(tbs.replace(RSA_ENCRYPTION, RSAES_OAEP), good.der, keys("rsa-root"))
    with pytest.raises(UnsupportedAlgorithm):  # python-cryptography cannot give the key
        x509.load_der_x509_certificate(cert_der).public_key()
    verdict = verify((cert_der, spki(keys("rsa-ek"))), [root])
    assert verdict.trusted, verdict.reason
    assert "rsa_oaep_spki" in verdict.quirks
    other = verify((cert_der, spki(keys("rsa-other"))), [root])
    assert other.reason_code == "ek_cert_key_mismatch"


def test_negative_serial_is_a_profile_deviation(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    good = make_ek(root, keys("rsa-ek"), serial=0x7E11)
    cert_der = resign_with_tbs_edit(good, b"\x02\x02\x7e\x11", b"\x02\x02\xfe\x11", keys("p384-root"))
    warned = verify((cert_der, spki(keys("rsa-ek"))), [root])
    assert warned.trusted and "negative_serial" in warned.quirks
    assert "serial number is negative" in warned.warnings
    enforced = verify((cert_der, spki(keys("rsa-ek"))), [root], tcg_profile="enforce")
    assert enforced.reason_code == "ek_cert_profile"
    strict = verify((cert_der, spki(keys("rsa-ek"))), [root], lenient_parsing=False)
    assert strict.reason_code == "ek_cert_unparsable" and "lenient" in strict.reason


def test_garbage_certificate(keys: Keys, verify: Callable[..., EkVerdict]) -> None:
    root = make_ca("Root", keys("p384-root"))
    verdict = verify((b"\x30\x03\x02\x01\x01", spki(keys("rsa-ek"))), [root])
    assert (verdict.trusted, verdict.reason_code) == (False, "ek_cert_unparsable")
    assert "cannot be parsed" in verdict.reason
