"""imagebuilder.pehash: the Authenticode digest UEFI measures, against Debian's own signature and two kept tools.

Oracles: the SHA-256 digest inside the Authenticode signature Debian put on its kernel (which
osslsigncode prints as "Current message digest"), osslsigncode's and pesign's own computation,
and the property that (re-)signing an image never changes its digest.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from imagebuilder.pehash import PeError, authenticode, layout
from tests.fixture_installer.conftest import BootFiles

pytestmark = pytest.mark.subprocess
TOOLS = {"osslsigncode": "osslsigncode", "pesign": "pesign"}


def _require() -> None:
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        pytest.fail(f"apt-get install {' '.join(missing)} (scripts/ensure-deps.sh installs them)")


def _osslsigncode_digests(path: Path) -> dict[str, str]:
    out = subprocess.run(["osslsigncode", "verify", "-in", str(path)], capture_output=True, text=True, timeout=60,
                         check=False).stdout  # fmt: skip
    found = dict(re.findall(r"(Current|Calculated) message digest\s*:\s*([0-9A-F]{64})", out))
    return {k: v.lower() for k, v in found.items()}


def _pesign_digest(path: Path) -> str:
    out = subprocess.run(["pesign", "-i", str(path), "-h", "-d", "sha256"], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    match = re.search(r"hash:\s*([0-9a-f]{64})", out)
    assert match, out
    return match.group(1)


def _sign(src: Path, dest: Path, tmp: Path) -> None:
    """Authenticode-sign ``src`` with a throw-away code-signing certificate (osslsigncode)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nodetrust test signer")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "k.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    subprocess.run(["osslsigncode", "sign", "-certs", str(tmp / "c.pem"), "-key", str(tmp / "k.pem"), "-h", "sha256",
                    "-in", str(src), "-out", str(dest)], capture_output=True, timeout=120, check=True)  # fmt: skip


def test_the_digest_of_debians_signed_kernel_is_the_one_its_signature_signs(boot_files: BootFiles) -> None:
    _require()
    data = boot_files.kernel.read_bytes()
    ours = authenticode(data).hex()
    tools = _osslsigncode_digests(boot_files.kernel)
    assert tools.get("Current") == ours, "the digest Debian's signature carries"
    assert tools.get("Calculated") == ours
    assert _pesign_digest(boot_files.kernel) == ours
    assert layout(data).cert_table[1] > 0, "casper/vmlinuz is Debian's signed kernel"


def test_signing_again_does_not_change_the_digest(boot_files: BootFiles, tmp_path: Path) -> None:
    _require()
    resigned = tmp_path / "vmlinuz.resigned"
    _sign(boot_files.kernel, resigned, tmp_path)
    assert resigned.read_bytes() != boot_files.kernel.read_bytes()
    assert authenticode(resigned.read_bytes()) == authenticode(boot_files.kernel.read_bytes())
    assert _osslsigncode_digests(resigned)["Current"] == authenticode(resigned.read_bytes()).hex()


def test_an_unsigned_image_and_its_trailing_data(boot_files: BootFiles, tmp_path: Path) -> None:
    """Without the certificate table, the bytes after the last section are hashed (PE/COFF step 4)."""
    _require()
    data = bytearray(boot_files.kernel.read_bytes())
    pe = layout(bytes(data))
    off, size = pe.cert_table
    del data[off : off + size]
    assert pe.cert_entry_offset is not None
    struct.pack_into("<II", data, pe.cert_entry_offset, 0, 0)  # no certificate table any more
    unsigned = tmp_path / "unsigned.efi"
    unsigned.write_bytes(bytes(data))
    assert authenticode(bytes(data)).hex() == _pesign_digest(unsigned)
    with_tail = tmp_path / "tail.efi"
    with_tail.write_bytes(bytes(data) + b"\x00" * 512 + b"trailing data")
    assert authenticode(with_tail.read_bytes()) != authenticode(bytes(data))
    assert authenticode(with_tail.read_bytes()).hex() == _pesign_digest(with_tail)


def test_what_is_not_a_pe_image_is_refused(boot_files: BootFiles) -> None:
    data = boot_files.kernel.read_bytes()
    pe = layout(data)
    bad = [
        b"",
        b"not an image",
        b"MZ" + b"\x00" * 0x3A + struct.pack("<I", 1 << 30),  # e_lfanew past the end
        data[: pe.size_of_headers],  # the sections are cut off
        data[: pe.cert_table[0] + 10],  # the certificate table is cut off
    ]
    for sample in bad:
        with pytest.raises(PeError) as refused:
            authenticode(sample)
        assert refused.value.message
