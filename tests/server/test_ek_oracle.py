"""python-cryptography's X.509 verifier as a second opinion on our lenient EK path building.

Over every certificate in shared/tpm-data (each real EK, the Nuvoton EK of vectors.json, and every
manufacturer CA as a leaf of its own), both implementations decide at the fixed time ``NOW`` whether
the certificate chains to a self-signed root of the collection. Wherever python-cryptography can
parse every certificate of the path, the verdicts must agree, and so must the keys along the chain.
The disagreements that remain are listed below with their cause; each cause is recognised from our
parser's structured data (its quirks and the exact name bytes), never from an error message.

python-cryptography is configured as close to our rules as its API allows: the understood
extensions may be present with any criticality (an unknown critical extension fails both), CA
certificates need basicConstraints, no EKU or SAN is required of the leaf (EK certificates have
neither DNS names nor the WebPKI's usages). Its signature-algorithm rules (no SHA-1, RSA of at least
2048 bits) match our defaults (``allow_sha1: false``).
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import (
    ClientVerifier,
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from protocol import der
from protocol.tpm_payload import decode_ek
from server.ek.certificate import Certificate, parse_certificate
from server.ek.store import CaStore, ChainPolicy, Path_, select_path
from tests.server.conftest import read_cert_der
from tests.server.ekpki import NOW

POLICY = ChainPolicy(intermediates_as_anchors=False, max_chain_depth=8)

# What python-cryptography refuses to parse, and the quirk our lenient parser records for it.
NUVOTON_ROOTS = (
    "nuvoton-ntc-tpm-ek-root-ca-01.pem",
    "nuvoton-ntc-tpm-ek-root-ca-02.pem",
    "nuvoton-ntc-tpm-ek-root-ca-arsuf-01.pem",
    *(
        f"nuvoton-tpm-root-ca-{n}.pem"
        for n in ("0100", "1013", "1014", "1110", "1111", "2010", "2011", "2012", "2110", "2111", "2112")
    ),
)
REFUSED_BY_CRYPTOGRAPHY: dict[str, tuple[str, str]] = {
    # name: (python-cryptography's ParseError kind, our quirk)
    "ek-certs/stmicro-st33htph-rsa-ek-trailing-ff.der": ("ExtraData", "trailing_data"),  # NV padding
    "manufacturer-ca/amd-prg-phx-ecc.der": ("ExtraData", "trailing_data"),  # one stray byte
    "manufacturer-ca/amd-prg-phx-rsa.der": ("ExtraData", "trailing_data"),
    "manufacturer-ca/intel-ondie-ca-csme-intermediate-ca.der": ("ExtraData", "ecdsa_sigalg_null_params"),
    "manufacturer-ca/intel-ondie-ca-root-cert-signing.pem": ("ExtraData", "ecdsa_sigalg_null_params"),
    # a multi-valued RDN not in DER SET order: every Nuvoton root, and the EKs they issue
    **{f"manufacturer-ca/{name}": ("InvalidSetOrdering", "unsorted_rdn_set") for name in NUVOTON_ROOTS},
    "vectors.json#nuvoton-npct75x-ek": ("InvalidSetOrdering", "unsorted_rdn_set"),
}

# Why python-cryptography's verifier refuses paths that we (and OpenSSL, per SOURCES.md) accept.
CAUSE_UNPARSABLE = "a certificate on the path is one python-cryptography cannot parse (listed above)"
CAUSE_GENERALIZED_TIME = (
    "a validity date before 2050 is a GeneralizedTime (RFC 5280 wants UTCTime; our quirk non_der_time): "
    "AMD's AMDTPM roots"
)
CAUSE_NAME_STRING_TYPE = (
    "the issuer name is encoded with another string type than the CA's subject (UTF8String against "
    "PrintableString); RFC 5280 7.1 and OpenSSL match such names, python-cryptography compares bytes: "
    "STM's later ECC intermediates"
)
EXPECTED_DISAGREEMENTS = {
    CAUSE_UNPARSABLE: 13,  # the Intel On-Die CA family under the root it cannot parse
    CAUSE_GENERALIZED_TIME: 13,
    CAUSE_NAME_STRING_TYPE: 4,
}


@dataclass(frozen=True)
class Sample:
    name: str
    raw: bytes

    def __str__(self) -> str:
        return self.name


def _samples(data: Path) -> Iterator[Sample]:
    for folder in ("ek-certs", "manufacturer-ca"):
        for path in sorted((data / folder).iterdir()):
            if path.suffix in (".pem", ".der"):
                yield Sample(f"{folder}/{path.name}", read_cert_der(path))
    vectors = json.loads((data / "vectors.json").read_text())
    ek = decode_ek(vectors["ek_public_key_sha256_spki"][0]["input_pem"].encode())
    assert ek.certificate_der is not None
    yield Sample("vectors.json#nuvoton-npct75x-ek", ek.certificate_der)


def _load(raw: bytes) -> x509.Certificate | ValueError:
    try:
        return x509.load_der_x509_certificate(raw)
    except ValueError as exc:
        return exc


def _understood(policy: ExtensionPolicy) -> ExtensionPolicy:
    """The extensions server/ek/store.py understands, allowed with any criticality."""
    for kind in (
        x509.KeyUsage,
        x509.SubjectKeyIdentifier,
        x509.AuthorityKeyIdentifier,
        x509.ExtendedKeyUsage,
        x509.SubjectAlternativeName,
        x509.CertificatePolicies,
        x509.AuthorityInformationAccess,
        x509.CRLDistributionPoints,
    ):
        policy = policy.may_be_present(kind, Criticality.AGNOSTIC, None)
    return policy


def _verifier(roots: list[x509.Certificate]) -> ClientVerifier:
    ca = _understood(
        ExtensionPolicy.permit_all().require_present(x509.BasicConstraints, Criticality.AGNOSTIC, None)
    )
    ee = _understood(
        ExtensionPolicy.permit_all().may_be_present(x509.BasicConstraints, Criticality.AGNOSTIC, None)
    )
    return (
        PolicyBuilder()
        .store(Store(roots))
        .time(NOW.replace(tzinfo=None))
        .max_chain_depth(POLICY.max_chain_depth)
        .extension_policies(ca_policy=ca, ee_policy=ee)
        .build_client_verifier()
    )


def _spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class Collection:
    """Both parsers' view of the whole collection, built once."""

    def __init__(self, data: Path) -> None:
        self.samples = list(_samples(data))
        self.ours = {s.name: parse_certificate(s.raw) for s in self.samples}
        self.theirs = {s.name: _load(s.raw) for s in self.samples}
        self.store = CaStore.load(data / "manufacturer-ca", generation=1, lenient=True)
        parsed = {n: c for n, c in self.theirs.items() if isinstance(c, x509.Certificate)}
        cas = {n: c for n, c in parsed.items() if n.startswith("manufacturer-ca/")}
        self.roots = [c for c in cas.values() if c.subject == c.issuer]
        self.intermediates = [c for c in cas.values() if c.subject != c.issuer]
        self.unparsable = {self.ours[n].sha256 for n, c in self.theirs.items() if isinstance(c, ValueError)}
        self.verifier = _verifier(self.roots)

    def our_paths(self, cert: Certificate) -> list[Path_]:
        """Every path of ours to a self-signed root that is valid at NOW (a root alone for a root)."""
        if cert.self_issued:
            return [(cert,)] if self.store.is_root(cert) and select_path(((cert,),), NOW)[0] else []
        candidates = self.store.build_paths(cert, POLICY).paths
        return [path for path in candidates if select_path((path,), NOW)[0] is not None]

    def cause(self, path: Path_) -> str | None:
        """Why python-cryptography cannot accept this path of ours, from our structured data; or None."""
        if any(cert.sha256 in self.unparsable for cert in path):
            return CAUSE_UNPARSABLE
        if any(der.Q_TIME_FORMAT in cert.quirks for cert in path):
            return CAUSE_GENERALIZED_TIME
        if any(child.issuer.der != issuer.subject.der for child, issuer in itertools.pairwise(path)):
            return CAUSE_NAME_STRING_TYPE
        return None


@pytest.fixture(scope="module")
def collection(tpm_data: Path) -> Iterator[Collection]:
    with warnings.catch_warnings():  # Google's CAs have CNs longer than 64 characters
        warnings.simplefilter("ignore", UserWarning)
        yield Collection(tpm_data)


def test_what_python_cryptography_refuses_to_parse_is_listed_with_our_quirk(collection: Collection) -> None:
    refused = {n: str(c) for n, c in collection.theirs.items() if isinstance(c, ValueError)}
    assert refused, "python-cryptography parses the whole collection now: update REFUSED_BY_CRYPTOGRAPHY"
    for name, error in refused.items():
        assert name in REFUSED_BY_CRYPTOGRAPHY, (
            f"{name}: refused by python-cryptography ({error}), not listed"
        )
        kind, quirk = REFUSED_BY_CRYPTOGRAPHY[name]
        assert kind in error, (name, error)
        assert quirk in collection.ours[name].quirks, name
    # The other direction: a certificate our parser reads without any quirk is strict DER to them too.
    for name, cert in collection.ours.items():
        if not cert.quirks:
            assert isinstance(collection.theirs[name], x509.Certificate), name


def test_the_tbs_and_the_key_we_read_are_the_ones_python_cryptography_reads(collection: Collection) -> None:
    for name, theirs in collection.theirs.items():
        if isinstance(theirs, x509.Certificate):
            ours = collection.ours[name]
            assert ours.tbs == theirs.tbs_certificate_bytes, name
            assert ours.public_key.der == _spki(theirs), name
            assert ours.serial == theirs.serial_number, name


def test_python_cryptography_agrees_with_our_chain_verdicts(collection: Collection) -> None:
    agreed = {True: 0, False: 0}
    disagreements: dict[str, list[str]] = {}
    for sample in collection.samples:
        theirs = collection.theirs[sample.name]
        if not isinstance(theirs, x509.Certificate):
            continue  # listed in REFUSED_BY_CRYPTOGRAPHY; our lenient path is the only one there
        paths = collection.our_paths(collection.ours[sample.name])
        try:
            verified = collection.verifier.verify(theirs, collection.intermediates)
        except VerificationError:
            verified = None
        if bool(paths) == (verified is not None):
            agreed[verified is not None] += 1
            if verified is not None:  # the same keys sign the chain (two AMD roots share a key)
                their_keys = [_spki(cert) for cert in verified.chain]
                assert their_keys in [[cert.public_key.der for cert in path] for path in paths], sample
            continue
        assert paths, f"{sample}: python-cryptography verifies a chain that we do not find"
        causes = {collection.cause(path) for path in paths}
        assert None not in causes, f"{sample}: we trust it, python-cryptography does not, for no known cause"
        disagreements.setdefault(sorted(c for c in causes if c)[0], []).append(sample.name)
    assert {cause: len(names) for cause, names in disagreements.items()} == EXPECTED_DISAGREEMENTS
    assert agreed[True] >= 240 and agreed[False] >= 50  # most of the collection is a real comparison
    ek_leaves = [s.name for s in collection.samples if s.name.startswith("ek-certs/")]
    assert not any(name in ek_leaves for names in disagreements.values() for name in names)
