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
import re
import tempfile
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder import schemacheck
from imagebuilder.cache import Cache
from imagebuilder.definition import Definition
from imagebuilder.errors import LockError

log = logging.getLogger(__name__)

LOCK_SCHEMA = "https://nodetrust.dev/imagebuilder-lock/v1"
FIRST_USE = "first use: no published checksum and no pin"
SCHEMA_RESOURCE = "lock.schema.json"
MAX_LOCK_BYTES = 64 << 20  # read no more than this before parsing (a lock of 20,000 inputs is about 20 MiB)
_RELOCK = "run `imagebuilder lock` again"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9._+~%=,:@-]{0,254}")


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


def plain_name(value: str, what: str = "file name") -> str:
    """``value`` when it is a plain file name (no ``/``, not ``.`` or ``..``, no control characters, no
    leading ``-`` or ``.``): a name from the lock becomes a path on the media only through this."""
    if not _PLAIN_NAME.fullmatch(value):
        raise LockError(
            f"{value!r} is not a plain {what}: refused (it would become a path outside the staging tree)",
            hint="lock fields are checked against imagebuilder/schemas/lock.schema.json; run `imagebuilder lock` again",
        )
    return value


def default_lock_path(definition: Path) -> Path:
    name = definition.name
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return definition.with_name(name + ".lock.json")


# -- reading and checking -----------------------------------------------------------------


def load_lock(path: Path) -> Lock:
    """Read and validate a lock file: bounded in size, then :data:`SCHEMA_RESOURCE` (every problem at once)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_LOCK_BYTES + 1)
    except FileNotFoundError:
        raise LockError(f"no lock file at {path}", hint="run `imagebuilder lock DEFINITION` first") from None
    except OSError as exc:
        raise LockError(f"cannot read the lock file {path}: {exc.strerror}") from exc
    if len(raw) > MAX_LOCK_BYTES:
        raise LockError(
            f"{path} is larger than {MAX_LOCK_BYTES >> 20} MiB: not a lock file",
            hint="check the --lock path; run `imagebuilder lock` again",
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LockError(f"{path} is not a valid lock file: not JSON ({exc})", hint=_RELOCK) from exc
    if not isinstance(data, dict) or data.get("schema") != LOCK_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise LockError(
            f"{path} is not a valid lock file: schema is {found!r}, expected {LOCK_SCHEMA}", hint=_RELOCK
        )
    problems = schemacheck.validate(schemacheck.load_schema(SCHEMA_RESOURCE), data)
    if problems:
        listing = "\n  ".join(problems[:40]) + (
            f"\n  ... {len(problems) - 40} more" if len(problems) > 40 else ""
        )
        raise LockError(
            f"{path} is not a valid lock file: {len(problems)} problem(s):\n  {listing}",
            hint=f"the lock's schema is imagebuilder/schemas/{SCHEMA_RESOURCE}; a lock is written only by "
            "`imagebuilder lock`: run it again and review the diff",
        )
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


def check_lock(defn: Definition, lock: Lock) -> None:
    """Refuse a lock that was not made for exactly this definition, misses an input it implies, or holds
    one it does not (each named); see :func:`implied_problems`."""
    if lock.definition_sha256 != defn.resolved_sha256:
        raise LockError(
            f"{lock.path} was made for another version of {defn.path} (or other ${{VAR}} values): "
            "the definition's inputs are not locked",
            hint=f"run `imagebuilder lock {defn.path}` and review the lock's diff",
        )
    if lock.architecture != defn.architecture:
        raise LockError(f"{lock.path} is for {lock.architecture}, the definition for {defn.architecture}")
    missing, extra, wrong = implied_problems(defn, lock.inputs)
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append("not locked: " + ", ".join(missing))
        if extra:
            parts.append("not implied by the definition: " + ", ".join(extra))
        parts += wrong
        raise LockError(
            f"{lock.path} does not match {defn.path}: " + "; ".join(parts),
            hint=f"a lock holds exactly the inputs its definition implies: run `imagebuilder lock {defn.path}` "
            "and review the diff (a hand-edited or foreign lock is refused)",
        )


def _expect(problems: list[str], item: LockedInput, **fields: object) -> None:
    for name, wanted in fields.items():
        actual = getattr(item, name)
        if actual != wanted:
            problems.append(f"{item.key}: {name} is {actual!r}, the definition implies {wanted!r}")


def implied_problems(
    defn: Definition, inputs: tuple[LockedInput, ...] | list[LockedInput]
) -> tuple[list[str], list[str], list[str]]:
    """(missing keys, keys the definition does not imply, fields that differ from what it implies).

    The definition implies: the ISO; each artifact, with its URL, mirrors, kind, destination, strip and
    mode; the Kubernetes packages of every version (and debs of those versions only); OS debs only when
    it asks for packages or Kubernetes; wheels, and the sdist and compiled wheel of each ``compile``
    requirement. Which debs and wheels the dependency closures need is checked once they are fetched
    (:mod:`imagebuilder.closure` and the wheelhouse phase).
    """
    missing: list[str] = []
    extra: list[str] = []
    wrong: list[str] = []
    by_key: dict[str, LockedInput] = {}
    for item in inputs:
        if item.key in by_key:
            wrong.append(f"{item.key}: locked twice")
        by_key[item.key] = item
    artifacts = {a.name: a for a in defn.artifacts}
    kube = defn.kubernetes
    compiled = {_project(r) for r in defn.agent.compile}
    required = ["iso", *(f"artifact/{name}" for name in artifacts)]
    if kube is not None:
        required += [f"kubernetes/{v}/{p}" for v in kube.versions for p in kube.packages]
    required += [f"{kind}/{name}" for name in sorted(compiled) for kind in ("sdist", "compiled")]
    missing = [key for key in required if key not in by_key]
    iso = defn.installer.iso
    for key, item in sorted(by_key.items()):
        kind, _, rest = key.partition("/")
        suffix = rest.rsplit("/", 1)[-1]
        if kind != "iso" and item.name != suffix:
            wrong.append(f"{key}: name is {item.name!r}, the key names {suffix!r}")
        if kind == "iso":
            _expect(
                wrong, item, kind="iso", role="installer", url=iso.url, mirrors=iso.mirrors, destination=""
            )
            if iso.sha256 and item.sha256 != iso.sha256:
                wrong.append(f"iso: sha256 is {item.sha256}, the definition pins {iso.sha256}")
        elif kind == "artifact":
            artifact = artifacts.get(rest)
            if artifact is None:
                extra.append(key)
                continue
            _expect(wrong, item, kind=artifact.kind, url=artifact.url, mirrors=artifact.mirrors,
                    role="wheelhouse" if artifact.kind == "wheel" else "stage",
                    destination=artifact.destination, strip_components=artifact.strip_components,
                    mode=artifact.mode, filename=url_basename(artifact.url))  # fmt: skip
            if artifact.sha256 and item.sha256 != artifact.sha256:
                wrong.append(f"{key}: sha256 is {item.sha256}, the definition pins {artifact.sha256}")
        elif kind == "deb":
            if not defn.packages and kube is None:
                extra.append(key)
                continue
            _expect(wrong, item, kind="deb", role="apt", destination="")
        elif kind == "kubernetes":
            version = rest.split("/", 1)[0]
            if kube is None or version not in kube.versions:
                extra.append(key)
                continue
            if version == kube.installed:
                _expect(wrong, item, kind="deb", role="apt", destination="")
            else:
                _expect(wrong, item, kind="deb", role="stage", destination=kube.staged_dir(version))
        elif kind == "wheel":
            _expect(wrong, item, kind="wheel", role="wheelhouse", destination=defn.agent.venv)
        elif kind in ("sdist", "compiled"):
            if rest not in compiled:
                extra.append(key)
                continue
            if kind == "sdist":
                _expect(wrong, item, kind="sdist", role="sdist", destination="")
            else:
                sdist = by_key.get(f"sdist/{rest}")
                _expect(wrong, item, kind="wheel", role="compiled", destination=defn.agent.venv,
                        url=f"sdist:sha256:{sdist.sha256}" if sdist else item.url)  # fmt: skip
        else:  # pragma: no cover - the schema allows no other key
            extra.append(key)
        if item.url.startswith("sdist:") and kind != "compiled":
            wrong.append(f"{key}: only a compiled wheel has an sdist: URL")
        if item.role in ("apt", "stage", "wheelhouse", "sdist", "compiled") and not item.filename:
            wrong.append(f"{key}: no filename")
    wrong += _shared_files(by_key.values())
    return missing, extra, wrong


def _shared_files(inputs: Iterable[LockedInput]) -> list[str]:
    """Two inputs that would be the same file on a medium (the flat apt repository, the wheelhouse, one
    staged Kubernetes version's folder, an artifact's folder)."""
    places: dict[tuple[str, str], list[str]] = {}
    for item in inputs:
        kind = item.key.split("/", 1)[0]
        if item.role == "apt":
            folder = "apt"
        elif item.role in ("wheelhouse", "compiled"):
            folder = "wheels"
        elif kind == "kubernetes":
            folder = item.key.rsplit("/", 1)[0]
        else:
            folder = item.key
        places.setdefault((folder, item.filename), []).append(item.key)
    return [
        f"{', '.join(sorted(keys))}: the same file {name!r} in {folder}/"
        for (folder, name), keys in sorted(places.items())
        if len(keys) > 1 and name
    ]


def _project(requirement: str) -> str:
    """The normalised project name of a ``name==version`` requirement."""
    name = requirement.split("==", 1)[0]
    return name.lower().replace("_", "-").replace(".", "-")


def url_basename(url: str) -> str:
    """The file name a URL ends in (percent-decoded), as the lock records it."""
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


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
    # What upstream published (file names, versions) is checked like any lock before the file exists:
    # a lock that a build would refuse is never written.
    problems = schemacheck.validate(schemacheck.load_schema(SCHEMA_RESOURCE), data)
    missing, extra, wrong = implied_problems(defn, inputs)
    problems += [f"not locked: {key}" for key in missing] + [f"not implied: {key}" for key in extra] + wrong
    if problems:
        raise LockError(
            f"{defn.path}: the resolved inputs do not make a valid lock ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:40]),
            hint="an upstream index or checksum file named something the builder refuses (see the problems); "
            f"nothing was written to {lock_path}",
        )
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
