"""The QCOW2 header check that runs before qemu-img ever opens an image (docs/interop/qcow2.txt).

The image is already verified against its signed digest when this runs: the check is defence in
depth against a compromised signing key or builder, and it is what stops the attacks qemu-img is
known for (CVE-2024-44082: a QCOW2 whose backing file or external data file names a host file or
device, which qemu-img then reads and copies onto the target). Refused:

* anything but the QCOW2 magic when the release declares QCOW2 (and a QCOW2, VMDK, VHDX, VDI, QED
  or LUKS magic when it declares raw);
* a version other than 2 or 3, a header length or cluster size out of range;
* a backing file (offset or size non-zero, or a backing-format extension);
* an external data file (incompatible feature bit 2, autoclear bit 1, or the data-file extension);
* encryption (``crypt_method`` non-zero, or the full-disk-encryption extension);
* a dirty or corrupt image (incompatible bits 0 and 1) and any incompatible feature this code
  does not know (bits 5 and up); compression type (bit 3) and extended L2 (bit 4) are allowed;
* a virtual size of zero or larger than the target disk.

qemu-img is then always run with ``-f qcow2`` (never a probe).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from imager.errors import ImagerError, Reason

MAGIC = b"QFI\xfb"
HEADER_V2 = 72
HEADER_V3_MIN = 104
MAX_EXTENSIONS = 64
EXT_END = 0
EXT_BACKING_FORMAT = 0xE2792ACA
EXT_FEATURE_NAMES = 0x6803F857
EXT_BITMAPS = 0x23852875
EXT_ENCRYPTION = 0x0537BE77
EXT_DATA_FILE = 0x44415441
INCOMPAT_DIRTY, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE = 1 << 0, 1 << 1, 1 << 2
INCOMPAT_KNOWN = (1 << 5) - 1
AUTOCLEAR_RAW_DATA = 1 << 1
#: How many bytes of an image :func:`check_header` needs at most (the largest cluster QEMU allows).
HEADER_READ = 2 << 20

# Other disk formats, by their first bytes: a "raw" image that starts with one of them is refused.
CONTAINER_MAGICS = {
    b"QFI\xfb": "QCOW2",
    b"KDMV": "VMDK",
    b"vhdxfile": "VHDX",
    b"QED\x00": "QED",
    b"LUKS\xba\xbe": "LUKS",
    b"<<< Oracle VM VirtualBox Disk Image >>>": "VDI",
    b"conectix": "VHD",
}


@dataclass(frozen=True)
class Qcow2Header:
    version: int
    cluster_bits: int
    virtual_size: int
    incompatible: int
    extensions: tuple[int, ...]


def _refuse(reason: Reason, name: str, what: str) -> ImagerError:
    return ImagerError(
        reason,
        f"{name}: {what}; the imager writes only self-contained, unencrypted QCOW2 images",
        hint="rebuild the image with imagebuilder (its QCOW2 is compacted and self-contained); "
        "a signed image that fails this check means the signing key or the builder is compromised",
    )


def check_header(head: bytes, *, name: str, disk_size: int) -> Qcow2Header:
    """Parse and check the first bytes of a QCOW2 (at least its first cluster, or the whole file)."""
    if len(head) < HEADER_V2 or head[:4] != MAGIC:
        raise _refuse(
            Reason.image_format, name, "declared QCOW2 but the file does not start with the QCOW2 magic"
        )
    version, backing_offset, backing_size, cluster_bits, size, crypt = struct.unpack_from(">IQIIQI", head, 4)
    if version not in (2, 3):
        raise _refuse(Reason.qcow2_features, name, f"QCOW2 version {version} (only 2 and 3 are known)")
    if backing_offset or backing_size:
        raise _refuse(Reason.qcow2_backing_file, name, "the QCOW2 names a backing file")
    if not 9 <= cluster_bits <= 21:
        raise _refuse(Reason.qcow2_features, name, f"cluster_bits {cluster_bits} is outside 9..21")
    if crypt:
        raise _refuse(Reason.qcow2_encrypted, name, f"the QCOW2 is encrypted (crypt_method {crypt})")
    cluster = 1 << cluster_bits
    incompatible = autoclear = 0
    header_length = HEADER_V2
    if version == 3:
        if len(head) < HEADER_V3_MIN:
            raise _refuse(Reason.qcow2_features, name, "the QCOW2 v3 header is cut short")
        incompatible, _compatible, autoclear = struct.unpack_from(">QQQ", head, 72)
        (header_length,) = struct.unpack_from(">I", head, 100)
        if header_length < HEADER_V3_MIN or header_length % 8 or header_length > min(cluster, len(head)):
            raise _refuse(Reason.qcow2_features, name, f"header_length {header_length} is invalid")
    if incompatible & INCOMPAT_DATA_FILE or autoclear & AUTOCLEAR_RAW_DATA:
        raise _refuse(Reason.qcow2_data_file, name, "the QCOW2 keeps its data in an external data file")
    if incompatible & (INCOMPAT_DIRTY | INCOMPAT_CORRUPT):
        state = "corrupt" if incompatible & INCOMPAT_CORRUPT else "dirty (not closed cleanly)"
        raise _refuse(Reason.qcow2_features, name, f"the QCOW2 is marked {state}")
    if incompatible & ~INCOMPAT_KNOWN:
        raise _refuse(
            Reason.qcow2_features, name, f"the QCOW2 uses unknown incompatible features {incompatible:#x}"
        )
    extensions = _extensions(head, header_length, min(cluster, len(head)), name)
    if EXT_BACKING_FORMAT in extensions:
        raise _refuse(Reason.qcow2_backing_file, name, "the QCOW2 carries a backing-file format extension")
    if EXT_DATA_FILE in extensions:
        raise _refuse(Reason.qcow2_data_file, name, "the QCOW2 names an external data file")
    if EXT_ENCRYPTION in extensions:
        raise _refuse(Reason.qcow2_encrypted, name, "the QCOW2 carries an encryption header")
    if size <= 0:
        raise _refuse(Reason.qcow2_features, name, "the QCOW2's virtual size is 0")
    if size > disk_size:
        raise ImagerError(
            Reason.image_too_large,
            f"{name}: the image holds a {size}-byte disk, larger than the {disk_size}-byte target",
            hint="choose a larger disk with the hints, or build the image with a smaller disk_size",
        )
    return Qcow2Header(version, cluster_bits, size, incompatible, tuple(extensions))


def _extensions(head: bytes, start: int, end: int, name: str) -> list[int]:
    found: list[int] = []
    offset = start
    while offset + 8 <= end:
        kind, length = struct.unpack_from(">II", head, offset)
        if kind == EXT_END:
            return found
        if len(found) == MAX_EXTENSIONS:
            raise _refuse(Reason.qcow2_features, name, f"more than {MAX_EXTENSIONS} header extensions")
        offset += 8 + length + (-length % 8)
        if offset > end:
            raise _refuse(Reason.qcow2_features, name, "a header extension runs past the first cluster")
        found.append(kind)
    return found


def container_format(head: bytes) -> str | None:
    """The disk container format ``head`` starts with (``QCOW2``, ``VMDK``, ...), or None for raw."""
    for magic, label in CONTAINER_MAGICS.items():
        if head.startswith(magic):
            return label
    return None
