"""TPM2_Quote verification without a TSS: signature, freshness, signer and PCR digest.

A quote is a ``TPMS_ATTEST`` of type ``TPM_ST_ATTEST_QUOTE`` and its ``TPMT_SIGNATURE``
(boot-path-and-measured-boot.md B3). :func:`verify_quote` checks, in go-attestation's order
(``AKPublic.validateQuote``):

1. the signature over the raw ``TPMS_ATTEST`` with the AK's own scheme and hash (the AK the
   server credential-activated at attestation: only then does ``TPM_GENERATED_VALUE`` prove the
   structure came from that TPM);
2. ``magic``, ``type``, ``extraData`` == the server's nonce (constant time); ``qualifiedSigner`` is
   the AK's *qualified* name (TPM 2.0 Part 1, 16: nameAlg || H(QN(parent) || Name), the parent here
   being the SRK under the owner hierarchy), which the AK's name alone cannot give: it is compared
   with ``ak_qualified_name`` when the caller recorded one (the ``qualifiedSigner`` of the AK's own
   TPM2_CertifyCreation at attestation, signed by that AK), else only its name algorithm is checked
   (the signature already proves which key signed);
3. the selection covers exactly the PCRs whose values are given, in one bank, and ``pcrDigest`` ==
   H_ak(values in ascending PCR order).

Each failure is a :class:`QuoteError` with a ``reason`` slug the server turns into its refusal.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from protocol import tpm2
from protocol.errors import ProtocolError

MAX_QUOTE_BYTES = 4096
MAX_SIGNATURE_BYTES = 1024
NONCE_BYTES = 32

_HASHES: dict[int, type[hashes.HashAlgorithm]] = {
    tpm2.Alg.SHA1: hashes.SHA1,
    tpm2.Alg.SHA256: hashes.SHA256,
    tpm2.Alg.SHA384: hashes.SHA384,
    tpm2.Alg.SHA512: hashes.SHA512,
}
BANK_ALGS = {
    "sha1": tpm2.Alg.SHA1,
    "sha256": tpm2.Alg.SHA256,
    "sha384": tpm2.Alg.SHA384,
    "sha512": tpm2.Alg.SHA512,
}


class QuoteError(ProtocolError):
    """A quote that does not prove what it must; ``reason`` names which check failed."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class SignatureError(ProtocolError):
    """A TPMT_SIGNATURE that does not verify with the key's own scheme."""


def verify_tpm_signature(pub: tpm2.Public, sig: tpm2.Signature, message: bytes) -> None:
    """Verify a TPM signature over ``message`` with ``pub``'s own scheme and hash; raise SignatureError."""
    if pub.scheme.scheme not in (tpm2.Alg.RSASSA, tpm2.Alg.ECDSA):
        raise SignatureError(f"signing scheme {pub.scheme.scheme.name} is not RSASSA or ECDSA")
    if sig.sig_alg != pub.scheme.scheme or sig.hash_alg != pub.scheme.hash_alg:
        raise SignatureError("the signature does not use the key's own scheme and hash")
    hash_cls = _HASHES.get(sig.hash_alg)
    if hash_cls is None:
        raise SignatureError(f"unsupported signature hash 0x{sig.hash_alg:04x}")
    try:
        key = tpm2.public_key(pub)
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(sig.rsa_signature, message, padding.PKCS1v15(), hash_cls())
        elif isinstance(key, ec.EllipticCurvePublicKey):
            der = encode_dss_signature(int.from_bytes(sig.ecc_r, "big"), int.from_bytes(sig.ecc_s, "big"))
            key.verify(der, message, ec.ECDSA(hash_cls()))
        else:  # pragma: no cover - public_key returns only these
            raise SignatureError("unsupported key type")
    except (InvalidSignature, ValueError, ProtocolError) as exc:
        raise SignatureError("the signature does not verify") from exc


def selection_pcrs(select: bytes) -> list[int]:
    """PCR indexes of a selection bitmap (bit i mod 8 of byte i/8), ascending."""
    return [i for i in range(len(select) * 8) if select[i // 8] >> (i % 8) & 1]


def selection_bitmap(pcrs: list[int], size: int = 3) -> bytes:
    out = bytearray(size)
    for i in pcrs:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


@dataclass(frozen=True)
class VerifiedQuote:
    bank: str
    pcrs: dict[int, bytes]
    clock: int
    reset_count: int
    restart_count: int


def verify_quote(
    *,
    ak_public: bytes,
    quote: bytes,
    signature: bytes,
    nonce: bytes,
    pcr_values: dict[int, bytes],
    bank: str,
    ak_qualified_name: bytes | None = None,
) -> VerifiedQuote:
    """Verify a quote over ``pcr_values`` (index -> value of ``bank``), signed by ``ak_public`` over ``nonce``."""
    if len(quote) > MAX_QUOTE_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
        raise QuoteError("the quote or its signature is too large", "quote_malformed")
    try:
        pub = tpm2.parse_public(ak_public)
        sig = tpm2.parse_signature(signature)
    except ProtocolError as exc:
        raise QuoteError(f"the quote signature is malformed: {exc}", "quote_malformed") from exc
    try:
        verify_tpm_signature(pub, sig, quote)
    except SignatureError as exc:
        raise QuoteError(
            f"the quote's signature does not verify with the AK this agent attested with: {exc}",
            "quote_signature",
        ) from exc
    try:
        attest = tpm2.parse_attest(quote)
    except ProtocolError as exc:
        raise QuoteError(f"the quote is malformed: {exc}", "quote_malformed") from exc
    if attest.magic != tpm2.TPM_GENERATED_VALUE or attest.type != tpm2.TPM_ST_ATTEST_QUOTE:
        raise QuoteError("the quote is not a TPM-generated quote structure", "quote_malformed")
    if not hmac.compare_digest(attest.extra_data, nonce):
        raise QuoteError("the quote is not over this request's nonce (stale or replayed)", "quote_nonce")
    name = pub.name()
    if ak_qualified_name is not None:
        if not hmac.compare_digest(attest.qualified_signer, ak_qualified_name):
            raise QuoteError("the quote names another signer than the attested AK", "quote_signature")
    elif len(attest.qualified_signer) != len(name) or attest.qualified_signer[:2] != name[:2]:
        raise QuoteError("the quote's signer is not named with the AK's name algorithm", "quote_signature")
    if len(attest.pcr_select) != 1:
        raise QuoteError(
            f"the quote selects {len(attest.pcr_select)} banks; exactly one is expected", "quote_selection"
        )
    selection = attest.pcr_select[0]
    alg = BANK_ALGS.get(bank)
    if alg is None or selection.hash_alg != alg:
        raise QuoteError(f"the quote is over bank 0x{selection.hash_alg:04x}, not {bank}", "quote_bank")
    quoted = selection_pcrs(selection.select)
    if quoted != sorted(pcr_values):
        raise QuoteError(
            f"the quote covers PCRs {quoted}, the request gives values for {sorted(pcr_values)}",
            "quote_selection",
        )
    expected = tpm2.hash_digest(pub.name_alg if pub.scheme.hash_alg == 0 else pub.scheme.hash_alg,
                                b"".join(pcr_values[i] for i in quoted))  # fmt: skip
    if not hmac.compare_digest(expected, attest.pcr_digest):
        raise QuoteError("the quoted PCR digest does not match the PCR values", "quote_pcr_digest")
    return VerifiedQuote(bank, dict(pcr_values), attest.clock, attest.reset_count, attest.restart_count)
