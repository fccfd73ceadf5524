"""``spire.api.server.bundle.v1.Bundle/GetBundle``: the trust bundle, as a SPIRE agent fetches it
right after AttestAgent. No authentication, like SPIRE."""

from __future__ import annotations

from typing import Any

from protocol._gen.spire.api.types import bundle_pb2 as types_bundle_pb2
from server.boundary import Call, Context, Method
from server.ca import CertificateAuthority

REFRESH_HINT_S = 300


class BundleService:
    """Only GetBundle: the other Bundle methods are SPIRE's administration API."""

    def __init__(self, ca: CertificateAuthority) -> None:
        self.ca = ca

    def methods(self) -> dict[str, Method]:
        # A cheap read of public data: admitted per address, not audited.
        return {"GetBundle": Method("bundle", self.get_bundle, audited=False)}

    async def get_bundle(self, request: Any, context: Context, call: Call) -> types_bundle_pb2.Bundle:
        return types_bundle_pb2.Bundle(
            trust_domain=self.ca.trust_domain,
            x509_authorities=[types_bundle_pb2.X509Certificate(asn1=self.ca.cert_der)],
            refresh_hint=REFRESH_HINT_S,
            sequence_number=1,
        )
