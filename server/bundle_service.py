"""``spire.api.server.bundle.v1.Bundle/GetBundle``: the trust bundle, as a SPIRE agent fetches it
right after AttestAgent. No authentication, like SPIRE."""

from __future__ import annotations

from typing import Any

import grpc

from protocol._gen.spire.api.server.bundle.v1 import bundle_pb2, bundle_pb2_grpc
from protocol._gen.spire.api.types import bundle_pb2 as types_bundle_pb2
from server.ca import CertificateAuthority

REFRESH_HINT_S = 300


class BundleService(bundle_pb2_grpc.BundleServicer):
    def __init__(self, ca: CertificateAuthority) -> None:
        self.ca = ca

    async def GetBundle(
        self, request: bundle_pb2.GetBundleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> types_bundle_pb2.Bundle:
        return types_bundle_pb2.Bundle(
            trust_domain=self.ca.trust_domain,
            x509_authorities=[types_bundle_pb2.X509Certificate(asn1=self.ca.cert_der)],
            refresh_hint=REFRESH_HINT_S,
            sequence_number=1,
        )
