"""The dependency lists in pyproject.toml are honest: each role's extra is what that role imports.

Issue 12: ``requests`` sat in three extras and was imported nowhere. The import names come from the
source (``ast``), the distribution of each import from the installed metadata
(``importlib.metadata.packages_distributions``), so no table of ours maps one to the other.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"agent": "agent", "server": "server", "builder": "imagebuilder"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(entries: list[str]) -> set[str]:
    names = set()
    for entry in entries:
        match = _NAME.match(entry)
        assert match is not None, entry
        names.add(_canonical(match.group(0)))
    return names


def _imports(package: str) -> set[str]:
    """Top-level modules (``google.rpc`` kept as two parts) that a package's source imports."""
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        if "_gen" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                found.add(".".join(parts[:2]) if parts[0] == "google" else parts[0])
    return {name for name in found if name.split(".")[0] not in sys.stdlib_module_names}


def _distributions(module: str) -> set[str]:
    """The installed distributions that provide ``module`` (namespace packages by their sub-package)."""
    top = module.split(".", maxsplit=1)[0]
    candidates = {_canonical(d) for d in packages_distributions().get(top, [])}
    if "." not in module:
        return candidates
    sub = module.split(".")[1]
    from importlib.metadata import distribution

    return {
        name
        for name in candidates
        if any(str(f).startswith(f"{top}/{sub}/") for f in distribution(name).files or ())
    }


@pytest.fixture(scope="module")
def project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_every_extra_is_imported_by_its_role_and_nothing_is_missing(project: dict[str, object]) -> None:
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    base = _declared(project["dependencies"])  # type: ignore[arg-type]
    local = {"protocol", *ROLES.values(), "tests"}
    protocol_needs = {d for m in _imports("protocol") - local for d in _distributions(m)}
    assert protocol_needs <= base, f"protocol imports {protocol_needs - base}, which the base does not list"
    for extra, package in ROLES.items():
        declared = _declared(extras[extra])
        used: set[str] = set()
        for module in _imports(package) - local:
            providers = _distributions(module)
            assert providers, f"{package} imports {module}, which no installed distribution provides"
            assert providers & (base | declared), (
                f"{package} imports {module} ({providers}): not in [{extra}]"
            )
            used |= providers
        unused = declared - used
        assert not unused, f"[{extra}] lists {sorted(unused)}, which {package}/ never imports"
    assert "requests" not in {name for entries in extras.values() for name in _declared(entries)}
