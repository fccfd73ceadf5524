"""The agent wheel is built from a clean export of its source, never from the checkout (issue 11).

Before the fix ``pip wheel`` ran in the checkout: setuptools packs everything under ``build/lib``,
so a stale module left there by an earlier build (or planted) went into the agent of a signed image.
Each test makes a small real project (a git checkout, or a plain tree), plants what must not get in,
builds the wheel with the builder's own function and reads the wheel's member list.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from imagebuilder import wheelhouse
from imagebuilder.definition import Target
from imagebuilder.errors import LockError
from imagebuilder.wheelhouse import build_agent_wheel

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "demo"
version = "1.0"

[tool.setuptools.packages.find]
include = ["demo*"]
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@x", "HOME": str(repo), "PATH": "/usr/bin:/bin"})  # fmt: skip


def _project(root: Path) -> Path:
    (root / "demo").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / ".gitignore").write_text("build/\n*.egg-info/\n")
    (root / "demo/__init__.py").write_text("VERSION = 'committed'\n")
    (root / "demo/core.py").write_text("def run() -> int:\n    return 0\n")
    return root


def _plant_strays(root: Path, secret: Path) -> None:
    """What a checkout accumulates: a stale build/lib, an untracked module, a link to a host file."""
    stale = root / "build/lib/demo"
    stale.mkdir(parents=True)
    (stale / "__init__.py").write_text("VERSION = 'committed'\n")
    (stale / "stray.py").write_text("raise SystemExit('a stale module from build/lib')\n")
    (root / "demo/untracked.py").write_text("UNTRACKED = True\n")


def _members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_a_git_checkout_gives_its_tracked_files_as_they_are_on_disk(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    secret = tmp_path / "host-secret.py"
    secret.write_text("SECRET = 'the host'\n")
    (repo / "demo/linked.py").symlink_to(secret)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    _plant_strays(repo, secret)
    (repo / "demo/__init__.py").write_text("VERSION = 'edited, not committed'\n")  # what a developer tests

    wheel, export = build_agent_wheel(repo, tmp_path / "out")
    members = _members(wheel)
    assert members["demo/__init__.py"] == b"VERSION = 'edited, not committed'\n"
    assert "demo/core.py" in members
    assert "demo/stray.py" not in members  # the ignored build/lib
    assert "demo/untracked.py" not in members  # the untracked module
    assert "demo/linked.py" not in members and b"the host" not in b"".join(members.values())
    assert export.kind == "git" and len(export.commit) == 40
    assert export.modified == ("demo/__init__.py",)
    assert export.untracked == 1 and "demo/linked.py" in export.skipped
    assert export.to_json() == {"export": "git", "commit": export.commit, "modified": ["demo/__init__.py"],
                                "untracked_left_out": 1}  # fmt: skip
    assert not (repo / "demo.egg-info").exists(), "the build wrote into the checkout"
    assert sorted(p.name for p in (repo / "build/lib/demo").iterdir()) == ["__init__.py", "stray.py"]


def test_a_tree_outside_git_gives_an_sdist_without_build_leftovers(tmp_path: Path) -> None:
    root = _project(tmp_path / "tree")
    _plant_strays(root, tmp_path / "nothing")
    wheel, export = build_agent_wheel(root, tmp_path / "out")
    members = _members(wheel)
    assert export.kind == "sdist" and export.commit == ""
    assert "demo/core.py" in members and "demo/stray.py" not in members
    assert not (root / "demo.egg-info").exists(), "the sdist was built in the source tree"


def test_a_module_that_does_not_compile_never_reaches_the_image(tmp_path: Path) -> None:
    repo = _project(tmp_path / "repo")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    (repo / "demo/core.py").write_text("def run() -> int:\n    return (\n")  # half saved
    with pytest.raises(LockError, match=r"the agent wheel's demo/core\.py does not compile") as caught:
        build_agent_wheel(repo, tmp_path / "out")
    assert "tracked files as they are on disk" in caught.value.hint
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_an_sdist_is_asked_for_its_own_project_only_not_for_its_build_dependencies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--no-binary=:all:`` reached into pip's isolated build environment: on a machine without a pip cache,
    resolving tpm2-pytss's sdist then compiled cryptography from source (and failed). Only the requested
    project is forced to its sdist."""
    seen: list[list[str]] = []

    def fake_run(argv: list[str], **_kw: object) -> None:
        seen.append(argv)
        report = Path(argv[argv.index("--report") + 1])
        report.write_text(json.dumps({"install": []}))

    monkeypatch.setattr(wheelhouse, "run", fake_run)
    target = Target(python="3.12", glibc="2.39")
    wheelhouse.pip_report(
        ["tpm2_pytss==2.3.0"], target, "amd64", find_links=[], only_binary=False, no_deps=True
    )
    assert "--no-binary=tpm2-pytss" in seen[0]
    assert not [a for a in seen[0] if a.startswith("--no-binary=:all:") or a == "--only-binary=:all:"]
    with pytest.raises(LockError, match="project name"):
        wheelhouse.project_name("==1.0")
