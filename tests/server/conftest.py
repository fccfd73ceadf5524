"""Fixtures for the server tests: real TPM data (read in place from shared/tpm-data) and a test PKI."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from server.ek_trust import EkTrust, EkTrustConfig
from tests.server.ekpki import NOW, PrivateKey

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.DOTALL)


def read_cert_der(path: Path) -> bytes:
    """The certificate bytes of a PEM or DER file, exactly as stored (trailing bytes kept)."""
    data = path.read_bytes()
    match = _PEM_CERT.search(data)
    return base64.b64decode(b"".join(match.group(1).split())) if match else data


@dataclass(frozen=True)
class RealEk:
    """One row of the EK table in SOURCES.md."""

    file: str
    chain: tuple[str, ...]  # manufacturer-ca file names, issuer first, root last

    def __str__(self) -> str:
        return self.file


def _table_rows(sources: str, prefix: str, columns: int) -> list[list[str]]:
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in sources.splitlines()
        if line.startswith(f"| {prefix}")
    ]
    return [row for row in rows if len(row) >= columns]


def real_eks(data_dir: Path) -> list[RealEk]:
    rows = _table_rows((data_dir / "SOURCES.md").read_text(), "ek-certs/", 13)
    out = []
    for row in rows:
        chain = tuple(name.strip() for name in row[11].split("->"))
        out.append(RealEk(row[0].removeprefix("ek-certs/"), chain))
    return out


def ca_relations(data_dir: Path) -> list[tuple[str, str]]:
    """(manufacturer-ca file, its 'chain check' text) for every CA row of SOURCES.md."""
    rows = _table_rows((data_dir / "SOURCES.md").read_text(), "manufacturer-ca/", 17)
    return [(row[0].removeprefix("manufacturer-ca/"), row[9]) for row in rows]


@pytest.fixture(scope="session")
def tpm_data(tpm_data_dir: str) -> Path:
    return Path(tpm_data_dir)


@pytest.fixture(scope="session")
def manufacturer_ca(tpm_data: Path) -> Path:
    return tpm_data / "manufacturer-ca"


@pytest.fixture(scope="session")
def real_trust(manufacturer_ca: Path) -> EkTrust:
    """Mode ca over the whole real CA collection, clock fixed at NOW."""
    return EkTrust.load(EkTrustConfig(ca_dir=manufacturer_ca), clock=lambda: NOW)


@pytest.fixture
def link_dir(tmp_path: Path) -> Callable[..., Path]:
    """A fresh directory holding symlinks to the given files (the data stays where it is)."""
    counter = iter(range(1000))

    def make(files: list[Path], name: str = "") -> Path:
        directory = tmp_path / (name or f"dir{next(counter)}")
        directory.mkdir()
        for file in files:
            (directory / file.name).symlink_to(file)
        return directory

    return make


@pytest.fixture(scope="session")
def keys() -> Iterator[Callable[[str], PrivateKey]]:
    """Keys by label, made once per session: 'rsa*' RSA-2048, 'p384*' P-384, 'p521*' P-521, else P-256."""
    made: dict[str, PrivateKey] = {}

    def get(label: str) -> PrivateKey:
        if label not in made:
            if label.startswith("rsa"):
                made[label] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            elif label.startswith("p384"):
                made[label] = ec.generate_private_key(ec.SECP384R1())
            elif label.startswith("p521"):
                made[label] = ec.generate_private_key(ec.SECP521R1())
            else:
                made[label] = ec.generate_private_key(ec.SECP256R1())
        return made[label]

    yield get
