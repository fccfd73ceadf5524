"""OpenPGP checks with ``gpgv``, and upstream checksum files.

* :func:`verify_detached` checks a detached signature (``SHA256SUMS.gpg``, ``*.asc``);
* :func:`verify_clearsigned` checks an apt ``InRelease`` and returns the signed text;
* :func:`checksum_for` finds a file's SHA-256 in a ``sha256sum``-style or BSD-style list.

Keyrings may be binary (``/usr/share/keyrings/*.gpg``) or armored (``Release.key``);
armored ones are dearmored into a private temporary directory first. gpgv only ever
sees the one keyring given: no user keyring, no trust database.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from imagebuilder.errors import CommandError, VerificationError
from imagebuilder.run import run

_SUMS_GNU = re.compile(r"([0-9a-fA-F]{64})\s+\*?(.+?)\s*")  # fullmatch: never "before a final newline"
_SUMS_BSD = re.compile(r"SHA256 \((.+)\) = ([0-9a-fA-F]{64})\s*")


def _binary_keyring(keyring: Path, workdir: Path) -> Path:
    try:
        data = keyring.read_bytes()
    except OSError as exc:
        raise VerificationError(
            f"cannot read the keyring {keyring}: {exc.strerror}",
            hint="the definition names a keyring file that must exist on the build host",
        ) from exc
    if b"-----BEGIN PGP PUBLIC KEY BLOCK-----" not in data:
        return keyring
    out = workdir / "keyring.gpg"
    run(["gpg", "--homedir", str(workdir), "--batch", "--dearmor", "--output", str(out)], input_bytes=data)
    return out


def _gpgv(args: list[str], keyring: Path, what: str, workdir: Path) -> None:
    binary = _binary_keyring(keyring, workdir)
    try:
        result = run(
            ["gpgv", "--homedir", str(workdir), "--status-fd", "1", "--keyring", str(binary), *args],
            check=False,
        )
    except CommandError as exc:
        raise VerificationError(f"{what}: cannot run gpgv: {exc.message}") from exc
    status = result.stdout.decode("utf-8", errors="replace")
    if result.returncode != 0 or "[GNUPG:] VALIDSIG" not in status:
        detail = result.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise VerificationError(
            f"{what}: the OpenPGP signature does not verify against {keyring}"
            + (f" ({detail[-1]})" if detail else ""),
            hint="the file or its signature was altered, or the keyring is not the signer's",
        )


def verify_detached(data: bytes, signature: bytes, keyring: Path, *, what: str) -> None:
    with tempfile.TemporaryDirectory(prefix="imagebuilder-gpg-") as tmp:
        work = Path(tmp)
        (work / "data").write_bytes(data)
        (work / "data.sig").write_bytes(signature)
        _gpgv([str(work / "data.sig"), str(work / "data")], keyring, what, work)


def verify_clearsigned(data: bytes, keyring: Path, *, what: str) -> bytes:
    """The text a clearsigned document (InRelease) signs, after gpgv checked the signature."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-gpg-") as tmp:
        work = Path(tmp)
        (work / "InRelease").write_bytes(data)
        _gpgv(["--output", str(work / "signed"), str(work / "InRelease")], keyring, what, work)
        return (work / "signed").read_bytes()


def parse_checksums(text: str) -> dict[str, str]:
    """File name -> lower-case sha256, from ``<hex>  <name>`` / ``<hex> *<name>`` or BSD lines."""
    sums: dict[str, str] = {}
    for line in text.splitlines():
        gnu = _SUMS_GNU.fullmatch(line)
        if gnu:
            sums[gnu.group(2).lstrip("./")] = gnu.group(1).lower()
            continue
        bsd = _SUMS_BSD.fullmatch(line)
        if bsd:
            sums[bsd.group(1).lstrip("./")] = bsd.group(2).lower()
    return sums


def checksum_for(text: str, filename: str, *, what: str) -> str:
    """``filename``'s digest in a checksum list; a file holding one bare digest (dl.k8s.io's ``.sha256``)
    is that file's."""
    bare = text.strip()
    if re.fullmatch(r"[0-9a-fA-F]{64}", bare):
        return bare.lower()
    sums = parse_checksums(text)
    if filename in sums:
        return sums[filename]
    by_base = {Path(name).name: digest for name, digest in sums.items()}
    if filename in by_base:
        return by_base[filename]
    raise VerificationError(
        f"{what}: the checksum file lists no entry for {filename} ({len(sums)} entries)",
        hint="check the artifact URL and the checksums URL of the definition",
    )
