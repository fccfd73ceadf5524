"""The boot test's credential search (imagebuilder.imagescan, boottest.credentials_check) on real images made here.

An image that carries one of the build's credentials (plain, in any case, or base64-encoded in any
alignment) fails ``image/build-credentials`` naming the file; the secret itself is never printed.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

from imagebuilder import boottest, imagescan, reproducible
from imagebuilder.autoinstall import webhook_url
from tests.imagebuilder import sealkit
from tests.imagebuilder.sealkit import Member, d

pytestmark = pytest.mark.subprocess
TOKEN = "9a8b7c6d5e4f30211203f4e5d6c7b8a9"
IDENT = reproducible.identity("6a" * 32, "2026-11-01T00:00:00Z")


def _image(tmp: Path, extra: list[Member]) -> Path:
    if shutil.which("qemu-img") is None:
        pytest.fail("qemu-img is missing (apt-get install qemu-utils)")
    members = [
        *sealkit.root_members(0.0),
        d("root/var"),
        d("root/var/log"),
        *extra,
        *sealkit.esp_members(0.0),
    ]
    return sealkit.qcow2_disk(members, IDENT, tmp)


def test_a_clean_image_passes(tmp_path: Path) -> None:
    check = boottest.credentials_check(
        _image(tmp_path, []), tmp_path / "scan", {"this build's webhook token": TOKEN.encode()}
    )
    assert check.ok and check.name == "image/build-credentials"
    assert "this build's webhook token" in check.detail and TOKEN not in check.detail
    assert not list((tmp_path / "scan").iterdir())  # the raw copy is gone


def test_the_installers_copy_of_the_user_data_fails_the_check(tmp_path: Path) -> None:
    """What an image built before the seal carried: /var/log/installer/autoinstall-user-data with the webhook."""
    leaked = Member("root/var/log/installer/autoinstall-user-data",
                    data=f"reporting:\n  builder: {{endpoint: {webhook_url(TOKEN)}}}\n".encode())  # fmt: skip
    image = _image(tmp_path, [d("root/var/log/installer"), leaked])
    check = boottest.credentials_check(
        image, tmp_path / "scan", {"this build's webhook token": TOKEN.encode()}
    )
    assert not check.ok
    assert "this build's webhook token in /var/log/installer/autoinstall-user-data" in check.detail
    assert (
        "the builder's webhook address (with a build's token) in /var/log/installer/autoinstall-user-data"
        in check.detail
    )
    assert TOKEN not in check.detail


@pytest.mark.parametrize("shift", [0, 1, 2])
def test_a_credential_in_base64_or_another_case_is_found(tmp_path: Path, shift: int) -> None:
    encoded = base64.b64encode(b"xyz"[:shift] + f"token={TOKEN}".encode()).decode()
    upper = TOKEN.upper()
    image = _image(
        tmp_path,
        [
            Member("root/var/log/b64", data=encoded.encode()),
            Member("root/var/log/upper", data=upper.encode()),
        ],
    )
    found = imagescan.scan_image(image, tmp_path / "scan", {"t": TOKEN.encode()})
    assert found == {"t": ["/var/log/b64", "/var/log/upper"]}


def test_the_esp_is_searched_too(tmp_path: Path) -> None:
    members = [*sealkit.root_members(0.0), *sealkit.esp_members(0.0)[:-1],
               Member("esp/EFI/debian/grub.cfg", data=f"set x={TOKEN}\n".encode())]  # fmt: skip
    qcow2 = sealkit.qcow2_disk(members, IDENT, tmp_path)
    assert imagescan.scan_image(qcow2, tmp_path / "scan", {"t": TOKEN.encode()}) == {
        "t": ["the EFI system partition"]
    }


def test_the_encodings_do_not_depend_on_the_bytes_around_the_secret() -> None:
    secret = TOKEN.encode()
    needles = [n for n, nocase in imagescan.encodings(secret) if not nocase]
    assert len(needles) == 3
    for prefix in (b"", b"a", b"ab", b"abc", b"abcd", b"abcde"):
        encoded = base64.b64encode(prefix + secret + b"zz")
        assert any(n in encoded for n in needles), prefix
