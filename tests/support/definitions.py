"""Definitions written somewhere else than examples/: their relative paths made absolute.

Public API::

    absolute_paths(node, base: Path) -> None   # every relative ``keyring`` and ``source`` path, in place

A definition's relative paths (an apt source's or a checksum file's ``keyring``, ``node.host.files[].source``,
``agent.source``) are relative to the definition's own folder. The VM tier and ``make demo`` write variants
of ``examples/*.yaml`` into their work folders, so every such path is made absolute against ``base`` first,
wherever the definition grows one. Values that are absolute, a URL, or an environment variable are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PATH_KEYS = frozenset({"keyring", "source"})


def absolute_paths(node: Any, base: Path) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in PATH_KEYS and isinstance(value, str) and _relative(value):
                node[key] = str((base / value).resolve())
            else:
                absolute_paths(value, base)
    elif isinstance(node, list):
        for item in node:
            absolute_paths(item, base)


def _relative(value: str) -> bool:
    return bool(value) and not value.startswith(("/", "$")) and "://" not in value
