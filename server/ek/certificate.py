"""A lenient X.509 certificate parser for EK and manufacturer CA certificates.

python-cryptography refuses several real certificates (see docs/ek-trust.md,
"Lenient parsing"). This parser reads the structure itself, keeps the
``tbsCertificate`` bytes exactly as signed, and records every tolerated
deviation as a quirk name in :attr:`Certificate.quirks`. Structural damage
(truncation, wrong element types, duplicate extensions, malformed extensions
that carry security meaning) still raises :class:`~protocol.der.DerError`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime

from protocol import der
from protocol.der import DerError, Tlv
from server.ek.keys import PublicKeyInfo, SignatureAlgorithm, parse_signature_algorithm, parse_spki_tlv

Q_TRAILING_DATA = "trailing_data"
Q_NEGATIVE_SERIAL = "negative_serial"
Q_ZERO_SERIAL = "zero_serial"
Q_EXPLICIT_DEFAULT = "explicit_default_critical_false"
Q_SIGALG_ENCODING_DIFFERS = "sigalg_encoding_differs"
Q_EXTENSIONS_BEFORE_V3 = "extensions_before_v3"

EXT_SKI = "2.5.29.14"
EXT_KEY_USAGE = "2.5.29.15"
EXT_SAN = "2.5.29.17"
EXT_BASIC_CONSTRAINTS = "2.5.29.19"
EXT_CRL_DP = "2.5.29.31"
EXT_CERT_POLICIES = "2.5.29.32"
EXT_AKI = "2.5.29.35"
EXT_EKU = "2.5.29.37"
EXT_SUBJECT_DIR_ATTRS = "2.5.29.9"
EXT_AIA = "1.3.6.1.5.5.7.1.1"
AIA_CA_ISSUERS = "1.3.6.1.5.5.7.48.2"

TCG_TPM_MANUFACTURER = "2.23.133.2.1"
TCG_TPM_MODEL = "2.23.133.2.2"
TCG_TPM_VERSION = "2.23.133.2.3"
TCG_SAN_ATTRIBUTES = frozenset({TCG_TPM_MANUFACTURER, TCG_TPM_MODEL, TCG_TPM_VERSION})
TCG_KP_EK_CERTIFICATE = "2.23.133.8.1"

# keyUsage bit numbers (RFC 5280 4.2.1.3)
KU_DIGITAL_SIGNATURE = 0
KU_KEY_ENCIPHERMENT = 2
KU_KEY_AGREEMENT = 4
KU_KEY_CERT_SIGN = 5

_ATTRIBUTE_NAMES = {
    "2.5.4.3": "CN",
    "2.5.4.4": "SN",
    "2.5.4.5": "serialNumber",
    "2.5.4.6": "C",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.9": "STREET",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.12": "title",
    "2.5.4.42": "GN",
    "0.9.2342.19200300.100.1.1": "UID",
    "0.9.2342.19200300.100.1.25": "DC",
    "1.2.840.113549.1.9.1": "emailAddress",
    TCG_TPM_MANUFACTURER: "TPMManufacturer",
    TCG_TPM_MODEL: "TPMModel",
    TCG_TPM_VERSION: "TPMVersion",
}

NameKey = tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Name:
    """A distinguished name: its encoding, a normalised comparison key and RFC 4514 text."""

    der: bytes
    key: NameKey
    text: str
    attributes: tuple[tuple[str, str], ...]  # (OID, text) in encoding order, for TCG SAN look-ups

    @property
    def empty(self) -> bool:
        return not self.key


@dataclass(frozen=True, slots=True)
class Extension:
    oid: str
    critical: bool
    value: bytes


@dataclass(frozen=True, slots=True)
class BasicConstraints:
    ca: bool
    path_length: int | None


@dataclass(frozen=True, slots=True)
class TpmSan:
    """The SAN of an EK certificate: whether it is exactly the TCG DirectoryName, and its attributes."""

    tcg_only: bool
    manufacturer: str = ""
    model: str = ""
    version: str = ""


@dataclass(frozen=True, slots=True)
class Certificate:
    der: bytes  # the certificate, trailing bytes removed
    sha256: bytes  # of ``der``
    tbs: bytes  # tbsCertificate exactly as signed
    version: int  # 1, 2 or 3
    serial: int
    serial_hex: str
    signature_algorithm: SignatureAlgorithm
    signature: bytes
    issuer: Name
    subject: Name
    not_before: datetime
    not_after: datetime
    public_key: PublicKeyInfo
    extensions: dict[str, Extension]
    basic_constraints: BasicConstraints | None
    key_usage: frozenset[int] | None
    subject_key_id: bytes | None
    authority_key_id: bytes | None
    extended_key_usage: tuple[str, ...] | None
    san: TpmSan | None
    ca_issuer_urls: tuple[str, ...]
    trailing_bytes: int
    quirks: frozenset[str]

    @property
    def display(self) -> str:
        """Subject text, or the serial number for the (usual) empty EK subject."""
        return self.subject.text or f"(empty subject, serial {self.serial_hex})"

    @property
    def is_ca(self) -> bool:
        return self.basic_constraints is not None and self.basic_constraints.ca

    @property
    def self_issued(self) -> bool:
        return self.subject.key == self.issuer.key


def parse_certificate(data: bytes) -> Certificate:
    """Parse one certificate; bytes after the outer SEQUENCE are stripped and recorded."""
    quirks: set[str] = set()
    outer = der.expect(der.read_tlv(data, 0, len(data), quirks), der.SEQUENCE, "Certificate")
    trailing = len(data) - outer.end
    if trailing:
        quirks.add(Q_TRAILING_DATA)
    cert_der = data[: outer.end] if trailing else data
    parts = der.children(outer, quirks)
    if len(parts) != 3:
        raise DerError(f"Certificate must have 3 elements, found {len(parts)}")
    tbs_tlv = der.expect(parts[0], der.SEQUENCE, "tbsCertificate")
    outer_alg = parse_signature_algorithm(parts[1], quirks)
    signature, unused = der.parse_bit_string(parts[2], "signatureValue")
    if unused:
        raise DerError("signatureValue has unused bits")

    fields = der.children(tbs_tlv, quirks)
    index = 0
    version = 1
    if fields and fields[0].tag == 0xA0:
        inner = der.children(fields[0], quirks)
        if len(inner) != 1:
            raise DerError("version: explicit tag must wrap one INTEGER")
        raw_version = der.parse_integer(inner[0], quirks, "version")
        if raw_version not in (0, 1, 2):
            raise DerError(f"unknown certificate version {raw_version}")
        version = raw_version + 1
        index = 1
    if len(fields) < index + 6:
        raise DerError("tbsCertificate is missing fields")
    serial = der.parse_integer(fields[index], quirks, "serialNumber")
    if serial < 0:
        quirks.add(Q_NEGATIVE_SERIAL)
    elif serial == 0:
        quirks.add(Q_ZERO_SERIAL)
    inner_alg_tlv = fields[index + 1]
    inner_alg = parse_signature_algorithm(inner_alg_tlv, quirks)
    if inner_alg_tlv.raw != parts[1].raw:
        if inner_alg != outer_alg:
            raise DerError("the signature algorithm inside tbsCertificate differs from the outer one")
        quirks.add(Q_SIGALG_ENCODING_DIFFERS)
    issuer = parse_name(fields[index + 2], quirks)
    validity = der.children(der.expect(fields[index + 3], der.SEQUENCE, "validity"), quirks)
    if len(validity) != 2:
        raise DerError("validity must have notBefore and notAfter")
    not_before = der.parse_time(validity[0], quirks)
    not_after = der.parse_time(validity[1], quirks)
    subject = parse_name(fields[index + 4], quirks)
    public_key = parse_spki_tlv(der.expect(fields[index + 5], der.SEQUENCE, "subjectPublicKeyInfo"), quirks)
    extensions: dict[str, Extension] = {}
    for extra in fields[index + 6 :]:
        if extra.tag in (0x81, 0x82, 0xA1, 0xA2):  # issuerUniqueID, subjectUniqueID
            continue
        if extra.tag != 0xA3 or extensions:
            raise DerError(f"unexpected element 0x{extra.tag:02x} at the end of tbsCertificate")
        if version != 3:
            quirks.add(Q_EXTENSIONS_BEFORE_V3)
        extensions = _parse_extensions(extra, quirks)
        if not extensions:
            raise DerError("empty extensions field")
    info = _extension_info(extensions, quirks)
    return Certificate(
        der=cert_der,
        sha256=hashlib.sha256(cert_der).digest(),
        tbs=data[tbs_tlv.start : tbs_tlv.end],
        version=version,
        serial=serial,
        serial_hex=_serial_hex(serial),
        signature_algorithm=outer_alg,
        signature=signature,
        issuer=issuer,
        subject=subject,
        not_before=not_before,
        not_after=not_after,
        public_key=public_key,
        extensions=extensions,
        basic_constraints=info.basic_constraints,
        key_usage=info.key_usage,
        subject_key_id=info.subject_key_id,
        authority_key_id=info.authority_key_id,
        extended_key_usage=info.extended_key_usage,
        san=info.san,
        ca_issuer_urls=info.ca_issuer_urls,
        trailing_bytes=trailing,
        quirks=frozenset(quirks),
    )


def _serial_hex(serial: int) -> str:
    if serial < 0:
        return "-" + _serial_hex(-serial)
    text = f"{serial:X}"
    return text if len(text) % 2 == 0 else "0" + text


def _parse_extensions(tagged: Tlv, quirks: set[str]) -> dict[str, Extension]:
    inner = der.children(tagged, quirks)
    if len(inner) != 1:
        raise DerError("extensions: explicit tag must wrap one SEQUENCE")
    out: dict[str, Extension] = {}
    for item in der.children(der.expect(inner[0], der.SEQUENCE, "extensions"), quirks):
        parts = der.children(der.expect(item, der.SEQUENCE, "Extension"), quirks)
        if len(parts) not in (2, 3):
            raise DerError("Extension must have 2 or 3 elements")
        oid = der.parse_oid(parts[0], "extnID")
        critical = False
        if len(parts) == 3:
            critical = der.parse_boolean(parts[1], quirks)
            if not critical:
                quirks.add(Q_EXPLICIT_DEFAULT)
        value = der.expect(parts[-1], der.OCTET_STRING, "extnValue").value
        if oid in out:
            raise DerError(f"extension {oid} appears twice")
        out[oid] = Extension(oid, critical, value)
    return out


def _single(value: bytes, quirks: set[str], what: str) -> Tlv:
    tlv = der.read_tlv(value, 0, len(value), quirks)
    if tlv.end != len(value):
        raise DerError(f"{what}: trailing bytes in the extension value")
    return tlv


@dataclass(frozen=True, slots=True)
class _ExtensionInfo:
    basic_constraints: BasicConstraints | None
    key_usage: frozenset[int] | None
    subject_key_id: bytes | None
    authority_key_id: bytes | None
    extended_key_usage: tuple[str, ...] | None
    san: TpmSan | None
    ca_issuer_urls: tuple[str, ...]


def _extension_info(ext: dict[str, Extension], quirks: set[str]) -> _ExtensionInfo:
    basic: BasicConstraints | None = None
    if EXT_BASIC_CONSTRAINTS in ext:
        bc_value = _single(ext[EXT_BASIC_CONSTRAINTS].value, quirks, "basicConstraints")
        items = der.children(der.expect(bc_value, der.SEQUENCE, "basicConstraints"), quirks)
        ca, path_length = False, None
        for item in items:
            if item.tag == der.BOOLEAN and path_length is None and not ca:
                ca = der.parse_boolean(item, quirks)
                if not ca:
                    quirks.add(Q_EXPLICIT_DEFAULT)
            elif item.tag == der.INTEGER and path_length is None:
                path_length = der.parse_integer(item, quirks, "pathLenConstraint")
                if path_length < 0:
                    raise DerError("negative pathLenConstraint")
            else:
                raise DerError("malformed basicConstraints")
        basic = BasicConstraints(ca, path_length)
    key_usage: frozenset[int] | None = None
    if EXT_KEY_USAGE in ext:
        bits, _ = der.parse_bit_string(_single(ext[EXT_KEY_USAGE].value, quirks, "keyUsage"), "keyUsage")
        key_usage = frozenset(i for i in range(len(bits) * 8) if bits[i // 8] & (0x80 >> (i % 8)))
    ski: bytes | None = None
    if EXT_SKI in ext:
        ski = der.expect(
            _single(ext[EXT_SKI].value, quirks, "subjectKeyIdentifier"), der.OCTET_STRING, "SKI"
        ).value
    aki: bytes | None = None
    if EXT_AKI in ext:
        aki_seq = der.expect(
            _single(ext[EXT_AKI].value, quirks, "authorityKeyIdentifier"), der.SEQUENCE, "AKI"
        )
        for item in der.children(aki_seq, quirks):
            if item.tag == 0x80:
                aki = item.value
    eku: tuple[str, ...] | None = None
    if EXT_EKU in ext:
        eku_seq = der.expect(_single(ext[EXT_EKU].value, quirks, "extKeyUsage"), der.SEQUENCE, "extKeyUsage")
        eku = tuple(der.parse_oid(item, "KeyPurposeId") for item in der.children(eku_seq, quirks))
    san = _parse_san(ext[EXT_SAN].value, quirks) if EXT_SAN in ext else None
    urls: list[str] = []
    if EXT_AIA in ext:
        try:
            urls = _parse_aia(ext[EXT_AIA].value)
        except DerError:
            urls = []  # informational only: a broken AIA never blocks a certificate
    return _ExtensionInfo(basic, key_usage, ski, aki, eku, san, tuple(urls))


def _parse_san(value: bytes, quirks: set[str]) -> TpmSan:
    names = der.children(der.expect(_single(value, quirks, "subjectAltName"), der.SEQUENCE, "SAN"), quirks)
    attributes: list[tuple[str, str]] = []
    dir_names = 0
    for general_name in names:
        if general_name.tag == 0xA4:  # directoryName [4] EXPLICIT Name
            inner = der.children(general_name, quirks)
            if len(inner) != 1:
                raise DerError("SAN directoryName must wrap one Name")
            attributes.extend(parse_name(inner[0], quirks).attributes)
            dir_names += 1
    found = dict(attributes)
    tcg_only = (
        len(names) == 1
        and dir_names == 1
        and bool(attributes)
        and all(oid in TCG_SAN_ATTRIBUTES for oid, _ in attributes)
    )
    return TpmSan(
        tcg_only,
        found.get(TCG_TPM_MANUFACTURER, ""),
        found.get(TCG_TPM_MODEL, ""),
        found.get(TCG_TPM_VERSION, ""),
    )


def _parse_aia(value: bytes) -> list[str]:
    quirks: set[str] = set()
    urls: list[str] = []
    for item in der.children(der.expect(_single(value, quirks, "AIA"), der.SEQUENCE, "AIA"), quirks):
        parts = der.children(item, quirks)
        if len(parts) == 2 and der.parse_oid(parts[0]) == AIA_CA_ISSUERS and parts[1].tag == 0x86:
            urls.append(parts[1].value.decode("ascii", "replace"))
    return urls


def parse_name(tlv: Tlv, quirks: set[str]) -> Name:
    der.expect(tlv, der.SEQUENCE, "Name")
    key: list[tuple[str, ...]] = []
    texts: list[str] = []
    attributes: list[tuple[str, str]] = []
    for rdn in der.children(tlv, quirks):
        avas = der.children(der.expect(rdn, der.SET, "RelativeDistinguishedName"), quirks)
        if not avas:
            raise DerError("empty RelativeDistinguishedName")
        if len(avas) > 1:
            der.check_set_order(avas, quirks)
        normalised: list[str] = []
        shown: list[str] = []
        for ava in avas:
            parts = der.children(der.expect(ava, der.SEQUENCE, "AttributeTypeAndValue"), quirks)
            if len(parts) != 2:
                raise DerError("AttributeTypeAndValue must have two elements")
            oid = der.parse_oid(parts[0], "attribute type")
            text = der.decode_string(parts[1])
            if text is None:
                normalised.append(f"{oid}=#{parts[1].raw.hex()}")
                shown.append(f"{_ATTRIBUTE_NAMES.get(oid, oid)}=#{parts[1].raw.hex()}")
                attributes.append((oid, "#" + parts[1].raw.hex()))
            else:
                normalised.append(f"{oid}={' '.join(text.casefold().split())}")
                shown.append(f"{_ATTRIBUTE_NAMES.get(oid, oid)}={_escape(text)}")
                attributes.append((oid, text))
        key.append(tuple(sorted(normalised)))
        texts.append("+".join(shown))
    return Name(tlv.raw, tuple(key), ",".join(reversed(texts)), tuple(attributes))


_NEEDS_ESCAPE = re.compile(r'[,+"\\<>;\x00-\x1f]|^[# ]| $')


def _escape(text: str) -> str:
    """RFC 4514 escaping of an attribute value."""
    if _NEEDS_ESCAPE.search(text) is None:
        return text
    out = []
    for i, char in enumerate(text):
        if char in ',+"\\<>;' or (i == 0 and char in "# ") or (i == len(text) - 1 and char == " "):
            out.append("\\" + char)
        elif ord(char) < 0x20:
            out.append(f"\\{ord(char):02x}")
        else:
            out.append(char)
    return "".join(out)
