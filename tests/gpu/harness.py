"""Run ``nodeagent check`` against a GPU fixture, the honest way.

A fixture (``fixtures/<base>/``) is a machine description in three parts:

* ``pci.umockdev``: PCI devices in umockdev's text format; the agent runs under
  ``umockdev-run``, so the real libudev (through pyudev) reads them from a mock sysfs;
* ``nvml.conf``: what the NVML test double (``tests/nvml_double``) answers; the agent runs
  with ``LD_LIBRARY_PATH`` pointing at the double, so the real pynvml bindings load it;
* ``root/``: the files under /proc, /dev, /sys/fs, /var the agent reads (``--host-root``).

A case (``fixtures/cases/<name>.yaml``) names a base, edits it, names a pool profile
(``fixtures/pools/``) and says what verdict and reasons to expect. The benchmark uses
the same code, so it measures what the tests check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protocol.errors import ReportError
from protocol.report import Report, parse_report

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
CASES = FIXTURES / "cases"
POOLS = FIXTURES / "pools"

_CASE_KEYS = {"description", "base", "pool", "nvml", "pci", "root", "expect"}


class FixtureError(RuntimeError):
    """A case file is malformed or a tool the harness needs is missing."""


@dataclass(frozen=True)
class Expect:
    passed: bool
    failures: dict[str, str] = field(default_factory=dict)
    warnings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    base: str
    pool: Path
    nvml: str = ""
    pci_file: str | None = None
    pci_remove: tuple[str, ...] = ()
    pci_set: dict[str, dict[str, str]] = field(default_factory=dict)
    root_write: dict[str, str] = field(default_factory=dict)
    root_append: dict[str, str] = field(default_factory=dict)
    root_remove: tuple[str, ...] = ()
    expect: Expect = field(default_factory=lambda: Expect(passed=True))


def case_names() -> list[str]:
    return sorted(p.stem for p in CASES.glob("*.yaml"))


def load_case(name: str) -> Case:
    data: Any = yaml.safe_load((CASES / f"{name}.yaml").read_text(encoding="utf-8"))
    if not isinstance(data, dict) or set(data) - _CASE_KEYS or "expect" not in data:
        raise FixtureError(f"case {name}: keys must be within {sorted(_CASE_KEYS)} and include expect")
    pci, root, expect = data.get("pci") or {}, data.get("root") or {}, data["expect"]
    return Case(
        name=name,
        description=str(data.get("description", "")),
        base=str(data["base"]),
        pool=POOLS / str(data["pool"]),
        nvml=str(data.get("nvml") or ""),
        pci_file=pci.get("file"),
        pci_remove=tuple(pci.get("remove") or ()),
        pci_set={k: {a: str(v) for a, v in attrs.items()} for k, attrs in (pci.get("set") or {}).items()},
        root_write={k: str(v) for k, v in (root.get("write") or {}).items()},
        root_append={k: str(v) for k, v in (root.get("append") or {}).items()},
        root_remove=tuple(root.get("remove") or ()),
        expect=Expect(
            passed=bool(expect["passed"]),
            failures={k: str(v) for k, v in (expect.get("failures") or {}).items()},
            warnings={k: str(v) for k, v in (expect.get("warnings") or {}).items()},
        ),
    )


def edit_umockdev(text: str, remove: tuple[str, ...], attrs: dict[str, dict[str, str]]) -> str:
    """Drop or edit device records (by PCI address, the last component of ``P:``)."""
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    out = []
    for block in blocks:
        lines = block.splitlines()
        address = lines[0].rsplit("/", 1)[-1]
        if address in remove:
            continue
        for name, value in attrs.get(address, {}).items():
            if name == "driver":
                lines = [ln for ln in lines if not ln.startswith(("L: driver=", "E: DRIVER="))]
                if value:
                    depth = lines[0].removeprefix("P: ").count("/")
                    lines.insert(1, "L: driver=" + "../" * depth + f"bus/pci/drivers/{value}")
                continue
            lines = [ln for ln in lines if not ln.startswith(f"A: {name}=")] + [f"A: {name}={value}"]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


@dataclass(frozen=True)
class Prepared:
    pci: Path
    nvml: Path
    root: Path
    pool: Path


def prepare(case: Case, workdir: Path) -> Prepared:
    """Materialise a case under ``workdir``: an edited copy of the base, never the committed files."""
    base = FIXTURES / case.base
    root = workdir / "root"
    shutil.copytree(base / "root", root, symlinks=True)
    for rel in case.root_remove:
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    for rel, text in case.root_write.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for rel, text in case.root_append.items():
        with (root / rel).open("a", encoding="utf-8") as f:
            f.write(text)
    pci_source = FIXTURES / case.pci_file if case.pci_file else base / "pci.umockdev"
    pci = workdir / "pci.umockdev"
    pci.write_text(edit_umockdev(pci_source.read_text(encoding="utf-8"), case.pci_remove, case.pci_set))
    nvml = workdir / "nvml.conf"
    nvml.write_text((base / "nvml.conf").read_text(encoding="utf-8") + "\n# case\n" + case.nvml)
    return Prepared(pci=pci, nvml=nvml, root=root, pool=case.pool)


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise FixtureError(
            f"{tool} is not installed (Debian package {package}); the GPU fixture tests need it"
        )
    return path


@dataclass(frozen=True)
class AgentRun:
    returncode: int
    stdout: bytes
    stderr: str

    def report(self) -> Report:
        try:
            return parse_report(self.stdout.strip())
        except ReportError as exc:
            raise AssertionError(f"agent printed no valid report ({exc}); stderr:\n{self.stderr}") from exc


def run_check(
    prepared: Prepared,
    double_dir: Path,
    *,
    as_json: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> AgentRun:
    """``umockdev-run -d pci -- python -m agent.cli check --pool ... --host-root ...`` with the double."""
    umockdev = require("umockdev-run", "umockdev")
    argv = [
        umockdev,
        "-d",
        str(prepared.pci),
        "--",
        sys.executable,
        "-m",
        "agent.cli",
        "check",
        "--pool",
        str(prepared.pool),
        "--host-root",
        str(prepared.root),
    ]
    if as_json:
        argv.append("--json")
    full_env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(double_dir),
        "NVML_DOUBLE_FIXTURE": str(prepared.nvml),
        "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=timeout, env=full_env, check=False)
    return AgentRun(proc.returncode, proc.stdout, proc.stderr.decode("utf-8", "replace"))


def run_python(
    code: str,
    *,
    double_dir: Path | None = None,
    nvml: Path | None = None,
    pci: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh process, optionally under umockdev and with the NVML double."""
    argv = [sys.executable, "-c", code]
    if pci is not None:
        argv = [require("umockdev-run", "umockdev"), "-d", str(pci), "--", *argv]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    if double_dir is not None:
        full_env["LD_LIBRARY_PATH"] = str(double_dir)
    if nvml is not None:
        full_env["NVML_DOUBLE_FIXTURE"] = str(nvml)
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=full_env, check=False
    )
