"""The node agent's wheelhouse: the agent wheel built from this repository, its dependencies
as wheels for the *target's* Python and glibc, and wheels compiled here for source-only packages.

* :func:`build_agent_wheel` runs ``pip wheel --no-deps --no-build-isolation <source>`` (offline).
* :func:`pip_report` asks pip (``install --dry-run --report``) which wheels satisfy the agent's
  requirements for the target: ``--only-binary=:all:``, ``--python-version``, and every
  ``manylinux_2_N`` platform tag up to the target's glibc. The report carries each wheel's
  URL and the index's SHA-256; the lock pins them.
* :func:`compile_sdist` compiles a source-only requirement (tpm2-pytss) into a wheel. That
  is honest only when the build host's Python minor version equals the target's and its
  glibc is not newer; :func:`check_compile_host` refuses otherwise, naming the two ways out
  (run on a host like the target, or pin a prebuilt ``kind: wheel`` artifact).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.definition import Target
from imagebuilder.errors import LockError
from imagebuilder.run import run

log = logging.getLogger(__name__)

ARCH_MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}
OLDEST_MANYLINUX_MINOR = 17


@dataclass(frozen=True)
class ReportItem:
    name: str  # normalised project name
    version: str
    url: str
    sha256: str
    filename: str
    requested: bool


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def platform_tags(target: Target, architecture: str) -> list[str]:
    """``manylinux_2_N`` tags from the target's glibc down to 2.17, the legacy alias, and ``linux_<m>``."""
    machine = ARCH_MACHINE[architecture]
    minor = int(target.glibc.split(".")[1])
    tags = [f"manylinux_2_{n}_{machine}" for n in range(minor, OLDEST_MANYLINUX_MINOR - 1, -1)]
    return [*tags, f"manylinux2014_{machine}", f"linux_{machine}"]


def host_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def host_glibc() -> str:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        value = ""
    return value.split()[-1] if value else "unknown"


def check_compile_host(target: Target, requirement: str) -> None:
    """Refuse to compile for a target the build host does not match."""
    problems = []
    if host_python() != target.python:
        problems.append(f"this host runs Python {host_python()}, the target {target.python}")
    glibc = host_glibc()
    if glibc != "unknown" and _minor(glibc) > _minor(target.glibc):
        problems.append(f"this host's glibc {glibc} is newer than the target's {target.glibc}")
    if problems:
        raise LockError(
            f"cannot compile {requirement} for the target here: " + "; ".join(problems),
            hint="run `imagebuilder lock` on a host like the target (an Ubuntu 24.04 runner for the "
            "Ubuntu 24.04 image), or build the wheel there and pin it as an artifact of kind: wheel",
        )


def _minor(version: str) -> int:
    try:
        return int(version.split(".")[1])
    except (IndexError, ValueError):
        return 0


def build_agent_wheel(source: Path, outdir: Path) -> Path:
    """Build the repository's wheel (``nodetrust``) into ``outdir``, offline."""
    if not (source / "pyproject.toml").is_file():
        raise LockError(
            f"agent source {source} has no pyproject.toml", hint="agent.source names the repository"
        )
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imagebuilder-agent-") as tmp:
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--wheel-dir",
                tmp,
                str(source),
            ],
            env={"PIP_NO_INPUT": "1", "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "315532800")},
            hint="the agent wheel is built with the builder's own setuptools; check pyproject.toml",
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise LockError(f"building the agent wheel from {source} produced {len(wheels)} wheels")
        dest = outdir / wheels[0].name
        shutil.move(str(wheels[0]), dest)
    return dest


def requirements_for(requires: list[str], extras: tuple[str, ...]) -> list[str]:
    """The Requires-Dist lines that apply with ``extras`` (unconditional ones and those of the extras)."""
    kept = []
    for line in requires:
        match = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        if match is None or match.group(1) in extras:
            kept.append(line)
    return sorted(kept)


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode("utf-8")
    name = version = ""
    requires = []
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "Version":
            version = value.strip()
        elif key == "Requires-Dist":
            requires.append(value.strip())
    return name, version, sorted(requires)


def pip_report(
    requirements: list[str],
    target: Target,
    architecture: str,
    *,
    find_links: list[Path],
    only_binary: bool = True,
    no_deps: bool = False,
    no_index: bool = False,
) -> list[ReportItem]:
    """What pip would install for the target (``--dry-run --report``), with URLs and digests."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-pip-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(Path(tmp) / "target"),
        ]
        if only_binary:
            argv += ["--only-binary=:all:", "--python-version", target.python, "--implementation", "cp"]
            for tag in platform_tags(target, architecture):
                argv += ["--platform", tag]
        else:
            argv += ["--no-binary=:all:"]
        if no_deps:
            argv.append("--no-deps")
        if no_index:
            argv.append("--no-index")
        for link in find_links:
            argv += ["--find-links", str(link)]
        run(
            [*argv, *requirements],
            env={"PIP_NO_INPUT": "1"},
            hint="pip could not resolve the agent's wheels",
        )
        data = json.loads(report.read_text(encoding="utf-8"))
    items = []
    for entry in data.get("install", []):
        info = entry.get("download_info", {})
        hashes = info.get("archive_info", {}).get("hashes", {})
        url = str(info.get("url", ""))
        items.append(
            ReportItem(
                name=normalise(entry["metadata"]["name"]),
                version=entry["metadata"]["version"],
                url=url,
                sha256=str(hashes.get("sha256", "")),
                filename=url.rsplit("/", 1)[-1].split("#", 1)[0],
                requested=bool(entry.get("requested")),
            )
        )
    return items


def compile_sdist(sdist: Path, outdir: Path, *, filename: str) -> Path:
    """Compile a source distribution into a wheel for this host (checked to match the target)."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imagebuilder-sdist-") as tmp:
        named = Path(tmp) / filename  # pip wants the sdist's real file name
        shutil.copyfile(sdist, named)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--wheel-dir",
                str(Path(tmp) / "out"),
                str(named),
            ],
            env={"PIP_NO_INPUT": "1"},
            hint=f"compiling {filename} needs a C compiler and the -dev packages of the libraries it binds "
            "(for tpm2-pytss: build-essential, libtss2-dev)",
        )
        wheels = sorted((Path(tmp) / "out").glob("*.whl"))
        if len(wheels) != 1:
            raise LockError(f"compiling {filename} produced {len(wheels)} wheels")
        dest = outdir / wheels[0].name
        shutil.move(str(wheels[0]), dest)
    log.info("compiled %s -> %s", filename, dest.name)
    return dest
