"""EK certificates as they come out of TPM NV storage."""

from __future__ import annotations

from protocol.der import DerError, certificate_spki, first_element, spki_key_material

# TCG PC Client: some TPMs prefix the certificate with 0x10 0x01 0x00 and a u16 length.
_TCG_NV_HEADER = b"\x10\x01\x00"


def clean_nv_certificate(raw: bytes) -> bytes | None:
    """Strip the optional TCG NV header and any trailing padding; None if nothing usable is there."""
    data = raw
    if data.startswith(_TCG_NV_HEADER) and len(data) > 5:
        size = int.from_bytes(data[3:5], "big")
        data = data[5 : 5 + size]
    if not data or data[0] != 0x30:
        return None
    try:
        return first_element(data)
    except DerError:
        return None


def same_public_key(cert_der: bytes, spki_der: bytes) -> bool:
    """True when the certificate's key is the key in ``spki_der`` (RSA OID variants compare equal)."""
    try:
        return spki_key_material(certificate_spki(cert_der)) == spki_key_material(spki_der)
    except DerError:
        return False
