"""A flat apt repository on the staging medium: the .debs, ``Packages``, ``Packages.gz`` and ``Release``.

Late-commands use it inside the target as ``deb [trusted=yes] file:<medium>/apt ./``: the
repository is not signed because every .deb in it was verified against the lock (whose
digests come from signed upstream indexes) before it was written to the medium, and the
medium never leaves the build VM.
"""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

from imagebuilder.run import run


def _digests(data: bytes) -> tuple[str, str]:
    return hashlib.md5(data, usedforsecurity=False).hexdigest(), hashlib.sha256(data).hexdigest()


def make_flat_repo(directory: Path, *, origin: str = "nodetrust-staging") -> list[str]:
    """Index every ``*.deb`` in ``directory``; return the package names indexed."""
    stanzas = []
    names = []
    for deb in sorted(directory.glob("*.deb")):
        control = run(["dpkg-deb", "--field", str(deb)]).text.strip()
        md5, sha256 = _digests(deb.read_bytes())
        stanzas.append(
            f"{control}\nFilename: ./{deb.name}\nSize: {deb.stat().st_size}\nMD5sum: {md5}\nSHA256: {sha256}\n"
        )
        for line in control.splitlines():
            if line.startswith("Package:"):
                names.append(line.split(":", 1)[1].strip())
    packages = "\n".join(stanzas).encode("utf-8")
    (directory / "Packages").write_bytes(packages)
    (directory / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    lines_md5, lines_sha = [], []
    for name in ("Packages", "Packages.gz"):
        data = (directory / name).read_bytes()
        md5, sha = _digests(data)
        lines_md5.append(f" {md5} {len(data)} {name}")
        lines_sha.append(f" {sha} {len(data)} {name}")
    (directory / "Release").write_text(
        f"Origin: {origin}\nLabel: {origin}\nArchitectures: amd64 arm64 all\n"
        "MD5Sum:\n" + "\n".join(lines_md5) + "\nSHA256:\n" + "\n".join(lines_sha) + "\n",
        encoding="utf-8",
    )
    return sorted(names)
