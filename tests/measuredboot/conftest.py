"""Measured boot with real swtpm TPMs: the attestation tier's fixtures (local EK CA, TPMs, servers)."""

from __future__ import annotations

from tests.attest.conftest import ek_ca_dir, local_ca, servers, tpms

__all__ = ["ek_ca_dir", "local_ca", "servers", "tpms"]
