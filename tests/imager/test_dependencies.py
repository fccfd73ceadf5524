"""The imager imports the standard library, ``protocol`` and the base dependencies, and nothing else: it
runs in a boot environment made of Debian packages (python3-cryptography, python3-yaml), and the
ARCHITECTURE has it share release formats through ``protocol`` only, never by importing the builder."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {"imager", "protocol", "cryptography", "yaml", "blake3"}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names)


def test_the_imager_imports_only_protocol_and_the_base_dependencies() -> None:
    for path in sorted((REPO / "imager").rglob("*.py")):
        extra = _imports(path) - ALLOWED
        assert not extra, f"{path.relative_to(REPO)} imports {sorted(extra)}"


def test_the_shared_release_readers_import_no_program() -> None:
    for name in ("cmdline", "dsse", "release"):
        extra = _imports(REPO / "protocol" / f"{name}.py") - {"protocol", "cryptography"}
        assert not extra, f"protocol/{name}.py imports {sorted(extra)}"
