"""The one DER reader of the project: strict about structure, tolerant of what real TPMs break.

Every element is a window (offsets) into the original bytes; nothing is ever re-encoded, so a
signature is always checked over the bytes exactly as they were signed (keylime#1775 re-encoded
the TBS and broke signatures). Strict about structure (lengths, nesting, truncation); tolerant about
the DER rules that real TPM certificates break: such deviations are recorded as *quirk* names in a
caller-supplied set instead of failing the parse, and callers decide whether a quirk is acceptable.

Two kinds of user, one reader:

* the server's lenient X.509 parser (:mod:`server.ek.certificate`) walks whole certificates with
  :func:`read_tlv`, :func:`children` and the ``parse_*`` helpers;
* the agent and the ``tpm`` payload use :func:`first_element` (cut a certificate out of an NV index
  with trailing padding), :func:`certificate_spki` and :func:`spki_key_material`.

Every malformed input raises :class:`DerError` (a :class:`~protocol.errors.ProtocolError`) and
nothing else. This module lives in ``protocol`` so that every program may import it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import lru_cache
from typing import NamedTuple

from protocol.errors import ProtocolError

# Identifier octets (class, constructed bit and number in one byte) for the universal tags we read.
BOOLEAN = 0x01
INTEGER = 0x02
BIT_STRING = 0x03
OCTET_STRING = 0x04
NULL = 0x05
OID = 0x06
UTF8_STRING = 0x0C
NUMERIC_STRING = 0x12
PRINTABLE_STRING = 0x13
TELETEX_STRING = 0x14
IA5_STRING = 0x16
UTC_TIME = 0x17
GENERALIZED_TIME = 0x18
VISIBLE_STRING = 0x1A
UNIVERSAL_STRING = 0x1C
BMP_STRING = 0x1E
SEQUENCE = 0x30
SET = 0x31

CONSTRUCTED = 0x20
_MAX_LENGTH_OCTETS = 4
_MAX_TAG_NUMBER = 1 << 21

# Quirk names (stable; they appear in logs, verdicts and docs/ek-trust.md).
Q_NON_MINIMAL_LENGTH = "non_minimal_length"
Q_NON_MINIMAL_INTEGER = "non_minimal_integer"
Q_NON_DER_BOOLEAN = "non_der_boolean"
Q_UNSORTED_SET = "unsorted_rdn_set"
Q_TIME_FORMAT = "non_der_time"


class DerError(ProtocolError):
    """The bytes are not the DER structure that was expected (truncated, bad length, wrong tag...)."""


class Tlv(NamedTuple):
    """One element: ``data[start:end]`` is the whole TLV, ``data[vstart:end]`` its contents.

    A named tuple, not a frozen dataclass: a certificate has about a hundred elements, and a
    frozen dataclass's constructor costs several times a tuple's (every EK on every attestation).
    """

    data: bytes
    tag: int
    start: int
    vstart: int
    end: int

    @property
    def value(self) -> bytes:
        return self.data[self.vstart : self.end]

    @property
    def raw(self) -> bytes:
        return self.data[self.start : self.end]

    @property
    def constructed(self) -> bool:
        return bool(self.data[self.start] & CONSTRUCTED)


def read_tlv(data: bytes, pos: int, end: int, quirks: set[str]) -> Tlv:
    """Read the element starting at ``pos``; it must end at or before ``end``."""
    if pos >= end:
        raise DerError(f"truncated: expected an element at offset {pos}")
    first = data[pos]
    p = pos + 1
    tag = first
    if first & 0x1F == 0x1F:  # high tag number form
        number = 0
        while True:
            if p >= end:
                raise DerError(f"truncated tag at offset {pos}")
            octet = data[p]
            p += 1
            number = (number << 7) | (octet & 0x7F)
            if number >= _MAX_TAG_NUMBER:
                raise DerError(f"tag number too large at offset {pos}")
            if not octet & 0x80:
                break
        tag = (first << 32) | number
    if p >= end:
        raise DerError(f"truncated: missing length at offset {p}")
    octet = data[p]
    p += 1
    if octet < 0x80:
        length = octet
    elif octet == 0x80:
        raise DerError(f"indefinite length at offset {p - 1} is not DER")
    else:
        count = octet & 0x7F
        if count > _MAX_LENGTH_OCTETS:
            raise DerError(f"length of {count} octets at offset {p - 1} is too long")
        if p + count > end:
            raise DerError(f"truncated length at offset {p - 1}")
        length = int.from_bytes(data[p : p + count], "big")
        if data[p] == 0 or length < 0x80:
            quirks.add(Q_NON_MINIMAL_LENGTH)
        p += count
    if p + length > end:
        raise DerError(f"element at offset {pos} claims {length} bytes but only {end - p} remain")
    return Tlv(data, tag, pos, p, p + length)


def children(tlv: Tlv, quirks: set[str]) -> list[Tlv]:
    """The elements inside a constructed element, in order; they must fill it exactly."""
    if not tlv.constructed:
        raise DerError(f"element at offset {tlv.start} is not constructed")
    out: list[Tlv] = []
    data, pos, end = tlv.data, tlv.vstart, tlv.end
    while pos < end:
        # The common case inline (low tag number, short length, fits): read_tlv's result exactly.
        first = data[pos]
        if first & 0x1F != 0x1F and pos + 1 < end:
            length = data[pos + 1]
            if length < 0x80 and pos + 2 + length <= end:
                out.append(Tlv(data, first, pos, pos + 2, pos + 2 + length))
                pos += 2 + length
                continue
        child = read_tlv(data, pos, end, quirks)
        out.append(child)
        pos = child.end
    return out


def expect(tlv: Tlv, tag: int, what: str) -> Tlv:
    if tlv.tag != tag:
        raise DerError(f"{what}: expected tag 0x{tag:02x}, found 0x{tlv.tag:02x} at offset {tlv.start}")
    return tlv


def parse_integer(tlv: Tlv, quirks: set[str], what: str = "INTEGER") -> int:
    expect(tlv, INTEGER, what)
    value = tlv.value
    if not value:
        raise DerError(f"{what}: empty INTEGER")
    if len(value) > 1 and (
        (value[0] == 0x00 and value[1] < 0x80) or (value[0] == 0xFF and value[1] >= 0x80)
    ):
        quirks.add(Q_NON_MINIMAL_INTEGER)
    return int.from_bytes(value, "big", signed=True)


def parse_boolean(tlv: Tlv, quirks: set[str]) -> bool:
    expect(tlv, BOOLEAN, "BOOLEAN")
    if tlv.end - tlv.vstart != 1:
        raise DerError(f"BOOLEAN at offset {tlv.start} is not one octet")
    octet = tlv.data[tlv.vstart]
    if octet not in (0x00, 0xFF):
        quirks.add(Q_NON_DER_BOOLEAN)
    return octet != 0


def parse_bit_string(tlv: Tlv, what: str = "BIT STRING") -> tuple[bytes, int]:
    """(payload, number of unused bits in the last octet)."""
    expect(tlv, BIT_STRING, what)
    value = tlv.value
    if not value:
        raise DerError(f"{what}: empty BIT STRING")
    unused = value[0]
    if unused > 7 or (unused and len(value) == 1):
        raise DerError(f"{what}: invalid unused-bits octet {unused}")
    return value[1:], unused


def parse_null(tlv: Tlv) -> None:
    expect(tlv, NULL, "NULL")
    if tlv.end != tlv.vstart:
        raise DerError(f"NULL at offset {tlv.start} has contents")


def parse_oid(tlv: Tlv, what: str = "OBJECT IDENTIFIER") -> str:
    expect(tlv, OID, what)
    return decode_oid(tlv.value)


@lru_cache(maxsize=1024)
def decode_oid(value: bytes) -> str:
    """Dotted text of an OBJECT IDENTIFIER's contents."""
    if not value:
        raise DerError("empty OBJECT IDENTIFIER")
    if value[-1] & 0x80:
        raise DerError("OBJECT IDENTIFIER ends inside a sub-identifier")
    arcs: list[int] = []
    current = 0
    fresh = True
    for octet in value:
        if fresh and octet == 0x80:
            raise DerError("OBJECT IDENTIFIER sub-identifier has a leading 0x80 octet")
        current = (current << 7) | (octet & 0x7F)
        fresh = not octet & 0x80
        if fresh:
            arcs.append(current)
            current = 0
    first = arcs[0]
    head = [0, first] if first < 40 else [1, first - 40] if first < 80 else [2, first - 80]
    return ".".join(str(arc) for arc in head + arcs[1:])


def parse_time(tlv: Tlv, quirks: set[str]) -> datetime:
    """UTCTime or GeneralizedTime in UTC ("Z"); seconds may be missing, fractions are dropped."""
    try:
        text = tlv.value.decode("ascii")
    except UnicodeDecodeError as exc:
        raise DerError(f"time at offset {tlv.start} is not ASCII") from exc
    if not text.endswith("Z"):
        raise DerError(f"time {text!r} is not in UTC ('Z')")
    body = text[:-1]
    if tlv.tag == UTC_TIME:
        if len(body) not in (10, 12) or not body.isdigit() or not body.isascii():
            raise DerError(f"malformed UTCTime {text!r}")
        if len(body) == 10:
            quirks.add(Q_TIME_FORMAT)
            body += "00"
        year = int(body[:2])
        year += 1900 if year >= 50 else 2000
        rest = body[2:]
    elif tlv.tag == GENERALIZED_TIME:
        if "." in body:
            quirks.add(Q_TIME_FORMAT)
            body = body.split(".", 1)[0]
        if len(body) != 14 or not body.isdigit() or not body.isascii():
            raise DerError(f"malformed GeneralizedTime {text!r}")
        year = int(body[:4])
        if 1950 <= year < 2050:  # RFC 5280 4.1.2.5: these years are UTCTime (AMD's fTPM CAs break it)
            quirks.add(Q_TIME_FORMAT)
        rest = body[4:]
    else:
        raise DerError(
            f"expected UTCTime or GeneralizedTime at offset {tlv.start}, found tag 0x{tlv.tag:02x}"
        )
    try:
        return datetime(
            year,
            int(rest[0:2]),
            int(rest[2:4]),
            int(rest[4:6]),
            int(rest[6:8]),
            int(rest[8:10]),
            tzinfo=UTC,
        )
    except ValueError as exc:
        raise DerError(f"invalid date {text!r}") from exc


def check_set_order(elements: list[Tlv], quirks: set[str]) -> None:
    """DER sorts a SET OF by the encodings of its elements; record when it is not sorted."""
    raws = [element.raw for element in elements]
    if raws != sorted(raws):
        quirks.add(Q_UNSORTED_SET)


def decode_string(tlv: Tlv) -> str | None:
    """Text of a directory string, or None when the element is not one of the string types."""
    value = tlv.value
    try:
        if tlv.tag in (UTF8_STRING, PRINTABLE_STRING, IA5_STRING, VISIBLE_STRING, NUMERIC_STRING):
            return value.decode("utf-8")
        if tlv.tag == TELETEX_STRING:
            return value.decode("latin-1")
        if tlv.tag == BMP_STRING:
            return value.decode("utf-16-be")
        if tlv.tag == UNIVERSAL_STRING:
            return value.decode("utf-32-be")
    except UnicodeDecodeError:
        return None
    return None


# -- structural helpers for the agent and the payload codec ---------------------------------------

_RSA_OIDS = ("1.2.840.113549.1.1.1", "1.2.840.113549.1.1.7")  # rsaEncryption, id-RSAES-OAEP
_EC_PUBLIC_KEY = "1.2.840.10045.2.1"


def first_element(data: bytes) -> bytes:
    """The first complete DER element of ``data`` (drops trailing padding, e.g. an NV index's 0xFF)."""
    return read_tlv(data, 0, len(data), set()).raw


def certificate_spki(cert_der: bytes) -> bytes:
    """The DER SubjectPublicKeyInfo of an X.509 certificate, found structurally (trailing bytes ignored)."""
    quirks: set[str] = set()
    cert = expect(read_tlv(cert_der, 0, len(cert_der), quirks), SEQUENCE, "Certificate")
    parts = children(cert, quirks)
    if not parts:
        raise DerError("certificate is an empty SEQUENCE")
    fields = children(expect(parts[0], SEQUENCE, "tbsCertificate"), quirks)
    index = 1 if fields and fields[0].tag == 0xA0 else 0  # optional [0] version
    # serialNumber, signature, issuer, validity, subject, subjectPublicKeyInfo
    spki_index = index + 5
    if len(fields) <= spki_index or fields[spki_index].tag != SEQUENCE:
        raise DerError("certificate has no SubjectPublicKeyInfo where expected")
    return fields[spki_index].raw


def spki_key_material(spki_der: bytes) -> tuple[bytes, bytes]:
    """(algorithm family key, subjectPublicKey bits) for comparing keys across algorithm OIDs.

    RSA keys compare equal whether the SPKI says rsaEncryption or RSAES-OAEP; EC keys compare
    their curve and point.
    """
    quirks: set[str] = set()
    spki = expect(read_tlv(spki_der, 0, len(spki_der), quirks), SEQUENCE, "SubjectPublicKeyInfo")
    parts = children(spki, quirks)
    if len(parts) != 2 or parts[0].tag != SEQUENCE or parts[1].tag != BIT_STRING:
        raise DerError("not a SubjectPublicKeyInfo")
    algorithm = children(parts[0], quirks)
    if not algorithm:
        raise DerError("SubjectPublicKeyInfo has an empty AlgorithmIdentifier")
    oid = parse_oid(algorithm[0], "algorithm")
    if oid in _RSA_OIDS:
        family = b"rsa"
    elif oid == _EC_PUBLIC_KEY and len(algorithm) > 1:
        family = b"ec:" + algorithm[1].value
    else:
        family = b"oid:" + algorithm[0].value
    return family, parts[1].value
