"""The published build folder: its file names, digests, ``SHA256SUMS`` and the manifest fields the
trust outputs read (docs/image-manifest.md is the contract).

:mod:`imagebuilder.trust` writes the trust outputs (through :func:`write_atomic`), :mod:`imagebuilder.verify`
checks them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
SHA256SUMS = "SHA256SUMS"
SBOM = "sbom.spdx.json"
PROVENANCE = "provenance.intoto.json"
SIGNATURE = "signature.dsse.json"
CONSOLE_LOG = "console.log"

#: Files the trust step writes or reads itself; ``outputs`` in the manifest never lists them.
TRUST_FILES = frozenset({MANIFEST, SHA256SUMS, SBOM, PROVENANCE, SIGNATURE})
#: ``SHA256SUMS`` covers every file of the folder except these two.
NOT_IN_SHA256SUMS = frozenset({SHA256SUMS, SIGNATURE})

QCOW2_MEDIA_TYPE = "application/x-qemu-disk"

Manifest = dict[str, Any]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_BUILD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DISTRO = re.compile(r"[a-z0-9][a-z0-9.-]*")
_SUMS_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB chunks (images are gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests_equal(a: str, b: str) -> bool:
    """Compare two hex digests in constant time (case-insensitive: hex is hex)."""
    return hmac.compare_digest(a.lower().encode("ascii", "replace"), b.lower().encode("ascii", "replace"))


def is_sha256_hex(value: object) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def is_safe_name(name: str) -> bool:
    """A plain file name of the flat build folder: no directories, no control characters."""
    return (
        bool(name)
        and name not in {".", ".."}
        and not any(c in name for c in "/\\")
        and all(c.isprintable() for c in name)
    )


def dump_json(obj: object) -> bytes:
    """How every trust output is serialised: UTF-8, keys sorted, two-space indent, final newline."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def folder_entries(build_dir: Path) -> dict[str, str]:
    """Every entry of the folder, by name, with its kind: ``file``, ``symlink``, ``directory`` or ``other``.

    Symbolic links are reported as such, never followed: a published folder holds regular files only.
    """
    kinds: dict[str, str] = {}
    with os.scandir(build_dir) as it:
        for entry in it:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                kinds[entry.name] = "symlink"
            elif stat.S_ISDIR(mode):
                kinds[entry.name] = "directory"
            elif stat.S_ISREG(mode):
                kinds[entry.name] = "file"
            else:
                kinds[entry.name] = "other"
    return dict(sorted(kinds.items()))


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``path`` through a hidden temporary file in the same folder, flushed, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def format_sha256sums(digests: Mapping[str, str]) -> bytes:
    """coreutils ``sha256sum`` text format, one ``<hex>  <name>`` line per file, sorted by name (bytewise)."""
    names = sorted(digests, key=lambda n: n.encode("utf-8"))
    return "".join(f"{digests[n]}  {n}\n" for n in names).encode("utf-8")


def parse_sha256sums(data: bytes) -> dict[str, str]:
    """Parse ``SHA256SUMS``; raise ValueError naming the first bad line (1-based)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if text and not text.endswith("\n"):
        raise ValueError("the last line does not end with a newline")
    sums: dict[str, str] = {}
    for number, line in enumerate(text.split("\n")[:-1], start=1):  # exactly '\n', as coreutils reads it
        match = _SUMS_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"line {number} is not '<lower-case hex sha256>  <file name>'")
        digest, name = match.groups()
        if not is_safe_name(name):
            raise ValueError(f"line {number} names {name!r}, which is not a plain file name of this folder")
        if name in sums:
            raise ValueError(f"line {number} lists {name} a second time")
        sums[name] = digest
    if not sums:
        raise ValueError("lists no files")
    return sums


_JSON_KIND = {str: "string", dict: "object", list: "array", int: "integer"}


def _need(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is str and not value):
        article = "a non-empty string" if kind is str else f"a JSON {_JSON_KIND[kind]}"
        raise ValueError(f"{where}{key} must be {article}")
    return value


def _need_digest(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or _HEX64.fullmatch(value) is None:
        raise ValueError(f"{where}{key} must be 64 lower-case hex digits (sha256)")
    return value


def check_manifest(obj: object) -> Manifest:
    """Check the manifest fields the trust outputs read; return it, or raise ValueError naming the field.

    Fields beyond these are left alone: the manifest belongs to the build.
    """
    if not isinstance(obj, dict):
        raise ValueError("is not a JSON object")
    build_id = _need(obj, "build_id", str, "")
    if _BUILD_ID.fullmatch(build_id) is None:
        raise ValueError("build_id may hold only letters, digits, '.', '_' and '-'")
    for key in ("name", "started_at", "finished_at"):
        _need(obj, key, str, "")
    builder = _need(obj, "builder", dict, "")
    _need(builder, "id", str, "builder.")
    _need(builder, "version", str, "builder.")
    for key in ("definition", "lock"):
        ref = _need(obj, key, dict, "")
        _need(ref, "path", str, f"{key}.")
        _need_digest(ref, "sha256", f"{key}.")
    distro = obj.get("distro", "ubuntu")
    if not isinstance(distro, str) or _DISTRO.fullmatch(distro) is None:
        raise ValueError("distro must be a lower-case purl namespace such as 'ubuntu' or 'debian'")
    for i, item in enumerate(_need(obj, "inputs", list, "")):
        where = f"inputs[{i}]."
        if not isinstance(item, dict):
            raise ValueError(f"inputs[{i}] must be a JSON object")
        _need(item, "name", str, where)
        _need_digest(item, "sha256", where)
        if not isinstance(item.get("url", ""), str):
            raise ValueError(f"{where}url must be a string")
    seen: set[str] = set()
    for i, item in enumerate(_need(obj, "outputs", list, "")):
        where = f"outputs[{i}]."
        if not isinstance(item, dict):
            raise ValueError(f"outputs[{i}] must be a JSON object")
        name = _need(item, "name", str, where)
        if not is_safe_name(name) or name in TRUST_FILES:
            raise ValueError(f"{where}name {name!r} is not a file name the build may publish")
        if name in seen:
            raise ValueError(f"{where}name {name} is listed twice")
        seen.add(name)
        _need_digest(item, "sha256", where)
        size = item.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{where}size must be a non-negative integer")
    for i, item in enumerate(_need(obj, "packages", list, "")):
        if not isinstance(item, dict):
            raise ValueError(f"packages[{i}] must be a JSON object")
        for key in ("name", "version", "architecture"):
            _need(item, key, str, f"packages[{i}].")
    image_output(obj)
    return obj


def image_output(manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one output that is the image: media type ``application/x-qemu-disk`` or a ``.qcow2`` name."""
    images = [
        out
        for out in manifest.get("outputs", [])
        if out.get("media_type") == QCOW2_MEDIA_TYPE or str(out.get("name", "")).endswith(".qcow2")
    ]
    if len(images) != 1:
        names = ", ".join(str(o.get("name")) for o in images) or "none"
        raise ValueError(f"outputs must hold exactly one image (.qcow2, {QCOW2_MEDIA_TYPE}); found {names}")
    image: Mapping[str, Any] = images[0]
    return image


def boot_measurements_output(manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(file name, sha256)`` of the boot reference values the manifest names (``boot_measurements``), as its
    outputs list them; None when it names none. ValueError when the name is not a plain file name its
    outputs list once with a sha256."""
    section = manifest.get("boot_measurements")
    if not section:
        return None
    name = str(section.get("file", "")) if isinstance(section, Mapping) else ""
    listed = [o for o in manifest.get("outputs", []) if isinstance(o, Mapping) and o.get("name") == name]
    if not is_safe_name(name) or len(listed) != 1 or not is_sha256_hex(listed[0].get("sha256")):
        raise ValueError(
            f"boot_measurements names {name!r}, which its outputs do not list once with a sha256"
        )
    return name, str(listed[0]["sha256"])


def load_manifest_bytes(data: bytes) -> Manifest:
    """Parse and check manifest.json; ValueError says what is wrong."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is not valid UTF-8 JSON ({exc})") from None
    return check_manifest(obj)


def sorted_by(items: Iterable[Mapping[str, Any]], *keys: str) -> list[Mapping[str, Any]]:
    """Items sorted by the string values of ``keys`` (missing keys sort as empty): deterministic output."""
    return sorted(items, key=lambda item: tuple(str(item.get(k, "")) for k in keys))
