"""The lock file: every input of a build resolved to URL, SHA-256 and size, and how it was verified.

``imagebuilder lock`` (:func:`create_lock`) resolves the definition:

* the installer ISO and each artifact: against the upstream checksum file when the
  definition names one (its OpenPGP signature checked with the named keyring), else the
  definition's own pin, else (said loudly) the first download;
* OS packages and Kubernetes debs: from apt indexes whose ``InRelease`` signature is
  checked (:mod:`imagebuilder.aptindex`), with their dependency closure minus what the
  installer's base system already has (the ISO's package manifests);
* the agent's Python dependencies: wheels for the target's Python and glibc with the
  index's digests (:mod:`imagebuilder.wheelhouse`); source-only requirements as the sdist
  plus the wheel compiled from it here.

Everything is downloaded through the cache, so a lock is only written when every input
was fetched and matched. ``imagebuilder build`` (:func:`check_lock`) refuses a lock made
for another definition (the digest of the definition after ``${VAR}`` substitution) and
any input the lock does not cover.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder.cache import Cache
from imagebuilder.definition import Definition
from imagebuilder.errors import LockError

log = logging.getLogger(__name__)

LOCK_SCHEMA = "https://nodetrust.dev/imagebuilder-lock/v1"
FIRST_USE = "first use: no published checksum and no pin"


@dataclass(frozen=True)
class LockedInput:
    key: str  # iso | artifact/<name> | deb/<name> | kubernetes/<version>/<name> | wheel/<name> | sdist/<name> | compiled/<name>
    name: str
    kind: str  # iso, deb, tarball, binary, oci-archive, wheel, sdist
    version: str
    url: str
    sha256: str
    size: int
    role: str  # installer | apt | stage | wheelhouse | sdist | compiled
    destination: str = ""
    filename: str = ""
    mirrors: tuple[str, ...] = ()
    verified_by: str = ""
    strip_components: int = 0
    mode: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mirrors"] = list(self.mirrors)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LockedInput:
        values = dict(data)
        values["mirrors"] = tuple(values.get("mirrors", ()))
        return cls(**values)


@dataclass(frozen=True)
class Lock:
    path: Path
    file_sha256: str
    definition_sha256: str
    architecture: str
    created_at: str
    inputs: tuple[LockedInput, ...]
    agent_requires: tuple[str, ...] = ()
    base_packages: dict[str, str] = field(default_factory=dict)

    def get(self, key: str) -> LockedInput:
        for item in self.inputs:
            if item.key == key:
                return item
        raise LockError(
            f"{self.path}: no entry for {key}: the input is not locked",
            hint="run `imagebuilder lock` for this definition",
        )

    def by_role(self, role: str) -> list[LockedInput]:
        return [i for i in self.inputs if i.role == role]


def default_lock_path(definition: Path) -> Path:
    name = definition.name
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return definition.with_name(name + ".lock.json")


# -- reading and checking -----------------------------------------------------------------


def load_lock(path: Path) -> Lock:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise LockError(f"no lock file at {path}", hint="run `imagebuilder lock DEFINITION` first") from None
    try:
        data = json.loads(raw)
        if data.get("schema") != LOCK_SCHEMA:
            raise ValueError(f"schema is {data.get('schema')!r}, expected {LOCK_SCHEMA}")
        return Lock(
            path=path,
            file_sha256=hashlib.sha256(raw).hexdigest(),
            definition_sha256=data["definition_sha256"],
            architecture=data["architecture"],
            created_at=data["created_at"],
            inputs=tuple(LockedInput.from_json(i) for i in data["inputs"]),
            agent_requires=tuple(data.get("agent", {}).get("requires", ())),
            base_packages=dict(data.get("base_packages", {})),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise LockError(
            f"{path} is not a valid lock file: {exc}", hint="run `imagebuilder lock` again"
        ) from exc


def check_lock(defn: Definition, lock: Lock) -> None:
    """Refuse a lock that was not made for exactly this definition, or that misses an input."""
    if lock.definition_sha256 != defn.resolved_sha256:
        raise LockError(
            f"{lock.path} was made for another version of {defn.path} (or other ${{VAR}} values): "
            "the definition's inputs are not locked",
            hint=f"run `imagebuilder lock {defn.path}` and review the lock's diff",
        )
    if lock.architecture != defn.architecture:
        raise LockError(f"{lock.path} is for {lock.architecture}, the definition for {defn.architecture}")
    lock.get("iso")
    for artifact in defn.artifacts:
        locked = lock.get(f"artifact/{artifact.name}")
        if locked.url != artifact.url or (artifact.sha256 and locked.sha256 != artifact.sha256):
            raise LockError(
                f"artifact {artifact.name}: the lock has another URL or digest than the definition"
            )
    if defn.kubernetes is not None:
        for version in defn.kubernetes.versions:
            for package in defn.kubernetes.packages:
                lock.get(f"kubernetes/{version}/{package}")


def write_lock(
    lock_path: Path,
    defn: Definition,
    inputs: list[LockedInput],
    *,
    agent_requires: list[str],
    base_packages: dict[str, str],
) -> Lock:
    data = {
        "schema": LOCK_SCHEMA,
        "definition": os.path.relpath(defn.path.resolve(), lock_path.resolve().parent),
        "definition_sha256": defn.resolved_sha256,
        "architecture": defn.architecture,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "agent": {"requires": agent_requires},
        "base_packages": dict(sorted(base_packages.items())),
        "inputs": [i.to_json() for i in sorted(inputs, key=lambda i: i.key)],
    }
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    tmp = lock_path.with_name(f".{lock_path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, lock_path)
    return load_lock(lock_path)


# -- resolving ---------------------------------------------------------------------------------


def create_lock(defn: Definition, cache: Cache, lock_path: Path) -> Lock:
    """Resolve and fetch every input of ``defn``, then write the lock file."""
    from imagebuilder.resolve import Resolver

    with tempfile.TemporaryDirectory(prefix="imagebuilder-lock-") as tmp:
        resolver = Resolver(defn, cache)
        inputs = resolver.resolve(Path(tmp))
    keys = [i.key for i in inputs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise LockError(f"two inputs resolve to the same key: {', '.join(duplicates)}")
    lock = write_lock(
        lock_path, defn, inputs, agent_requires=resolver.agent_requires, base_packages=resolver.base
    )
    first_use = [i.name for i in inputs if i.verified_by == FIRST_USE]
    if first_use:
        log.warning("recorded on first use (nothing upstream vouches for them): %s", ", ".join(first_use))
    return lock
