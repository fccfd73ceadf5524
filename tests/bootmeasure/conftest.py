"""Boot reference values: the fixture ISO's Debian-signed kernel is a real PE image to hash."""

from __future__ import annotations

from tests.fixture_installer.conftest import boot_files, installer_iso

__all__ = ["boot_files", "installer_iso"]
