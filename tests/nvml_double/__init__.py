"""A test double of libnvidia-ml.so.1 (``nvml_double.c``), built with gcc for the tests and the benchmark.

The real nvidia-ml-py bindings load it because the agent runs with ``LD_LIBRARY_PATH``
pointing at the directory :func:`build` fills; ``NVML_DOUBLE_FIXTURE`` names the file
it answers from. Not NVIDIA code; never installed anywhere.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "nvml_double.c"
LIBRARY = "libnvidia-ml.so.1"


class DoubleBuildError(RuntimeError):
    pass


def build(directory: Path) -> Path:
    """Compile the double into ``directory/libnvidia-ml.so.1``; return ``directory``."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise DoubleBuildError(
            "gcc is not installed (Debian: build-essential); the NVML test double needs it"
        )
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / LIBRARY
    argv = [
        gcc,
        "-std=c11",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-shared",
        "-fPIC",
        "-o",
        str(out),
        str(SOURCE),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DoubleBuildError(f"building the NVML test double failed:\n{result.stderr}")
    return directory
