"""Gather every GPU observation: PCI, driver, NVML (one session), daemons, XIDs."""

from __future__ import annotations

import logging

from agent.gpu import driver, nvml, pci, xid
from agent.host import Host
from protocol.report import JsonValue, Observation

log = logging.getLogger(__name__)

# Checks whose observations are one row per GPU that NVML can reach.
PER_GPU_CHECKS = (
    ("gpu.model", "nvmlDeviceGetName"),
    ("gpu.identity", "nvmlDeviceGetUUID, nvmlDeviceGetSerial"),
    (
        "gpu.pcie",
        "nvmlDeviceGetCurrPcieLinkGeneration, nvmlDeviceGetMaxPcieLinkGeneration, "
        "nvmlDeviceGetGpuMaxPcieLinkGeneration, nvmlDeviceGetCurrPcieLinkWidth, "
        "nvmlDeviceGetMaxPcieLinkWidth",
    ),
    ("gpu.ecc.mode", "nvmlDeviceGetEccMode"),
    ("gpu.ecc.errors", "nvmlDeviceGetTotalEccErrors(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)"),
    (
        "gpu.memory",
        "nvmlDeviceGetRemappedRows, nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPagesPendingStatus",
    ),
    ("gpu.persistence_mode", "nvmlDeviceGetPersistenceMode"),
    ("gpu.mig", "nvmlDeviceGetMigMode"),
    (
        "gpu.thermal",
        "nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU), nvmlDeviceGetCurrentClocksEventReasons",
    ),
    ("gpu.fabric", "nvmlDeviceGetGpuFabricInfoV"),
    ("gpu.inforom", "nvmlDeviceValidateInforom"),
    ("gpu.recovery_action", "nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)"),
    (
        "gpu.nvlink",
        "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_LINK_COUNT), nvmlDeviceGetNvLinkState",
    ),
    (
        "gpu.processes",
        "nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetGraphicsRunningProcesses_v3",
    ),
)
PERSISTENCED = "nvidia-persistenced"
FABRICMANAGER = "nv-fabricmanager"


def collect(host: Host) -> list[Observation]:
    functions, inventory = pci.observe()
    version = driver.driver_version(host)
    snap = nvml.collect()
    gpu_count = sum(1 for f in functions if f.pci_class.startswith(("0x0300", "0x0302")))
    minors = [g.minor for g in snap.gpus if g.minor is not None] if snap.error is None else []
    if snap.error is not None or not minors:
        minors = list(range(gpu_count))
    daemons = driver.processes(host, (PERSISTENCED, FABRICMANAGER))
    reachable = [g for g in snap.gpus if g.error is None]
    out = [
        inventory,
        Observation(
            "gpu.pci.driver",
            "pyudev: Device.driver (the sysfs driver link) of each NVIDIA PCI function",
            {"drivers": {f.address: f.driver for f in functions}},
        ),
        Observation(
            "gpu.driver.module",
            "/sys/module/<name>, /proc/modules",
            {"modules": dict(driver.loaded_modules(host))},
        ),
        Observation("gpu.driver.version", driver.VERSION_FILE, version),
        Observation(
            "gpu.driver.devices",
            "stat(2) of /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia<minor>",
            {"nodes": driver.device_nodes(host, minors)},
        ),
        _daemon("gpu.driver.persistenced", PERSISTENCED, daemons),
        Observation(
            "gpu.nvml.init",
            "nvmlInit, nvmlSystemGetNVMLVersion, nvmlSystemGetDriverVersion, "
            "nvmlSystemGetCudaDriverVersion_v2",
            {
                "error": snap.error,
                "message": snap.message,
                "nvml_version": snap.nvml_version,
                "driver_version": snap.driver_version,
                "cuda_driver_version": snap.cuda_driver_version,
            },
        ),
        Observation(
            "gpu.nvml.driver_match",
            f"nvmlSystemGetDriverVersion vs {driver.VERSION_FILE}",
            {"nvml_driver_version": snap.driver_version, "kernel_driver_version": version["version"]},
        ),
        Observation(
            "gpu.cuda.version",
            "nvmlSystemGetCudaDriverVersion_v2",
            {"cuda_driver_version": snap.cuda_driver_version},
        ),
        Observation(
            "gpu.nvml.count",
            "nvmlDeviceGetCount_v2, nvmlDeviceGetPciInfo_v3",
            {"count": snap.count, "bus_ids": [g.bus_id for g in reachable if g.bus_id]},
        ),
        Observation(
            "gpu.nvml.devices",
            "nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetPciInfo_v3, nvmlDeviceGetUUID, "
            "nvmlDeviceGetMinorNumber",
            {
                "gpus": [
                    {"index": g.index, "bus_id": g.bus_id, "minor": g.minor, "error": g.error}
                    for g in snap.gpus
                ]
            },
        ),
    ]
    for name, source in PER_GPU_CHECKS:
        rows: list[JsonValue] = [g.rows[name] for g in reachable if name in g.rows]
        out.append(Observation(name, source, {"gpus": rows}))
    out.append(_daemon("gpu.fabricmanager", FABRICMANAGER, daemons))
    out.append(xid.observe(host))
    return out


def _daemon(name: str, comm: str, daemons: dict[str, list[int]]) -> Observation:
    pids: list[JsonValue] = list(daemons.get(comm, []))
    return Observation(
        name, f"/proc/<pid>/comm == {comm[: driver.COMM_LEN]}", {"running": bool(pids), "pids": pids}
    )
