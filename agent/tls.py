"""TLS that authenticates a SPIFFE ID, not a host name.

SPIRE servers present an X.509-SVID whose only name is a URI SAN
(``spiffe://<td>/spire/server``): stock gRPC host-name checks cannot verify it.
We do not turn verification off. Instead the :class:`SpiffeTLSContext` has
OpenSSL verify the whole chain against the trust bundle (the CA certificates
of the trust domain) and then, inside the TLS handshake and before any
application byte is sent, checks that the leaf carries exactly one URI SAN
and that it is one of the expected SPIFFE IDs. A failure aborts the handshake
with :class:`ssl.SSLCertVerificationError`, whose message says what was found.

The context works for asyncio connections (``wrap_bio``, used by grpclib) and
for blocking sockets (``wrap_socket``).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509

from protocol.spiffe import SpiffeId


def spiffe_ids_of(cert_der: bytes) -> list[str]:
    """The URI SANs of a DER certificate."""
    cert = x509.load_der_x509_certificate(cert_der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return san.value.get_values_for_type(x509.UniformResourceIdentifier)


def check_peer(cert_der: bytes | None, expected: frozenset[str]) -> str:
    """Return the peer's SPIFFE ID if it is one of ``expected``; raise SSLCertVerificationError otherwise."""
    if not cert_der:
        raise ssl.SSLCertVerificationError("the peer presented no certificate")
    try:
        uris = spiffe_ids_of(cert_der)
    except ValueError as exc:
        raise ssl.SSLCertVerificationError(f"the peer certificate cannot be parsed: {exc}") from exc
    if len(uris) != 1:
        raise ssl.SSLCertVerificationError(
            f"the peer certificate must carry exactly one URI SAN (a SPIFFE ID), it has {len(uris)}: {uris}"
        )
    if uris[0] not in expected:
        raise ssl.SSLCertVerificationError(
            f"the peer is {uris[0]}, expected {' or '.join(sorted(expected))}"
        )
    return uris[0]


class _SpiffeSSLObject(ssl.SSLObject):
    def do_handshake(self) -> None:
        super().do_handshake()
        ctx = self.context
        if not isinstance(ctx, SpiffeTLSContext):
            raise ssl.SSLCertVerificationError("SPIFFE verification needs a SpiffeTLSContext")
        ctx.verified_peer = check_peer(self.getpeercert(binary_form=True), ctx.expected_ids)


class _SpiffeSSLSocket(ssl.SSLSocket):
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        ctx = self.context
        if not isinstance(ctx, SpiffeTLSContext):
            raise ssl.SSLCertVerificationError("SPIFFE verification needs a SpiffeTLSContext")
        ctx.verified_peer = check_peer(self.getpeercert(binary_form=True), ctx.expected_ids)


class SpiffeTLSContext(ssl.SSLContext):
    """A client TLS context that verifies the chain against a bundle and the peer's SPIFFE ID."""

    sslobject_class = _SpiffeSSLObject
    sslsocket_class = _SpiffeSSLSocket
    expected_ids: frozenset[str]
    verified_peer: str

    def __new__(cls, *args: Any, **kwargs: Any) -> SpiffeTLSContext:
        return super().__new__(cls, ssl.PROTOCOL_TLS_CLIENT)

    def __init__(
        self,
        bundle_pem: bytes,
        expected: Iterable[SpiffeId | str],
        *,
        alpn: tuple[str, ...] = ("h2",),
        cert_file: Path | None = None,
        key_file: Path | None = None,
    ) -> None:
        self.expected_ids = frozenset(str(e) for e in expected)
        if not self.expected_ids:
            raise ValueError("at least one expected SPIFFE ID is required")
        self.verified_peer = ""
        self.minimum_version = ssl.TLSVersion.TLSv1_2
        # The peer is identified by its SPIFFE ID (checked in the handshake), not a host name;
        # the chain itself is verified by OpenSSL against the bundle (CERT_REQUIRED).
        self.check_hostname = False
        self.verify_mode = ssl.CERT_REQUIRED
        try:
            self.load_verify_locations(cadata=bundle_pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"the trust bundle holds no usable CA certificate: {exc}") from exc
        if alpn:
            self.set_alpn_protocols(list(alpn))
        if cert_file is not None:
            self.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
