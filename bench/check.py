"""How long ``nodeagent check`` takes on an 8-GPU node: the issue's budget is 3 s.

No GPU machine is at hand, so the 8-GPU node is the healthy HGX H200 fixture: fake
PCI devices under umockdev (real libudev) and the NVML test double loaded by the real
pynvml. Each run is a fresh process (interpreter start, imports, every check, JSON
out), as systemd would start it. Printed: the median wall time of the whole process,
the median time the agent itself measured (``duration_ms``), their ratios to the 3 s
budget, and the ratio of the 8-GPU node to a node without GPUs.

    .venv/bin/python -m bench.check [--runs 7]

A real driver answers NVML calls more slowly than the double, so on hardware run
``time nodeagent check --pool <profile> --json`` as well; docs/gpu-checks.md says so.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tests.gpu.harness import load_case, prepare, run_check
from tests.nvml_double import build

BUDGET_S = 3.0


def measure(case_name: str, double: Path, work: Path, runs: int) -> tuple[float, float]:
    prepared = prepare(load_case(case_name), work / case_name)
    walls, inner = [], []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_check(prepared, double)
        walls.append(time.perf_counter() - start)
        inner.append(result.report().duration_ms / 1000)
    return statistics.median(walls), statistics.median(inner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        work = Path(tmp)
        double = build(work / "nvml-test-double")
        gpu_wall, gpu_inner = measure("healthy-hgx-h200", double, work, args.runs)
        cpu_wall, cpu_inner = measure("no-gpu-cpu-pool", double, work, args.runs)
    print(f"nodeagent check, median of {args.runs} fresh processes each")
    print(f"  8-GPU HGX H200 fixture: process {gpu_wall:.3f} s, checks {gpu_inner:.3f} s")
    print(f"  node without GPU:       process {cpu_wall:.3f} s, checks {cpu_inner:.3f} s")
    print(f"  ratio to the {BUDGET_S:.0f} s budget (8-GPU, whole process): {gpu_wall / BUDGET_S:.3f}")
    print(f"  ratio to the {BUDGET_S:.0f} s budget (8-GPU, checks only):   {gpu_inner / BUDGET_S:.3f}")
    print(f"  ratio 8-GPU / no-GPU (whole process): {gpu_wall / cpu_wall:.2f}")


if __name__ == "__main__":
    main()
