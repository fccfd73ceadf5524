"""The SPIRE-compatible attestation server and join-credential broker (``nodeserver``)."""
