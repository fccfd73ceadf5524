"""EK trust modes, configuration, directory reloads and the verification cache (generated test PKI)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from protocol.tpm_payload import EkData, pub_hash
from server.ek_trust import EkTrust, EkTrustConfig, EkVerdict
from server.errors import ConfigError
from tests.server.ekpki import NOW, Issued, PrivateKey, make_ca, make_ek, spki

Keys = Callable[[str], PrivateKey]


@pytest.fixture
def pki(keys: Keys) -> tuple[Issued, Issued, Issued]:
    root = make_ca("Test EK Root CA", keys("p384-root"))
    intermediate = make_ca("Test EK Intermediate CA", keys("p256-int"), root, path_length=0)
    ek = make_ek(intermediate, keys("rsa-ek"))
    return root, intermediate, ek


@pytest.fixture
def ca_dir(tmp_path: Path, pki: tuple[Issued, Issued, Issued]) -> Path:
    directory = tmp_path / "ca"
    directory.mkdir()
    (directory / "root.pem").write_bytes(pki[0].pem)
    (directory / "intermediate.der").write_bytes(pki[1].der)
    return directory


@pytest.fixture
def hash_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "hashes"
    directory.mkdir()
    return directory


def with_cert(ek: Issued) -> EkData:
    return EkData(public_key_der=spki(ek.key), certificate_der=ek.der)


def without_cert(ek: Issued) -> EkData:
    return EkData(public_key_der=spki(ek.key))


def load(**kwargs: object) -> EkTrust:
    return EkTrust.load(EkTrustConfig(**kwargs), clock=lambda: NOW)  # type: ignore[arg-type]


def brief(verdict: EkVerdict) -> tuple[bool, str, str]:
    return verdict.trusted, verdict.method, verdict.reason_code


def test_hash_mode(pki: tuple[Issued, Issued, Issued], hash_dir: Path, keys: Keys) -> None:
    ek = pki[2]
    listed = pub_hash(spki(ek.key))
    (hash_dir / listed).write_text("node-17\n")
    trust = load(hash_dir=hash_dir)
    assert trust.mode == "hash" and trust.hash_count == 1
    assert brief(trust.verify(without_cert(ek))) == (True, "hash", "ok")
    # The certificate is not looked at in hash mode, not even a mismatching one (upstream behaviour).
    assert brief(trust.verify(EkData(spki(ek.key), b"junk"))) == (True, "hash", "ok")
    other = EkData(public_key_der=spki(keys("p256-other")))
    denied = trust.verify(other)
    assert brief(denied) == (False, "", "ek_hash_not_listed")
    assert str(hash_dir / other.pub_hash) in denied.reason


def test_ca_mode_needs_a_certificate(pki: tuple[Issued, Issued, Issued], ca_dir: Path) -> None:
    trust = load(ca_dir=ca_dir)
    assert trust.mode == "ca"
    assert brief(trust.verify(with_cert(pki[2]))) == (True, "ca", "ok")
    denied = trust.verify(without_cert(pki[2]))
    assert brief(denied) == (False, "", "ek_cert_missing")
    assert "hash_dir" in denied.reason


def test_ca_or_hash(pki: tuple[Issued, Issued, Issued], ca_dir: Path, hash_dir: Path, keys: Keys) -> None:
    ek = pki[2]
    trust = load(ca_dir=ca_dir, hash_dir=hash_dir, recheck_interval_s=0)
    assert trust.mode == "ca_or_hash"
    assert brief(trust.verify(with_cert(ek))) == (True, "ca", "ok")
    assert brief(trust.verify(without_cert(ek))) == (False, "", "ek_not_trusted")
    (hash_dir / pub_hash(spki(ek.key))).touch()
    assert brief(trust.verify(with_cert(ek))) == (True, "ca+hash", "ok")
    assert brief(trust.verify(without_cert(ek))) == (True, "hash", "ok")
    # A listed key whose certificate does not chain: the hash still suffices...
    stranger = make_ek(make_ca("Unknown CA", keys("p256-unknown")), ek.key)
    verdict = trust.verify(with_cert(stranger))
    assert brief(verdict) == (True, "hash", "ok") and "not found in ca_dir" in verdict.reason
    # ...but a certificate for another key is contradictory evidence: denied.
    assert (
        brief(trust.verify(EkData(spki(ek.key), make_ek(pki[1], keys("rsa-x")).der)))[2]
        == "ek_cert_key_mismatch"
    )
    # Neither: the reason says both what failed in the chain and which hash file would allow it.
    unlisted = make_ek(make_ca("Unknown CA", keys("p256-unknown")), keys("p256-ek2"))
    denied = trust.verify(with_cert(unlisted))
    assert brief(denied) == (False, "", "ek_issuer_unknown")
    assert "not found in ca_dir" in denied.reason and str(hash_dir) in denied.reason


def test_ca_and_hash_needs_both(pki: tuple[Issued, Issued, Issued], ca_dir: Path, hash_dir: Path) -> None:
    ek = pki[2]
    trust = load(ca_dir=ca_dir, hash_dir=hash_dir, mode="ca_and_hash", recheck_interval_s=0)
    denied = trust.verify(with_cert(ek))
    assert brief(denied) == (False, "", "ek_hash_not_listed") and "needs both" in denied.reason
    (hash_dir / pub_hash(spki(ek.key))).touch()
    assert brief(trust.verify(with_cert(ek))) == (True, "ca+hash", "ok")
    assert brief(trust.verify(without_cert(ek))) == (False, "", "ek_cert_missing")
    expired = trust.verify(with_cert(ek), now=NOW.replace(year=2036))
    assert brief(expired) == (False, "", "ek_cert_expired")


def test_hash_dir_that_is_a_file_is_refused(tmp_path: Path, ca_dir: Path) -> None:
    """spire-tpm-plugin PR #23: a file as hash_path made every hash 'exist' (fail-open)."""
    file = tmp_path / "hashes.txt"
    file.write_text("0" * 64 + "\n")
    with pytest.raises(ConfigError, match="is not a directory"):
        load(hash_dir=file)
    with pytest.raises(ConfigError, match="is not a directory"):
        load(ca_dir=ca_dir, hash_dir=file)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "set ca_dir, hash_dir or both"),
        ({"ca_dir": "missing"}, "does not exist"),
        ({"hash_dir": "missing"}, "does not exist"),
        ({"ca_dir": "ca", "mode": "either"}, "is not one of"),
        ({"ca_dir": "ca", "mode": "hash"}, "needs hash_dir"),
        ({"hash_dir": "hashes", "mode": "ca_or_hash"}, "needs ca_dir"),
        ({"ca_dir": "ca", "hash_dir": "hashes", "mode": "ca"}, "mode ca ignores it"),
        ({"ca_dir": "ca", "hash_dir": "hashes", "mode": "hash"}, "mode hash ignores it"),
        ({"ca_dir": "ca", "tcg_profile": "strict"}, "tcg_profile"),
        ({"ca_dir": "ca", "max_chain_depth": 0}, "max_chain_depth"),
        ({"ca_dir": "ca", "cache_size": -1}, "cache_size"),
        ({"ca_dir": "ca", "ignore_critical_extensions": ("not-an-oid",)}, "not OIDs"),
    ],
)
def test_bad_configuration(kwargs: dict[str, object], message: str, ca_dir: Path, hash_dir: Path) -> None:
    paths = {"ca": ca_dir, "hashes": hash_dir, "missing": ca_dir.parent / "missing"}
    for key in ("ca_dir", "hash_dir"):
        if key in kwargs:
            kwargs[key] = paths[str(kwargs[key])]
    with pytest.raises(ConfigError, match=message):
        load(**kwargs)


def test_config_from_yaml_mapping(tmp_path: Path, ca_dir: Path, hash_dir: Path) -> None:
    doc = {"ca_dir": "ca", "hash_dir": str(hash_dir), "mode": "ca_or_hash", "tcg_profile": "enforce"}
    config = EkTrustConfig.from_mapping(doc, base_dir=tmp_path)
    assert (config.ca_dir, config.hash_dir, config.resolved_mode()) == (ca_dir, hash_dir, "ca_or_hash")
    assert EkTrust.load(config).mode == "ca_or_hash"
    with pytest.raises(ConfigError, match="unknown keys ca_path"):
        EkTrustConfig.from_mapping({"ca_path": "x"})
    with pytest.raises(ConfigError, match="allow_sha1 must be true or false"):
        EkTrustConfig.from_mapping({"ca_dir": "x", "allow_sha1": "yes"})
    with pytest.raises(ConfigError, match="must be a path"):
        EkTrustConfig.from_mapping({"ca_dir": 3})


def test_hash_allowlist_follows_the_directory(
    pki: tuple[Issued, Issued, Issued], hash_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ek = without_cert(pki[2])
    with caplog.at_level(logging.WARNING, logger="server.ek"):
        (hash_dir / ek.pub_hash.upper()).touch()  # not lowercase: ignored, with a warning
        (hash_dir / "README").touch()
        (hash_dir / ".keep").touch()  # dotfiles are silent (Kubernetes volumes have ..data)
        os.mkdir(hash_dir / ("a" * 64))  # a directory is not a listing
        trust = load(hash_dir=hash_dir, recheck_interval_s=3600)
    assert trust.hash_count == 0
    assert "README" in caplog.text and ek.pub_hash.upper() in caplog.text and ".keep" not in caplog.text
    assert not trust.verify(ek).trusted
    # A new file counts at once, even before the directory is re-read.
    (hash_dir / ek.pub_hash).touch()
    assert trust.verify(ek).trusted
    # A removed one counts after the next re-read (here: an explicit reload, as on SIGHUP).
    (hash_dir / ek.pub_hash).unlink()
    trust.reload()
    assert not trust.verify(ek).trusted


def test_hash_dir_removed_at_run_time_fails_closed(
    pki: tuple[Issued, Issued, Issued], hash_dir: Path
) -> None:
    ek = without_cert(pki[2])
    (hash_dir / ek.pub_hash).touch()
    trust = load(hash_dir=hash_dir, recheck_interval_s=0)
    assert trust.verify(ek).trusted
    (hash_dir / ek.pub_hash).unlink()
    hash_dir.rmdir()
    hash_dir.write_text(ek.pub_hash)  # now a file
    assert not trust.verify(ek).trusted


def test_ca_directory_reloads_when_it_changes(
    pki: tuple[Issued, Issued, Issued], tmp_path: Path, ca_dir: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    trust = load(ca_dir=empty, recheck_interval_s=0)
    first = trust.generation
    assert trust.verify(with_cert(pki[2])).reason_code == "ek_issuer_unknown"
    for file in ca_dir.iterdir():  # publish by rename, as operators and ConfigMaps do
        staged = empty / f".{file.name}.tmp"
        staged.write_bytes(file.read_bytes())
        staged.rename(empty / file.name)
    assert trust.verify(with_cert(pki[2])).trusted
    assert trust.generation == first + 1 and trust.ca_certificate_count == 2
    (empty / "intermediate.der").unlink()
    assert trust.verify(with_cert(pki[2])).reason_code == "ek_issuer_unknown"


def test_ca_directory_not_reread_per_attestation(pki: tuple[Issued, Issued, Issued], ca_dir: Path) -> None:
    trust = load(ca_dir=ca_dir)  # default: look for changes at most once a second
    generation = trust.generation
    ek = with_cert(pki[2])
    for _ in range(50):
        assert trust.verify(ek).trusted
    assert trust.generation == generation
    assert (trust.cache_misses, trust.cache_hits) == (1, 49)
    trust.reload()
    assert trust.generation == generation + 1
    assert trust.verify(ek).trusted and trust.cache_misses == 2


def test_cache_does_not_mix_keys_or_times(
    pki: tuple[Issued, Issued, Issued], ca_dir: Path, keys: Keys
) -> None:
    trust = load(ca_dir=ca_dir)
    ek = pki[2]
    assert trust.verify(with_cert(ek)).trusted
    # Same certificate (cached), other PUBLIC KEY block: still refused.
    mismatch = trust.verify(EkData(spki(keys("rsa-other")), ek.der))
    assert mismatch.reason_code == "ek_cert_key_mismatch"
    # Same certificate (cached), later time: expiry is evaluated per call.
    assert trust.verify(with_cert(ek), now=NOW.replace(year=2036)).reason_code == "ek_cert_expired"
    assert trust.verify(with_cert(ek)).trusted
    uncached = load(ca_dir=ca_dir, cache_size=0)
    assert uncached.verify(with_cert(ek)).trusted and uncached.cache_hits == 0


def test_naive_datetimes_are_utc(pki: tuple[Issued, Issued, Issued], ca_dir: Path) -> None:
    trust = load(ca_dir=ca_dir)
    assert trust.verify(with_cert(pki[2]), now=NOW.replace(tzinfo=None)).trusted


def test_empty_ca_directory_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level(logging.WARNING, logger="server.ek"):
        trust = load(ca_dir=empty)
    assert "holds no usable certificate" in caplog.text
    assert trust.ca_certificate_count == 0


def test_concurrent_verify_during_reloads(
    pki: tuple[Issued, Issued, Issued], ca_dir: Path, keys: Keys
) -> None:
    """Threads verifying while the CA directory is reloaded always get a correct, complete verdict."""
    trust = load(ca_dir=ca_dir, cache_size=2)
    good = with_cert(pki[2])
    stranger = with_cert(make_ek(make_ca("Unknown CA", keys("p256-unknown")), keys("p256-ek3")))
    results: list[tuple[bool, bool]] = []

    def worker() -> None:
        for _ in range(60):
            results.append((trust.verify(good).trusted, trust.verify(stranger).trusted))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(5):
        trust.reload()
    for thread in threads:
        thread.join()
    assert len(results) == 240 and set(results) == {(True, False)}
    assert trust.generation >= 6
