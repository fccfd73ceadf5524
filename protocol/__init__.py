"""What crosses the wire between the node agent and the attestation server.

Both ``agent`` and ``server`` import this package; nothing else does. It holds
the generated gRPC stubs (``protocol._gen``), the ``tpm`` attestor payload codec
(spire-tpm-plugin v1.9.0 JSON), the TPM 2.0 structure parsers, credential
activation maths, SPIFFE ID helpers, and the atomic private file write both
sides use (``protocol.files``).
"""
