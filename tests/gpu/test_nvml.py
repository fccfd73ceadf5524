"""NVML through the real pynvml bindings: against the test double always, against the driver where one exists."""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Any

import pytest

from protocol.rules.gpu import norm_bdf
from tests.gpu.harness import FIXTURES, run_python

pytestmark = pytest.mark.subprocess

SNAPSHOT = "import dataclasses, json; from agent.gpu import nvml; print(json.dumps(dataclasses.asdict(nvml.collect())))"
HEALTHY = FIXTURES / "hgx-h200-8" / "nvml.conf"


def _real_library() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


BACKENDS = ["double", *(["real"] if _real_library() else [])]


def snapshot(double: Path | None, conf: Path | None) -> dict[str, Any]:
    proc = run_python(SNAPSHOT, double_dir=double, nvml=conf)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _conf(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "nvml.conf"
    path.write_text(HEALTHY.read_text() + "\n" + extra + "\n")
    return path


def test_values_come_through_pynvml(nvml_double: Path) -> None:
    snap = snapshot(nvml_double, HEALTHY)
    assert snap["error"] is None
    assert (snap["driver_version"], snap["nvml_version"], snap["cuda_driver_version"]) == (
        "570.124.06",
        "12.570.124.06",
        12080,
    )
    assert snap["count"] == 8 and [g["minor"] for g in snap["gpus"]] == list(range(8))
    assert snap["gpus"][3]["bus_id"] == "00000000:5D:00.0"
    gpu = snap["gpus"][0]["rows"]
    assert gpu["gpu.model"]["name"] == "NVIDIA H200"
    assert gpu["gpu.identity"]["uuid"] == "GPU-3a1c5e2f-6b7d-4e8f-9a0b-1c2d3e4f5a60"
    assert gpu["gpu.pcie"] | {"bus_id": None} == {
        "index": 0, "bus_id": None, "curr_gen": 5, "max_gen": 5, "gpu_max_gen": 5,
        "curr_width": 16, "max_width": 16, "error": None,
    }  # fmt: skip
    assert gpu["gpu.memory"]["retired_pages"]["error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert gpu["gpu.thermal"]["temperature_c"] == 34 and gpu["gpu.thermal"]["clocks_event_reasons"] == 1
    fabric = gpu["gpu.fabric"]
    assert (fabric["state"], fabric["status"], fabric["clique_id"]) == (3, 0, 32766)
    assert fabric["cluster_uuid"] == "5e0c1f3a-9d2b-4c7e-8f10-a2b3c4d5e6f7"


def test_new_checklist_rows_come_through_pynvml(nvml_double: Path) -> None:
    gpu = snapshot(nvml_double, HEALTHY)["gpus"][7]["rows"]
    assert gpu["gpu.inforom"] == {"index": 7, "bus_id": "00000000:DB:00.0", "error": None}
    assert gpu["gpu.recovery_action"] | {"bus_id": None} == {
        "index": 7, "bus_id": None, "action": 0, "error": None, "field_error": None,
    }  # fmt: skip
    nvlink = gpu["gpu.nvlink"]
    assert (nvlink["link_count"], nvlink["count_error"]) == (18, None)
    assert nvlink["links"] == [{"link": n, "state": 1, "error": None} for n in range(18)]
    assert gpu["gpu.processes"] | {"bus_id": None} == {
        "index": 7, "bus_id": None, "compute": [], "compute_error": None, "graphics": [],
        "graphics_error": None,
    }  # fmt: skip


def test_new_checklist_failures_are_recorded(nvml_double: Path, tmp_path: Path) -> None:
    conf = _conf(
        tmp_path,
        "\n".join(
            [
                "gpu.0.inforom_error=14",
                "gpu.1.fail.nvmlDeviceValidateInforom=3",
                "gpu.2.recovery_action=4",
                "gpu.3.field_error.230=3",
                "gpu.4.nvlink_down=0,17",
                "gpu.5.nvlink_count=0",
                # an older driver without the link-count field: links are probed
                "gpu.6.field_error.91=2",
                "gpu.6.nvlink_count=4",
                "gpu.6.nvlink_down=2",
                # more processes than the first call's guess (count 0): the two-call size protocol
                "gpu.7.compute_procs=4242:1610612736,4243:1048576,4244:0",
                "gpu.7.graphics_procs=901:65536",
                "gpu.1.fail.nvmlDeviceGetGraphicsRunningProcesses_v3=3",
            ]
        ),
    )
    gpus = [g["rows"] for g in snapshot(nvml_double, conf)["gpus"]]
    assert gpus[0]["gpu.inforom"]["error"] == "NVML_ERROR_CORRUPTED_INFOROM"
    assert gpus[1]["gpu.inforom"]["error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert gpus[2]["gpu.recovery_action"]["action"] == 4
    assert (gpus[3]["gpu.recovery_action"]["action"], gpus[3]["gpu.recovery_action"]["field_error"]) == (
        None,
        "NVML_ERROR_NOT_SUPPORTED",
    )
    assert [ln["link"] for ln in gpus[4]["gpu.nvlink"]["links"] if ln["state"] != 1] == [0, 17]
    assert (gpus[5]["gpu.nvlink"]["link_count"], gpus[5]["gpu.nvlink"]["links"]) == (0, [])
    probed = gpus[6]["gpu.nvlink"]
    assert (probed["link_count"], probed["count_error"]) == (None, "NVML_ERROR_INVALID_ARGUMENT")
    assert [ln["state"] for ln in probed["links"]] == [1, 1, 0, 1]
    procs = gpus[7]["gpu.processes"]
    assert procs["compute"] == [
        {"pid": 4242, "used_memory": 1610612736},
        {"pid": 4243, "used_memory": 1048576},
        {"pid": 4244, "used_memory": 0},
    ]
    assert procs["graphics"] == [{"pid": 901, "used_memory": 65536}]
    assert (gpus[1]["gpu.processes"]["graphics"], gpus[1]["gpu.processes"]["graphics_error"]) == (
        [],
        "NVML_ERROR_NOT_SUPPORTED",
    )


def test_double_structures_match_pynvml_byte_for_byte() -> None:
    """The _Static_asserts in the double state nvml.h's layout; pynvml's ctypes structures must agree."""
    import pynvml

    source = (Path(__file__).resolve().parents[1] / "nvml_double" / "nvml_double.c").read_text()
    structs = {
        "nvmlFieldValue_t": pynvml.c_nvmlFieldValue_t,
        "nvmlProcessInfo_t": pynvml.c_nvmlProcessInfo_v3_t,
    }
    sizes = re.findall(r"_Static_assert\(sizeof\((\w+)\) == (\d+)", source)
    offsets = re.findall(r"_Static_assert\(offsetof\((\w+), (\w+)\) == (\d+)", source)
    assert {name for name, _ in sizes} == set(structs) and len(offsets) >= 6
    for name, size in sizes:
        assert ctypes.sizeof(structs[name]) == int(size), name
    for name, member, offset in offsets:
        assert getattr(structs[name], member).offset == int(offset), (name, member)


def test_a_failing_query_is_recorded_not_raised(nvml_double: Path, tmp_path: Path) -> None:
    conf = _conf(tmp_path, "gpu.4.fail.nvmlDeviceGetRemappedRows=999\ngpu.5.fail.nvmlDeviceGetEccMode=3")
    gpus = snapshot(nvml_double, conf)["gpus"]
    assert gpus[4]["rows"]["gpu.memory"]["remapped_rows"]["error"] == "NVML_ERROR_UNKNOWN"
    assert gpus[5]["rows"]["gpu.ecc.mode"] == {
        "index": 5, "bus_id": "00000000:AB:00.0", "current": None, "pending": None,
        "error": "NVML_ERROR_NOT_SUPPORTED",
    }  # fmt: skip
    assert gpus[4]["rows"]["gpu.ecc.mode"]["current"] == 1


def test_unreachable_gpu(nvml_double: Path, tmp_path: Path) -> None:
    gpus = snapshot(nvml_double, _conf(tmp_path, "gpu.3.handle_error=15\ngpu.6.error=16"))["gpus"]
    assert (gpus[3]["error"], gpus[3]["rows"]) == ("NVML_ERROR_GPU_IS_LOST", {})
    assert gpus[6]["error"] == "NVML_ERROR_RESET_REQUIRED"
    assert [g["error"] for g in gpus].count(None) == 6


@pytest.mark.parametrize(
    ("code", "name", "message"),
    [
        (9, "NVML_ERROR_DRIVER_NOT_LOADED", "Driver Not Loaded"),
        (18, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "RM has detected an NVML/RM version mismatch."),
    ],
)
def test_init_failure(nvml_double: Path, tmp_path: Path, code: int, name: str, message: str) -> None:
    snap = snapshot(nvml_double, _conf(tmp_path, f"init_error={code}"))
    assert (snap["error"], snap["message"], snap["count"]) == (name, message, 0)


def test_fabric_falls_back_to_v2_struct(nvml_double: Path, tmp_path: Path) -> None:
    rows = snapshot(nvml_double, _conf(tmp_path, "fabric_max_version=2"))["gpus"][0]["rows"]
    assert rows["gpu.fabric"]["state"] == 3 and rows["gpu.fabric"]["error"] is None


def _sysfs_gpus() -> list[str]:
    base = Path("/sys/bus/pci/devices")
    if not base.is_dir():
        return []
    return sorted(
        p.name
        for p in base.iterdir()
        if (p / "vendor").read_text().strip() == "0x10de"
        and (p / "class").read_text().strip().startswith(("0x0300", "0x0302"))
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_with_the_pci_bus_and_the_kernel_driver(backend: str, nvml_double: Path) -> None:
    """Invariants that hold for the double on its fixture and for a real driver on its machine."""
    if backend == "double":
        snap = snapshot(nvml_double, HEALTHY)
        text = (FIXTURES / "hgx-h200-8" / "pci.umockdev").read_text()
        pci_gpus = sorted(
            b.splitlines()[0].rsplit("/", 1)[1] for b in text.split("\n\n") if "A: class=0x0302" in b
        )
        kernel = (FIXTURES / "hgx-h200-8" / "root/proc/driver/nvidia/version").read_text()
    else:
        snap = snapshot(None, None)
        pci_gpus = _sysfs_gpus()
        kernel = Path("/proc/driver/nvidia/version").read_text()
    assert snap["error"] is None, snap["message"]
    assert snap["count"] == len(pci_gpus)
    assert sorted(norm_bdf(g["bus_id"]) for g in snap["gpus"]) == pci_gpus
    assert snap["driver_version"] in kernel
    assert isinstance(snap["cuda_driver_version"], int) and snap["cuda_driver_version"] >= 10000
    for g in snap["gpus"]:
        assert re.fullmatch(r"GPU-[0-9a-f-]{36}", g["rows"]["gpu.identity"]["uuid"])
        assert g["rows"]["gpu.pcie"]["max_width"] >= g["rows"]["gpu.pcie"]["curr_width"] > 0
