"""The Authenticode hash of a PE/COFF image: what UEFI firmware extends into PCR 4 for an EFI application.

EDK II (``MeasureBootPeCoff.c``, after the PE/COFF specification's Appendix A and Microsoft's
"Windows Authenticode Portable Executable Signature Format") hashes an image as follows, and
the builder does the same so that it can predict the ``EV_EFI_BOOT_SERVICES_APPLICATION`` digest
of every boot loader and kernel the image's boot path runs:

1. the headers from offset 0 up to the optional header's ``CheckSum``, skipping its 4 bytes;
2. on to the Certificate Table data-directory entry (index 4), skipping its 8 bytes, then the rest
   of the headers up to ``SizeOfHeaders`` (without the entry, when ``NumberOfRvaAndSizes`` <= 4);
3. every section with raw data, sorted by ``PointerToRawData``;
4. whatever follows the last section, except the certificate table at the end of the file.

Because the checksum, the directory entry and the table are excluded, signing an image does not
change its hash (the digest a signature embeds is this hash). The image is untrusted input: its
size is bounded before it is read and every offset is checked against the file; a malformed image
raises :class:`PeError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from imagebuilder.errors import OutputError

MAX_IMAGE_BYTES = 256 * 1024 * 1024
MAX_SECTIONS = 96  # the PE/COFF limit
PE32, PE32_PLUS = 0x10B, 0x20B


class PeError(OutputError):
    """A file that is not a PE/COFF image this module can hash."""


@dataclass(frozen=True)
class PeLayout:
    """The ranges Authenticode excludes, and the sections it hashes."""

    checksum_offset: int
    cert_entry_offset: int | None  # None: the image has no Certificate Table entry
    size_of_headers: int
    sections: tuple[tuple[int, int], ...]  # (PointerToRawData, SizeOfRawData), as hashed
    cert_table: tuple[int, int]  # (offset, size); (0, 0) when unsigned


def _u16(data: bytes, off: int, what: str) -> int:
    if off < 0 or off + 2 > len(data):
        raise PeError(f"the PE image is truncated at {what} (offset {off})")
    return int(struct.unpack_from("<H", data, off)[0])


def _u32(data: bytes, off: int, what: str) -> int:
    if off < 0 or off + 4 > len(data):
        raise PeError(f"the PE image is truncated at {what} (offset {off})")
    return int(struct.unpack_from("<I", data, off)[0])


def layout(data: bytes) -> PeLayout:
    """Where the excluded fields and the sections of ``data`` lie; :class:`PeError` if it is not a PE image."""
    if len(data) > MAX_IMAGE_BYTES:
        raise PeError(
            f"the image has {len(data)} bytes, more than the {MAX_IMAGE_BYTES} a boot file may have"
        )
    if data[:2] != b"MZ":
        raise PeError("not a PE image: no MZ header")
    pe = _u32(data, 0x3C, "e_lfanew")
    if data[pe : pe + 4] != b"PE\x00\x00":
        raise PeError("not a PE image: no PE signature where e_lfanew points")
    coff = pe + 4
    n_sections = _u16(data, coff + 2, "NumberOfSections")
    opt_size = _u16(data, coff + 16, "SizeOfOptionalHeader")
    opt = coff + 20
    magic = _u16(data, opt, "the optional header's Magic")
    if magic == PE32:
        rva_count_off, dirs = opt + 92, opt + 96
    elif magic == PE32_PLUS:
        rva_count_off, dirs = opt + 108, opt + 112
    else:
        raise PeError(f"optional header magic 0x{magic:04x} is neither PE32 nor PE32+")
    size_of_headers = _u32(data, opt + 60, "SizeOfHeaders")
    n_dirs = _u32(data, rva_count_off, "NumberOfRvaAndSizes")
    if n_sections > MAX_SECTIONS or size_of_headers > len(data):
        raise PeError(f"{n_sections} sections, {size_of_headers} bytes of headers: not a well-formed image")
    cert_entry = dirs + 4 * 8 if n_dirs > 4 else None
    cert_table = (0, 0)
    if cert_entry is not None:
        if cert_entry + 8 > opt + opt_size:
            raise PeError("the Certificate Table entry lies outside the optional header")
        offset, size = (
            _u32(data, cert_entry, "the certificate table"),
            _u32(data, cert_entry + 4, "its size"),
        )
        if size:
            if offset < size_of_headers or offset + size > len(data):
                raise PeError(f"the certificate table [{offset}, +{size}) lies outside the file")
            cert_table = (offset, size)
    sections = []
    table = opt + opt_size
    for i in range(n_sections):
        entry = table + 40 * i
        raw_size = _u32(data, entry + 16, f"section {i}'s SizeOfRawData")
        raw_ptr = _u32(data, entry + 20, f"section {i}'s PointerToRawData")
        if raw_size:
            if raw_ptr + raw_size > len(data):
                raise PeError(
                    f"section {i} [{raw_ptr}, +{raw_size}) lies outside the file of {len(data)} bytes"
                )
            sections.append((raw_ptr, raw_size))
    return PeLayout(opt + 64, cert_entry, size_of_headers, tuple(sorted(sections)), cert_table)


def authenticode(data: bytes, algorithm: str = "sha256") -> bytes:
    """The Authenticode digest of the PE image ``data`` (what the firmware measures, what a signature signs)."""
    pe = layout(data)
    h = hashlib.new(algorithm)
    h.update(data[: pe.checksum_offset])
    if pe.cert_entry_offset is None:
        h.update(data[pe.checksum_offset + 4 : pe.size_of_headers])
    else:
        h.update(data[pe.checksum_offset + 4 : pe.cert_entry_offset])
        h.update(data[pe.cert_entry_offset + 8 : pe.size_of_headers])
    hashed = pe.size_of_headers
    for ptr, size in pe.sections:
        h.update(data[ptr : ptr + size])
        hashed += size
    cert_size = pe.cert_table[1]
    if len(data) > hashed:
        end = len(data) - cert_size
        if end > hashed:
            h.update(data[hashed:end])
    return h.digest()
