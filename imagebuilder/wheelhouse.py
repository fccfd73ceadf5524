"""The node agent's wheelhouse: the agent wheel built from this repository, its dependencies
as wheels for the *target's* Python and glibc, and wheels compiled here for source-only packages.

* :func:`build_agent_wheel` runs ``pip wheel --no-deps --no-build-isolation`` (offline) on a clean
  export of the source (:func:`export_source`: the tracked files of a git checkout as they are on
  disk, or an sdist outside git), never on the checkout itself, whose ignored ``build/lib`` or
  untracked files would otherwise end up in the signed image.
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
import stat
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.definition import Target
from imagebuilder.errors import LockError, ToolMissingError
from imagebuilder.lock import plain_name
from imagebuilder.run import run

log = logging.getLogger(__name__)

ARCH_MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}
OLDEST_MANYLINUX_MINOR = 17
_PROJECT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


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


def project_name(requirement: str) -> str:
    """The normalised project name a requirement line starts with (``tpm2-pytss==2.3.0`` -> ``tpm2-pytss``)."""
    match = _PROJECT.match(requirement.strip())
    if match is None:
        raise LockError(f"{requirement!r} does not start with a project name")
    return normalise(match.group(0))


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


@dataclass(frozen=True)
class SourceExport:
    """What the agent wheel was built from (recorded in the manifest's ``agent.source``)."""

    kind: str  # "git": the tracked files as they are on disk; "sdist": an sdist of a tree outside git
    commit: str = ""  # HEAD of the checkout ("" outside git or before the first commit)
    modified: tuple[str, ...] = ()  # tracked files whose content on disk differs from HEAD
    untracked: int = 0  # files git does not track (and does not ignore) under the source: left out
    skipped: tuple[str, ...] = ()  # tracked paths not exported: deleted on disk, symbolic links, submodules

    def to_json(self) -> dict[str, object]:
        return {
            "export": self.kind,
            "commit": self.commit,
            "modified": list(self.modified),
            "untracked_left_out": self.untracked,
        }


#: Left out of the copy an sdist is built from, outside a git checkout.
_NOT_SOURCE = ("build", "dist", "*.egg-info", ".git", ".venv", "venv", "__pycache__", "*.pyc", ".cache",
               ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".nox")  # fmt: skip


def _git(source: Path, *args: str) -> bytes | None:
    """``git -C source ARGS``'s output, or None when git is missing or says no."""
    try:
        result = run(["git", "-C", str(source), *args], check=False, env={"GIT_OPTIONAL_LOCKS": "0"})
    except ToolMissingError:
        return None
    return result.stdout if result.returncode == 0 else None


def _split(output: bytes) -> list[str]:
    return [p.decode("utf-8", errors="surrogateescape") for p in output.split(b"\0") if p]


def export_source(source: Path, dest: Path) -> SourceExport:
    """A clean copy of the agent's source at ``dest``, so no stale or stray file of the checkout (an
    ignored ``build/lib``, an untracked module) can reach the wheel.

    In a git checkout: the files git tracks (``git ls-files``), with their content **as it is on disk**,
    uncommitted edits included (what a developer expects to test), never an untracked or ignored file.
    Tracked files that are modified are named in the log and the manifest; tracked files deleted on disk,
    symbolic links (a link could name any host file) and submodules are left out. Outside git (or without
    git): an sdist of the tree, ``build/``, ``dist/``, ``*.egg-info``, VCS folders and caches excluded.
    """
    dest.mkdir(parents=True, exist_ok=True)
    listed = _git(source, "ls-files", "-z", "--cached")
    if listed is None:
        log.info("agent source %s: not a git checkout; building the wheel from an sdist of it", source)
        return SourceExport("sdist")
    skipped = []
    for rel in _split(listed):
        src = source / rel
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            skipped.append(rel)
            continue
        if not stat.S_ISREG(st.st_mode):
            skipped.append(rel)
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target, follow_symlinks=False)
        target.chmod(0o755 if st.st_mode & 0o111 else 0o644)
    head = _git(source, "rev-parse", "--verify", "-q", "HEAD")
    commit = head.decode().strip() if head else ""
    modified = _git(source, "diff", "--name-only", "-z", "--relative", "HEAD", "--") if commit else listed
    untracked = _git(source, "ls-files", "-z", "--others", "--exclude-standard") or b""
    export = SourceExport(
        "git", commit, tuple(sorted(_split(modified or b""))), len(_split(untracked)), tuple(sorted(skipped))
    )
    if export.modified:
        shown = ", ".join(export.modified[:10]) + (
            f" and {len(export.modified) - 10} more" if len(export.modified) > 10 else ""
        )
        log.warning(
            "the agent wheel is built from the tracked files as they are on disk: %d differ from HEAD %s (%s)",
            len(export.modified),
            commit[:12] or "(no commit)",
            shown,
        )
    if export.untracked:
        log.info(
            "agent source: %d untracked file(s) left out of the wheel (git add them to include them)",
            export.untracked,
        )
    return export


def _sdist(source: Path, outdir: Path) -> Path:
    """An sdist of ``source`` built from a copy of it (the build backend writes nothing into ``source``)."""
    tree = outdir / "tree"
    shutil.copytree(source, tree, symlinks=True, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    backend = "setuptools.build_meta"
    with (source / "pyproject.toml").open("rb") as fh:
        backend = tomllib.load(fh).get("build-system", {}).get("build-backend", backend)
    program = "import importlib, sys; print(importlib.import_module(sys.argv[1]).build_sdist(sys.argv[2]))"
    result = run([sys.executable, "-c", program, backend, str(outdir / "sdist")], cwd=tree,
                 env={"SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "315532800")},
                 hint="the agent's sdist is built with the builder's own build backend; check pyproject.toml")  # fmt: skip
    name = result.text.strip().splitlines()[-1]
    return outdir / "sdist" / plain_name(name)


def build_agent_wheel(source: Path, outdir: Path) -> tuple[Path, SourceExport]:
    """Build the repository's wheel (``nodetrust``) into ``outdir``, offline, from a clean export of the
    source (:func:`export_source`); every Python module in it must compile."""
    if not (source / "pyproject.toml").is_file():
        raise LockError(
            f"agent source {source} has no pyproject.toml", hint="agent.source names the repository"
        )
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imagebuilder-agent-") as tmp:
        export = export_source(source, Path(tmp) / "source")
        what = Path(tmp) / "source" if export.kind == "git" else _sdist(source, Path(tmp))
        if export.kind == "git" and not (Path(what) / "pyproject.toml").is_file():
            raise LockError(f"agent source {source}: git does not track pyproject.toml", hint="git add it")
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
                str(Path(tmp) / "wheel"),
                str(what),
            ],
            env={"PIP_NO_INPUT": "1", "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "315532800")},
            hint="the agent wheel is built with the builder's own setuptools; check pyproject.toml",
        )
        wheels = sorted((Path(tmp) / "wheel").glob("*.whl"))
        if len(wheels) != 1:
            raise LockError(f"building the agent wheel from {source} produced {len(wheels)} wheels")
        _check_compiles(wheels[0])
        dest = outdir / wheels[0].name
        shutil.move(str(wheels[0]), dest)
    return dest, export


def _check_compiles(wheel: Path) -> None:
    """Every ``.py`` of the wheel compiles: a half-saved edit never reaches the image."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            try:
                compile(archive.read(name), name, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                raise LockError(
                    f"the agent wheel's {name} does not compile: {exc}",
                    hint="fix the file (a half-saved edit?) and build again: the wheel is built from the "
                    "tracked files as they are on disk",
                ) from exc


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
            # the sdist of each requested project, but not of their build dependencies: ``:all:`` would reach
            # into pip's isolated build environment too and compile cryptography from source there (which a
            # fresh machine without a pip cache then had to do, and could not)
            argv += [f"--no-binary={project_name(r)}" for r in requirements]
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
        named = Path(tmp) / plain_name(filename)  # pip wants the sdist's real file name
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
