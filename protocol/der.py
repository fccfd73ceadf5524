"""A minimal, strict DER TLV reader, enough to walk certificates without trusting a full parser.

Used where a full X.509 parser may refuse real-world TPM certificates, e.g. to
cut the exact certificate out of an NV index with trailing padding, or to pull
the SubjectPublicKeyInfo out of an EK certificate.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ProtocolError


class DerError(ProtocolError):
    """Malformed DER."""


@dataclass(frozen=True)
class Tlv:
    tag: int
    header_len: int
    length: int
    offset: int  # of the tag byte in the parent buffer

    @property
    def end(self) -> int:
        return self.offset + self.header_len + self.length

    def value(self, data: bytes) -> bytes:
        return data[self.offset + self.header_len : self.end]

    def encoded(self, data: bytes) -> bytes:
        return data[self.offset : self.end]


def read_tlv(data: bytes, offset: int = 0) -> Tlv:
    """Read one TLV at ``offset`` (single-byte tags only, definite lengths only)."""
    if offset + 2 > len(data):
        raise DerError("truncated DER header")
    tag = data[offset]
    if tag & 0x1F == 0x1F:
        raise DerError("multi-byte DER tags are not supported")
    first = data[offset + 1]
    if first < 0x80:
        length, header = first, 2
    else:
        count = first & 0x7F
        if count == 0 or count > 4:
            raise DerError("indefinite or oversized DER length")
        if offset + 2 + count > len(data):
            raise DerError("truncated DER length")
        length = int.from_bytes(data[offset + 2 : offset + 2 + count], "big")
        header = 2 + count
    tlv = Tlv(tag, header, length, offset)
    if tlv.end > len(data):
        raise DerError(f"DER element of {length} bytes overruns its buffer")
    return tlv


def children(data: bytes, parent: Tlv) -> list[Tlv]:
    """The TLVs directly inside a constructed element."""
    out = []
    pos = parent.offset + parent.header_len
    while pos < parent.end:
        child = read_tlv(data, pos)
        if child.end > parent.end:
            raise DerError("DER child overruns its parent")
        out.append(child)
        pos = child.end
    return out


def first_element(data: bytes) -> bytes:
    """The first complete DER element of ``data`` (drops trailing padding)."""
    return read_tlv(data).encoded(data)


def certificate_spki(cert_der: bytes) -> bytes:
    """The DER SubjectPublicKeyInfo of an X.509 certificate, found structurally."""
    cert = read_tlv(cert_der)
    if cert.tag != 0x30:
        raise DerError("certificate is not a SEQUENCE")
    tbs = children(cert_der, cert)[0]
    fields = children(cert_der, tbs)
    idx = 1 if fields and fields[0].tag == 0xA0 else 0  # optional [0] version
    # serialNumber, signature, issuer, validity, subject, subjectPublicKeyInfo
    spki_index = idx + 5
    if len(fields) <= spki_index or fields[spki_index].tag != 0x30:
        raise DerError("certificate has no SubjectPublicKeyInfo where expected")
    return fields[spki_index].encoded(cert_der)


def spki_key_material(spki_der: bytes) -> tuple[bytes, bytes]:
    """(algorithm family key, subjectPublicKey bits) for comparing keys across algorithm OIDs.

    RSA keys compare equal whether the SPKI says rsaEncryption or RSAES-OAEP; EC
    keys compare their curve and point.
    """
    spki = read_tlv(spki_der)
    parts = children(spki_der, spki)
    if len(parts) != 2 or parts[0].tag != 0x30 or parts[1].tag != 0x03:
        raise DerError("not a SubjectPublicKeyInfo")
    alg = children(spki_der, parts[0])
    oid = alg[0].value(spki_der)
    rsa_oids = {bytes.fromhex("2a864886f70d010101"), bytes.fromhex("2a864886f70d010107")}
    if oid in rsa_oids:
        family = b"rsa"
    elif oid == bytes.fromhex("2a8648ce3d0201") and len(alg) > 1:
        family = b"ec:" + alg[1].value(spki_der)
    else:
        family = b"oid:" + oid
    return family, parts[1].value(spki_der)
