"""Shared test set-up. Tier-specific fixtures live in the conftest.py of each sub-folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A path that tests which need the real TPM reference data read from; never copied into the project.
TPM_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tpm-data")


@pytest.fixture(scope="session")
def tpm_data_dir() -> str:
    candidates = [os.environ.get("NODETRUST_TPM_DATA", ""), TPM_DATA, "/work/shared/tpm-data"]
    for path in candidates:
        if path and os.path.isdir(path):
            return os.path.abspath(path)
    pytest.fail("TPM reference data (shared/tpm-data) not found; set NODETRUST_TPM_DATA to its folder")


@pytest.fixture(scope="session")
def cloud_init_schema() -> None:
    """cloud-init's own ``schema`` command available: Debian's package unpacked once (never installed)."""
    subprocess.run([str(REPO / "scripts" / "cloud-init-schema.sh")], check=True, timeout=600)
