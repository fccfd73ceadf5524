"""Everything the checks need from NVML, read in one session through nvidia-ml-py (``pynvml``).

NVML is initialised once (``nvmlInit``), every value is read, and NVML is shut
down; the result is a plain snapshot. A failed query is recorded as the NVML
error name (``NVML_ERROR_NOT_SUPPORTED``), never raised: the rules decide what
an error means. pynvml loads ``libnvidia-ml.so.1`` through the dynamic loader,
so the driver's library is found the usual way (ld.so.cache, ``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.report import JsonValue
from protocol.rules.nvml import NVLINK_MAX_LINKS

log = logging.getLogger(__name__)

Row = dict[str, JsonValue]

# nvml.h field identifiers (pynvml has the same names); read through nvmlDeviceGetFieldValues.
FI_NVLINK_LINK_COUNT = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
# nvmlValueType_t -> the member of the nvmlValue_t union that holds the value (no double: JSON has no floats).
_VALUE_MEMBERS = {1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


@dataclass
class GpuSnapshot:
    index: int
    bus_id: str | None = None
    error: str | None = None  # the GPU cannot be reached at all
    minor: int | None = None
    rows: dict[str, Row] = field(default_factory=dict)  # check name -> this GPU's row


@dataclass
class NvmlSnapshot:
    error: str | None = None
    message: str | None = None
    nvml_version: str | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    count: int = 0
    gpus: list[GpuSnapshot] = field(default_factory=list)


class _Nvml:
    """The pynvml module plus error naming; created inside :func:`collect` so importing costs nothing."""

    def __init__(self) -> None:
        import pynvml

        self.m: Any = pynvml
        self.names = {
            v: k for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_") and isinstance(v, int)
        }

    def code(self, exc: BaseException) -> str:
        value = getattr(exc, "value", None)
        return self.name(value) if isinstance(value, int) else type(exc).__name__

    def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
        try:
            return fn(*args), None
        except self.m.NVMLError as exc:
            return None, self.code(exc)

    def name(self, code: int) -> str:
        name: str = self.names.get(code, f"NVML_ERROR_{code}")
        return name

    def call_either(self, first: str, fallback: str, *args: Any) -> tuple[Any, str | None]:
        """Call ``first``; when an older driver lacks it (or its structure version), call ``fallback``."""
        value, err = self.call(getattr(self.m, first), *args)
        if err in ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH"):
            value, err = self.call(getattr(self.m, fallback), *args)
        return value, err


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def collect() -> NvmlSnapshot:
    """Initialise NVML once, read every GPU, shut NVML down."""
    try:
        nv = _Nvml()
    except ImportError as exc:
        return NvmlSnapshot(error="NVML_ERROR_LIBRARY_NOT_FOUND", message=f"nvidia-ml-py missing: {exc}")
    m = nv.m
    try:
        m.nvmlInit()
    except m.NVMLError as exc:
        log.info("nvmlInit failed: %s", exc)
        return NvmlSnapshot(error=nv.code(exc), message=str(exc))
    try:
        snap = NvmlSnapshot()
        value, _ = nv.call(m.nvmlSystemGetNVMLVersion)
        snap.nvml_version = _text(value) if value is not None else None
        value, _ = nv.call(m.nvmlSystemGetDriverVersion)
        snap.driver_version = _text(value) if value is not None else None
        snap.cuda_driver_version, _ = nv.call(m.nvmlSystemGetCudaDriverVersion_v2)
        count, err = nv.call(m.nvmlDeviceGetCount)
        if err is not None:
            return NvmlSnapshot(error=err, message="nvmlDeviceGetCount failed")
        snap.count = int(count)
        snap.gpus = [_gpu(nv, i) for i in range(snap.count)]
        return snap
    finally:
        try:
            m.nvmlShutdown()
        except m.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)


def _gpu(nv: _Nvml, index: int) -> GpuSnapshot:
    m = nv.m
    gpu = GpuSnapshot(index=index)
    try:
        handle = m.nvmlDeviceGetHandleByIndex(index)
        gpu.bus_id = _text(m.nvmlDeviceGetPciInfo_v3(handle).busId)
        uuid = _text(m.nvmlDeviceGetUUID(handle))
    except m.NVMLError as exc:
        gpu.error = nv.code(exc)
        log.warning("GPU %d unreachable through NVML: %s", index, gpu.error)
        return gpu
    gpu.minor, _ = nv.call(m.nvmlDeviceGetMinorNumber, handle)

    def row(**values: JsonValue) -> Row:
        return {"index": index, "bus_id": gpu.bus_id, **values}

    name, err = nv.call(m.nvmlDeviceGetName, handle)
    gpu.rows["gpu.model"] = row(name=_text(name) if name is not None else None, error=err)
    serial, serial_err = nv.call(m.nvmlDeviceGetSerial, handle)
    gpu.rows["gpu.identity"] = row(
        uuid=uuid, serial=_text(serial) if serial is not None else None, serial_error=serial_err
    )
    gpu.rows["gpu.pcie"] = _pcie(nv, handle, row)
    mode, err = nv.call(m.nvmlDeviceGetEccMode, handle)
    gpu.rows["gpu.ecc.mode"] = row(
        current=mode[0] if mode else None, pending=mode[1] if mode else None, error=err
    )
    unc, err = nv.call(
        m.nvmlDeviceGetTotalEccErrors, handle, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC
    )
    gpu.rows["gpu.ecc.errors"] = row(volatile_uncorrected=unc, error=err)
    gpu.rows["gpu.memory"] = row(remapped_rows=_remapped(nv, handle), retired_pages=_retired(nv, handle))
    pm, err = nv.call(m.nvmlDeviceGetPersistenceMode, handle)
    gpu.rows["gpu.persistence_mode"] = row(
        enabled=None if pm is None else pm == m.NVML_FEATURE_ENABLED, error=err
    )
    mig, err = nv.call(m.nvmlDeviceGetMigMode, handle)
    gpu.rows["gpu.mig"] = row(current=mig[0] if mig else None, pending=mig[1] if mig else None, error=err)
    temp, err = nv.call_either(
        "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature", handle, m.NVML_TEMPERATURE_GPU
    )
    reasons, err2 = nv.call_either(
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", handle
    )
    gpu.rows["gpu.thermal"] = row(temperature_c=temp, clocks_event_reasons=reasons, error=err or err2)
    gpu.rows["gpu.fabric"] = row(**_fabric(nv, handle))
    _, err = nv.call(m.nvmlDeviceValidateInforom, handle)
    gpu.rows["gpu.inforom"] = row(error=err)
    fields, fields_err = _fields(nv, handle, (FI_NVLINK_LINK_COUNT, FI_GPU_RECOVERY_ACTION))
    action, action_err = fields.get(FI_GPU_RECOVERY_ACTION, (None, None))
    gpu.rows["gpu.recovery_action"] = row(action=action, error=fields_err, field_error=action_err)
    gpu.rows["gpu.nvlink"] = row(
        **_nvlink(nv, handle, *fields.get(FI_NVLINK_LINK_COUNT, (None, fields_err)))
    )
    gpu.rows["gpu.processes"] = row(**_processes(nv, handle))
    return gpu


def _pcie(nv: _Nvml, handle: Any, row: Callable[..., Row]) -> Row:
    m = nv.m
    values: dict[str, JsonValue] = {}
    first_error = None
    for key, fn in (
        ("curr_gen", m.nvmlDeviceGetCurrPcieLinkGeneration),
        ("max_gen", m.nvmlDeviceGetMaxPcieLinkGeneration),
        ("curr_width", m.nvmlDeviceGetCurrPcieLinkWidth),
        ("max_width", m.nvmlDeviceGetMaxPcieLinkWidth),
    ):
        values[key], err = nv.call(fn, handle)
        first_error = first_error or err
    values["gpu_max_gen"], _ = nv.call(m.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle)
    return row(**values, error=first_error)


def _remapped(nv: _Nvml, handle: Any) -> Row:
    value, err = nv.call(nv.m.nvmlDeviceGetRemappedRows, handle)
    if err is not None:
        return {"correctable": None, "uncorrectable": None, "pending": None, "failure": None, "error": err}
    corr, unc, pending, failure = value
    return {"correctable": corr, "uncorrectable": unc, "pending": pending, "failure": failure, "error": None}


def _retired(nv: _Nvml, handle: Any) -> Row:
    m = nv.m
    counts = []
    for cause in (
        m.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        m.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    ):
        pages, err = nv.call(m.nvmlDeviceGetRetiredPages, handle, cause)
        if err is not None:
            return {"single_bit": None, "double_bit": None, "pending": None, "error": err}
        counts.append(len(pages))
    pending, err = nv.call(m.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if err is not None:
        return {"single_bit": None, "double_bit": None, "pending": None, "error": err}
    return {"single_bit": counts[0], "double_bit": counts[1], "pending": int(pending), "error": None}


def _fabric(nv: _Nvml, handle: Any) -> dict[str, JsonValue]:
    """nvmlDeviceGetGpuFabricInfoV with the v3 structure, or v2 where the driver predates v3."""
    m = nv.m
    empty: dict[str, JsonValue] = {
        "state": None,
        "status": None,
        "clique_id": None,
        "cluster_uuid": None,
        "health_mask": None,
    }
    err: str | None = "NVML_ERROR_FUNCTION_NOT_FOUND"
    info: Any = None
    for struct_name in ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t"):
        struct = getattr(m, struct_name, None)
        if struct is None:
            continue
        info = struct()
        _, err = nv.call(m.nvmlDeviceGetGpuFabricInfoV, handle, ctypes.byref(info))
        if err != "NVML_ERROR_ARGUMENT_VERSION_MISMATCH":
            break
    if err is not None or info is None:
        return {**empty, "error": err}
    raw = bytes(info.clusterUuid)
    h = raw.hex()
    return {
        "state": int(info.state),
        "status": int(info.status),
        "clique_id": int(info.cliqueId),
        "cluster_uuid": f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}",
        "health_mask": int(info.healthMask),
        "error": None,
    }


def _fields(
    nv: _Nvml, handle: Any, ids: tuple[int, ...]
) -> tuple[dict[int, tuple[int | None, str | None]], str | None]:
    """nvmlDeviceGetFieldValues in one call: ({field id: (value, the field's own nvmlReturn)}, the call's error).

    A driver that does not know a field answers the call with success and puts the error
    (``NOT_SUPPORTED``, or ``INVALID_ARGUMENT`` for an unknown id) in that field's ``nvmlReturn``.
    """
    values, err = nv.call(nv.m.nvmlDeviceGetFieldValues, handle, list(ids))
    if err is not None:
        return {}, err
    out: dict[int, tuple[int | None, str | None]] = {}
    for field_id, fv in zip(ids, values, strict=True):
        if int(fv.nvmlReturn) != 0:
            out[field_id] = (None, nv.name(int(fv.nvmlReturn)))
            continue
        member = _VALUE_MEMBERS.get(int(fv.valueType))
        if member is None:
            out[field_id] = (None, f"NVML_VALUE_TYPE_{int(fv.valueType)}")
            continue
        out[field_id] = (int(getattr(fv.value, member)), None)
    return out, None


def _nvlink(nv: _Nvml, handle: Any, count: int | None, count_error: str | None) -> dict[str, JsonValue]:
    """nvmlDeviceGetNvLinkState for each link below the link count.

    Without the count field (``count_error``), links are probed from 0 up to
    NVML_NVLINK_MAX_LINKS until one answers NOT_SUPPORTED or INVALID_ARGUMENT.
    """
    m = nv.m
    links: list[JsonValue] = []
    if count is not None:
        for link in range(min(count, NVLINK_MAX_LINKS)):
            state, err = nv.call(m.nvmlDeviceGetNvLinkState, handle, link)
            links.append({"link": link, "state": state, "error": err})
    else:
        for link in range(NVLINK_MAX_LINKS):
            state, err = nv.call(m.nvmlDeviceGetNvLinkState, handle, link)
            if err in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                break
            links.append({"link": link, "state": state, "error": err})
    return {"link_count": count, "count_error": count_error, "links": links}


def _processes(nv: _Nvml, handle: Any) -> dict[str, JsonValue]:
    """Compute and graphics processes (v3 calls, v2 on drivers that predate them)."""
    out: dict[str, JsonValue] = {}
    for kind, first, fallback in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
    ):
        procs, err = nv.call_either(first, fallback, handle)
        rows: list[JsonValue] = []
        for p in procs or []:
            used = p.usedGpuMemory
            rows.append({"pid": int(p.pid), "used_memory": None if used is None else int(used)})
        out[kind], out[f"{kind}_error"] = rows, err
    return out
