"""Every check the agent runs: its name, default severity, source, and the rule that judges it.

``RULES`` is the single list both sides use: the agent runs a collector for each
name and the server requires each name in a report. The order is the order of
the report and of ``docs/gpu-checks.md``.
"""

from __future__ import annotations

from protocol.rules import gpu, node, nvml
from protocol.rules.base import Context, Malformed, Obs, Outcome, Rule, Severity

FATAL = Severity.FATAL
WARN = Severity.WARN

RULES: tuple[Rule, ...] = (
    # ----------------------------------------------------------------- GPU: PCI and driver
    Rule(
        "gpu.pci.inventory",
        FATAL,
        "pyudev: subsystem=pci, vendor 0x10de; sysfs class, device, driver, numa_node, link attributes",
        "the number of NVIDIA GPUs (class 0x0300/0x0302) equals the pool's count (none for a CPU pool)",
        gpu._inventory,
    ),
    Rule(
        "gpu.pci.driver",
        FATAL,
        "pyudev: the driver bound to each NVIDIA PCI function (sysfs driver link)",
        "GPUs bound to nvidia, NVSwitches (class 0x0680) to nvidia-nvswitch; not vfio-pci, nouveau or none",
        gpu._pci_driver,
    ),
    Rule(
        "gpu.driver.module",
        FATAL,
        "/sys/module/<name> and /proc/modules",
        "nvidia and nvidia_uvm loaded (nvidia_modeset, nvidia_peermem reported)",
        gpu._module,
    ),
    Rule(
        "gpu.driver.version",
        FATAL,
        "/proc/driver/nvidia/version (first line)",
        "a driver is loaded and its version is at least the pool's min_driver",
        gpu._driver_version,
    ),
    Rule(
        "gpu.driver.devices",
        FATAL,
        "stat(2) of /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia<minor> "
        "(minor from nvmlDeviceGetMinorNumber)",
        "each is a character device",
        gpu._device_nodes,
    ),
    Rule(
        "gpu.driver.persistenced",
        FATAL,
        "/proc/<pid>/comm of every process (nvidia-persiste)",
        "nvidia-persistenced runs, when the pool sets persistence_required",
        gpu._persistenced,
    ),
    # ----------------------------------------------------------------- GPU: NVML
    Rule(
        "gpu.nvml.init",
        FATAL,
        "nvmlInitWithFlags(0), nvmlSystemGetNVMLVersion, nvmlSystemGetDriverVersion",
        "NVML initialises",
        nvml._nvml_init,
    ),
    Rule(
        "gpu.nvml.driver_match",
        FATAL,
        "nvmlSystemGetDriverVersion vs /proc/driver/nvidia/version",
        "the user-space library and the kernel module have the same version",
        nvml._driver_match,
    ),
    Rule(
        "gpu.cuda.version",
        FATAL,
        "nvmlSystemGetCudaDriverVersion_v2",
        "the CUDA driver API version is at least the pool's min_cuda",
        nvml._cuda,
    ),
    Rule(
        "gpu.nvml.count",
        FATAL,
        "nvmlDeviceGetCount_v2, nvmlDeviceGetPciInfo_v3().busId vs the PCI inventory",
        "NVML counts as many GPUs as the PCI bus has, and every NVML bus ID is one of them",
        nvml._count,
    ),
    Rule(
        "gpu.nvml.devices",
        FATAL,
        "nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetPciInfo_v3, nvmlDeviceGetUUID, "
        "nvmlDeviceGetMinorNumber",
        "every GPU answers (no GPU_IS_LOST, RESET_REQUIRED, UNKNOWN)",
        nvml._devices,
    ),
    Rule("gpu.model", FATAL, "nvmlDeviceGetName", "every GPU is the pool's gpu.model", nvml._model),
    Rule(
        "gpu.identity",
        FATAL,
        "nvmlDeviceGetUUID, nvmlDeviceGetSerial",
        "every GPU has a UUID (UUIDs and serials go to the server)",
        nvml._identity,
    ),
    Rule(
        "gpu.inforom",
        FATAL,
        "nvmlDeviceValidateInforom",
        "the infoROM of every GPU is valid (skipped where NOT_SUPPORTED)",
        nvml._inforom,
    ),
    Rule(
        "gpu.pcie",
        FATAL,
        "nvmlDeviceGetCurrPcieLinkWidth/GetMaxPcieLinkWidth, "
        "GetCurrPcieLinkGeneration/GetMaxPcieLinkGeneration, "
        "GetGpuMaxPcieLinkGeneration",
        "current width equals the maximum (fails); current generation below the maximum warns",
        nvml._pcie,
    ),
    Rule(
        "gpu.ecc.mode",
        FATAL,
        "nvmlDeviceGetEccMode (current, pending)",
        "ECC enabled and no change pending",
        nvml._ecc_mode,
    ),
    Rule(
        "gpu.ecc.errors",
        FATAL,
        "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)",
        "no uncorrectable ECC error since the driver loaded",
        nvml._ecc_errors,
    ),
    Rule(
        "gpu.memory",
        FATAL,
        "nvmlDeviceGetRemappedRows; nvmlDeviceGetRetiredPages (both causes), "
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "no pending or failed row remap, fewer than 512 uncorrectable remaps, "
        "no pending retirement, at most 63 retired pages",
        nvml._memory,
    ),
    Rule(
        "gpu.recovery_action",
        FATAL,
        "nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)",
        "the driver requests no recovery action (NVML_GPU_RECOVERY_ACTION_NONE) on any GPU "
        "(skipped on drivers without the field)",
        nvml._recovery_action,
    ),
    Rule(
        "gpu.persistence_mode",
        FATAL,
        "nvmlDeviceGetPersistenceMode",
        "enabled (fails when the pool sets persistence_required, warns otherwise)",
        nvml._persistence_mode,
    ),
    Rule(
        "gpu.mig",
        FATAL,
        "nvmlDeviceGetMigMode (current, pending)",
        "matches the pool's mig (disabled, enabled, any) and no change pending",
        nvml._mig,
    ),
    Rule(
        "gpu.thermal",
        WARN,
        "nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU), nvmlDeviceGetCurrentClocksEventReasons",
        "no hardware slowdown, thermal slowdown or power brake",
        nvml._thermal,
    ),
    Rule(
        "gpu.nvlink",
        FATAL,
        "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_LINK_COUNT) (else links probed below "
        "NVML_NVLINK_MAX_LINKS), nvmlDeviceGetNvLinkState per link",
        "every NVLink of every GPU active, and as many as the pool's nvlink_count; "
        "a GPU without NVLink fails when the fabric is required, else is skipped",
        nvml._nvlink,
    ),
    Rule(
        "gpu.fabric",
        FATAL,
        "nvmlDeviceGetGpuFabricInfoV (v3, else v2): state, status, cliqueId, clusterUuid, healthMask",
        "state COMPLETED with status SUCCESS on every GPU when the fabric is required",
        nvml._fabric,
    ),
    Rule(
        "gpu.fabricmanager",
        FATAL,
        "/proc/<pid>/comm of every process (nv-fabricmanager)",
        "Fabric Manager runs when the fabric is required",
        gpu._fabricmanager,
    ),
    Rule(
        "gpu.processes",
        WARN,
        "nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetGraphicsRunningProcesses_v3",
        "no compute or graphics process on any GPU (nothing runs before the node joins)",
        nvml._processes,
    ),
    Rule(
        "gpu.xid",
        FATAL,
        "journalctl -k -b (else /dev/kmsg): lines 'NVRM: Xid (PCI:<bdf>): <n>, ...'",
        "no XID since boot other than the application XIDs 13, 31, 43, 45, 68, 109",
        nvml._xid,
    ),
    # ----------------------------------------------------------------- node preflight
    Rule(
        "node.time_sync",
        WARN,
        "adjtimex(2): maxerror (and status, state)",
        "the kernel clock is synchronised: maxerror below 16 s, as systemd's ntp_synced() judges it",
        node._time_sync,
    ),
    Rule("node.swap", FATAL, "/proc/swaps", "no active swap", node._swap),
    Rule(
        "node.kernel_modules",
        FATAL,
        "/proc/modules, /sys/module/<name>, /proc/filesystems (overlay), "
        "/proc/sys/net/bridge (br_netfilter)",
        "overlay and br_netfilter available",
        node._modules,
    ),
    Rule(
        "node.sysctl",
        FATAL,
        "/proc/sys/net/ipv4/ip_forward, /proc/sys/net/bridge/bridge-nf-call-ip{,6}tables",
        "all three are 1",
        node._sysctl,
    ),
    Rule(
        "node.cgroup",
        FATAL,
        "/proc/1/mountinfo (type at /sys/fs/cgroup), /sys/fs/cgroup/cgroup.controllers",
        "cgroup v2 with the cpu, memory and pids controllers",
        node._cgroup,
    ),
    Rule(
        "node.container_runtime",
        FATAL,
        "`containerd --version` / `crio --version`; "
        "/run/containerd/containerd.sock, /var/run/crio/crio.sock",
        "a runtime is installed (version reported) and its socket exists",
        node._runtime,
    ),
    Rule(
        "node.network",
        FATAL,
        "/proc/net/fib_trie (local addresses), /proc/net/route (default route)",
        "a global IPv4 address and an IPv4 default route",
        node._network,
    ),
    Rule(
        "node.disk",
        FATAL,
        "statvfs(2) of /var/lib/containerd and /var/log (nearest existing parent)",
        "free space at least the pool's min_free_disk_gib on each",
        node._disk,
    ),
    Rule(
        "node.hostname",
        FATAL,
        "/proc/sys/kernel/hostname",
        "lower-cased (as kubelet and kubeadm do), a valid node name: RFC 1123 subdomain, at most 253 characters",
        node._hostname,
    ),
    Rule(
        "node.kubelet",
        FATAL,
        "`kubelet --version`",
        "kubelet installed; within the skew policy of the pool's control_plane_version "
        "(at most 3 minors older, never newer)",
        node._kubelet,
    ),
)

RULES_BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
CHECK_NAMES: tuple[str, ...] = tuple(r.name for r in RULES)

#: Checks that judge each GPU NVML reports, one row per GPU. On a pool that expects no GPU
#: (``gpu.count: 0``) they have nothing to judge, so a report that lacks them (an agent older
#: than the check) is not failed for it there; ``gpu.pci.inventory`` still proves there is no GPU.
PER_GPU_CHECKS: frozenset[str] = frozenset(
    {
        "gpu.model",
        "gpu.identity",
        "gpu.inforom",
        "gpu.pcie",
        "gpu.ecc.mode",
        "gpu.ecc.errors",
        "gpu.memory",
        "gpu.recovery_action",
        "gpu.persistence_mode",
        "gpu.mig",
        "gpu.thermal",
        "gpu.nvlink",
        "gpu.fabric",
        "gpu.processes",
    }
)

__all__ = [
    "CHECK_NAMES",
    "RULES",
    "RULES_BY_NAME",
    "Context",
    "Malformed",
    "Obs",
    "Outcome",
    "Rule",
    "Severity",
]
