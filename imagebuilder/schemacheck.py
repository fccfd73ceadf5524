"""JSON Schema validation of the files the builder reads but did not write: the definition and the lock.

The schemas ship as package data (``imagebuilder/schemas/``, for editors too) and are checked with
``jsonschema`` (Draft 2020-12), with one rule made exact: a ``pattern`` is evaluated the way JSON Schema
defines it (ECMA-262), where ``$`` is the end of the string. Python's ``re`` lets ``$`` match before a
final newline, so ``"^[0-9a-f]{64}$"`` would accept a digest followed by ``"\\n"``, and a file name
with a trailing newline would pass a "plain file name" pattern and then split a line of the staging
plan. Here every unescaped ``$`` outside a character class means ``\\Z``.

Errors come back as ``path: message`` lines (``inputs[3].sha256: ...``), every one at once.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

SCHEMA_PACKAGE = "imagebuilder.schemas"


def load_schema(resource: str) -> dict[str, Any]:
    """A schema shipped in ``imagebuilder/schemas/``."""
    text = resources.files(SCHEMA_PACKAGE).joinpath(resource).read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def ecma_pattern(pattern: str) -> str:
    """``pattern`` with every end-of-string ``$`` (unescaped, outside ``[...]``) written as ``\\Z``."""
    out: list[str] = []
    escaped = in_class = False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif in_class:
            out.append(char)
            in_class = char != "]"
        elif char == "[":
            out.append(char)
            in_class = True
        elif char == "$":
            out.append(r"\Z")
        else:
            out.append(char)
    return "".join(out)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(ecma_pattern(pattern))


def _pattern(validator: Any, pattern: str, instance: object, _schema: object) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if isinstance(instance, str) and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.lru_cache(maxsize=1)
def _validator_class() -> Any:
    from jsonschema import Draft202012Validator, validators

    return validators.extend(Draft202012Validator, {"pattern": _pattern})  # type: ignore[no-untyped-call]


def _error_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validate(schema: dict[str, Any], data: object) -> list[str]:
    """Schema errors as ``path: message`` lines, sorted by path; empty when ``data`` is valid."""
    from jsonschema.exceptions import best_match

    validator = _validator_class()(schema)
    messages = []
    for error in validator.iter_errors(data):
        chosen = best_match(error.context) if error.context else error
        if chosen is None:  # pragma: no cover - best_match of a non-empty context
            chosen = error
        messages.append(f"{_error_path(chosen.absolute_path)}: {chosen.message}")
    return sorted(set(messages))
