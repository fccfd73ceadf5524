"""docs/gpu-checks.md stays true: every check with its source and default severity, every fixture case."""

from __future__ import annotations

import re
from pathlib import Path

from protocol.rules import RULES
from tests.gpu.harness import case_names

DOC = (Path(__file__).resolve().parents[2] / "docs" / "gpu-checks.md").read_text()


def test_every_check_is_documented_with_its_source_and_severity() -> None:
    pattern = r"^\| `([a-z0-9_]+\.[a-z0-9_.]+)` \|.*$"
    rows = {m.group(1): m.group(0) for m in re.finditer(pattern, DOC, re.MULTILINE)}
    assert set(rows) == {r.name for r in RULES}
    for rule in RULES:
        assert (
            rows[rule.name]
            == f"| `{rule.name}` | {rule.severity.value} | {rule.source} | {rule.passes_when} |"
        )


def test_every_fixture_case_is_documented() -> None:
    section = DOC[DOC.index("## Testing without GPUs") :]
    documented = set(re.findall(r"^\| `([a-z0-9-]+)`", section, re.MULTILINE))
    assert documented == set(case_names())


def test_the_missing_real_gpu_run_is_stated() -> None:
    assert "No real GPU was available" in DOC
