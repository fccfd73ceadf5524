"""What two builds of one lock must have in common, and what is a record of one run (docs/reproducible.md).

Two builds of one definition, lock, agent source and builder publish the same image, the same
``boot-measurements.json`` and the same ``sbom.spdx.json``. Their ``manifest.json`` and
``provenance.intoto.json`` are the same too, except the fields listed here: by design, they record one
run on one machine (when, how long, where, with which host tools, from which cache, and its logs).
:func:`comparable_manifest` and :func:`comparable_provenance` drop exactly those, and :func:`differences`
names every remaining difference by its JSON path. ``imagebuilder rebuild`` and the VM tier's
reproducibility test compare with these.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Fields of the manifest that record the run (dotted paths; ``outputs[name]`` is one entry of ``outputs``).
MANIFEST_RUN_RECORD = (
    "started_at",  # time stamps by design
    "finished_at",
    "phases",  # each phase's start and duration
    "builder.host",  # the machine
    "tools",  # this machine's tool versions (the builder's own version is builder.version)
    "accelerator",  # KVM or TCG on this machine
    "installer",  # the installer's events, if this run installed the base
    "build_path",  # full or incremental: whether this machine's cache had the base
    "base",  # the cached installed base (never shipped): its digest differs from install to install
    "definition.path",  # where the files were on this machine (their sha256 are compared)
    "lock.path",
    "agent.source.untracked_left_out",  # untracked files of this checkout, left out of the agent
    "boot_test",  # whether this run booted the image
    "outputs[console.log]",  # the run's console, with times
    "outputs[boot-test.json]",  # the boot test's report, with its duration
)
#: Fields of the provenance that record the run.
PROVENANCE_RUN_RECORD = (
    "predicate.runDetails.metadata.startedOn",
    "predicate.runDetails.metadata.finishedOn",
    "predicate.runDetails.builder.version",  # this machine's tools (imagebuilder's version is compared apart)
    "predicate.runDetails.byproducts",  # the console log's digest
    "predicate.buildDefinition.internalParameters.host",
    "predicate.buildDefinition.externalParameters.definition.path",
    "predicate.buildDefinition.externalParameters.lock.path",
    "subject[boot-test.json]",
)
#: The outputs that are the same, byte for byte.
IDENTICAL_FILES = ("sbom.spdx.json", "boot-measurements.json")
#: The outputs that are records of the run as a whole (SHA256SUMS lists the logs; a signature is the signer's).
RUN_FILES = ("console.log", "boot-test.json", "SHA256SUMS", "signature.dsse.json")


_STEP = re.compile(r"([^.\[]+)(?:\[([^\]]+)\])?(?:\.(.*))?")


def _drop(doc: Any, path: str) -> None:
    """Remove ``path`` (``a.b``, ``list[name]``: the entries of ``list`` whose ``name`` is that) from ``doc``."""
    match = _STEP.fullmatch(path)
    if match is None or not isinstance(doc, dict) or match[1] not in doc:
        return
    name, key, rest = match[1], match[2], match[3]
    if key is not None:
        items = doc[name]
        if isinstance(items, list):
            doc[name] = [i for i in items if not (isinstance(i, dict) and i.get("name") == key)]
        return
    if rest:
        _drop(doc[name], rest)
    else:
        del doc[name]


def _without(doc: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    for path in fields:
        _drop(out, path)
    return out


def comparable_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest without :data:`MANIFEST_RUN_RECORD` (the builder's version stays: it must be the same)."""
    return _without(manifest, MANIFEST_RUN_RECORD)


def comparable_provenance(statement: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance without :data:`PROVENANCE_RUN_RECORD`, keeping the builder's own version."""
    out = _without(statement, PROVENANCE_RUN_RECORD)
    version = (((statement.get("predicate") or {}).get("runDetails") or {}).get("builder") or {}).get(
        "version"
    )
    if isinstance(version, Mapping) and "imagebuilder" in version:
        out.setdefault("predicate", {}).setdefault("runDetails", {}).setdefault("builder", {})["version"] = {
            "imagebuilder": version["imagebuilder"]
        }
    return out


@dataclass(frozen=True)
class Difference:
    path: str  # a JSON path: ``packages[3].version``, ``outputs[fixture-node.qcow2].sha256``
    published: Any
    rebuilt: Any

    def describe(self, width: int = 100) -> str:
        def short(value: Any) -> str:
            text = "(absent)" if value is _ABSENT else repr(value)
            return text if len(text) <= width else text[: width - 3] + "..."

        return f"{self.path}: {short(self.published)} -> {short(self.rebuilt)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "published": None if self.published is _ABSENT else self.published,
            "rebuilt": None if self.rebuilt is _ABSENT else self.rebuilt,
        }


_ABSENT: Any = object()


def _keyed(items: list[Any]) -> dict[str, Any] | None:
    """A list of objects with a ``name`` (outputs, inputs, packages...) keyed by it (by ``name@version``, then with
    the kind and destination, where names repeat); None when the list is not like that."""
    if not items or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    for fields in (
        ("name",),
        ("name", "version"),
        ("name", "version", "kind"),
        ("name", "version", "kind", "destination"),
    ):
        keys = ["@".join(str(i.get(f, "")) for f in fields) for i in items]
        if len(set(keys)) == len(keys):
            return dict(zip(keys, items, strict=True))
    return None


def differences(published: Any, rebuilt: Any, path: str = "", *, limit: int = 200) -> list[Difference]:
    """Every difference between two JSON documents, by JSON path (lists of named objects are matched by name)."""
    out: list[Difference] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(out) >= limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{where}.{key}" if where else key)
            return
        if isinstance(a, list) and isinstance(b, list):
            ka, kb = _keyed(a), _keyed(b)
            if ka is not None and kb is not None:
                for key in sorted(set(ka) | set(kb)):
                    walk(ka.get(key, _ABSENT), kb.get(key, _ABSENT), f"{where}[{key}]")
                return
            if len(a) == len(b):
                for i, (x, y) in enumerate(zip(a, b, strict=True)):
                    walk(x, y, f"{where}[{i}]")
                return
        out.append(Difference(where or "(document)", a, b))

    walk(published, rebuilt, path)
    return out


def tool_differences(published: Mapping[str, Any], rebuilt: Mapping[str, Any]) -> list[Difference]:
    """Host tools whose versions differ between the two manifests (an explanation, not a failure by itself)."""
    a, b = dict(published.get("tools") or {}), dict(rebuilt.get("tools") or {})
    return [Difference(f"tools.{k}", a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]  # fmt: skip
