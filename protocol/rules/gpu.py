"""Rules of the GPU checks: PCI inventory, driver, NVML, fabric and kernel-log XIDs.

Gating keeps one root cause from failing a dozen checks: with no NVIDIA GPU on
the PCI bus, every software check is skipped (the inventory check fails for a
GPU pool and passes for a CPU pool); with NVML unusable, every NVML check is
skipped (``gpu.nvml.init`` fails); a GPU NVML cannot reach fails
``gpu.nvml.devices`` and is left out of the per-GPU checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from protocol.report import Status
from protocol.rules.base import (
    Context,
    Malformed,
    Obs,
    Outcome,
    failed,
    passed,
    plural,
    skipped,
    version_tuple,
    warned,
)

NVIDIA_VENDOR = "0x10de"
NOT_SUPPORTED = "NVML_ERROR_NOT_SUPPORTED"
# XIDs the Kubernetes device plugin treats as application errors, not GPU faults
# (NVIDIA/k8s-device-plugin internal/rm/health.go).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
# Clock event reasons that mean the GPU is being held back by hardware or heat.
BAD_CLOCK_REASONS = {
    0x08: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
_NVML_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 not found: install the NVIDIA driver's user space",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the nvidia kernel module is not loaded",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "library and kernel module differ: reboot after a driver update",
    "NVML_ERROR_GPU_IS_LOST": "the GPU is lost: reboot the node; replace the GPU if it recurs",
    "NVML_ERROR_RESET_REQUIRED": "the GPU needs a reset (nvidia-smi -r) or a reboot",
    "NVML_ERROR_NO_PERMISSION": "permission denied: run the agent as root",
}


def pci_kind(pci_class: str) -> str | None:
    c = pci_class.lower()
    if c.startswith(("0x0300", "0x0302")):
        return "gpu"
    if c.startswith("0x0680"):
        return "nvswitch"
    return None


def norm_bdf(address: str) -> str:
    """``00000000:18:00.0`` (NVML) and ``0000:18:00.0`` (sysfs) -> ``0000:18:00.0``."""
    a = address.strip().lower()
    if a.count(":") == 2:
        domain, rest = a.split(":", 1)
        a = (
            f"{int(domain, 16):04x}:{rest}"
            if domain and all(ch in "0123456789abcdef" for ch in domain)
            else a
        )
    return a


def nvml_error_text(code: str) -> str:
    hint = _NVML_HINTS.get(code)
    return f"{code} ({hint})" if hint else code


def _pci(ctx: Context) -> tuple[list[Obs], list[Obs]]:
    functions = ctx.obs("gpu.pci.inventory").objs("functions")
    nvidia = [f for f in functions if f.text("vendor").lower() == NVIDIA_VENDOR]
    gpus = [f for f in nvidia if pci_kind(f.text("class")) == "gpu"]
    switches = [f for f in nvidia if pci_kind(f.text("class")) == "nvswitch"]
    return gpus, switches


def _gpu_gate(ctx: Context) -> Outcome | None:
    gpus, _ = _pci(ctx)
    if gpus:
        return None
    if ctx.policy.gpu_count == 0:
        return skipped("the pool expects no GPUs and none is present")
    return skipped("no NVIDIA GPU on the PCI bus (see gpu.pci.inventory)")


def _nvml_gate(ctx: Context) -> Outcome | None:
    gate = _gpu_gate(ctx)
    if gate is not None:
        return gate
    if ctx.obs("gpu.nvml.init").opt_text("error") is not None:
        return skipped("NVML is unavailable (see gpu.nvml.init)")
    return None


def _fabric_required(ctx: Context) -> bool:
    if ctx.policy.fabric_required is not None:
        return ctx.policy.fabric_required
    return bool(_pci(ctx)[1])


def _label(row: Obs) -> str:
    bus = row.opt_text("bus_id")
    return f"GPU {row.num('index')} ({norm_bdf(bus)})" if bus else f"GPU {row.num('index')}"


Judgement = tuple[Status, str, str]  # status, what this GPU shows, why (empty for a pass)
Judge = Callable[[Obs], Judgement]


def _per_gpu(ctx: Context, name: str, expected: str, judge: Judge) -> Outcome:
    """Judge every GPU NVML can reach; the worst status wins; reasons name each GPU.

    A GPU judged ``skip`` (the feature is not supported there) counts as a pass beside
    others; when every GPU is skipped, so is the check, with the reason.
    """
    gate = _nvml_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    devices = ctx.obs("gpu.nvml.devices").objs("gpus")
    reachable = sorted(d.num("index") for d in devices if d.opt_text("error") is None)
    lost = sorted(d.num("index") for d in devices if d.opt_text("error") is not None)
    rows = sorted(ctx.obs(name).objs("gpus"), key=lambda r: r.num("index"))
    if [r.num("index") for r in rows] != reachable:
        raise Malformed(
            f"{name}: GPUs {[r.num('index') for r in rows]} are not the GPUs NVML reaches {reachable}"
        )
    if not rows:
        return skipped("no GPU is reachable through NVML (see gpu.nvml.devices)", expected)
    results = [(row, *judge(row)) for row in rows]
    shown = [seen for _, _, seen, _ in results]
    if len(set(shown)) == 1:
        observed = f"{plural(len(rows), 'GPU')}: {shown[0]}"
    else:
        observed = "; ".join(f"{_label(row)}: {seen}" for row, _, seen, _ in results)
    if lost:
        observed += f" (not evaluated: GPU {', '.join(str(i) for i in lost)}, see gpu.nvml.devices)"
    if all(st is Status.SKIP for _, st, _, _ in results):
        whys = [why for _, _, _, why in results]
        if len(set(whys)) == 1:
            return skipped(f"{plural(len(rows), 'GPU')}: {whys[0]}", expected)
        return skipped("; ".join(f"{_label(row)}: {why}" for row, _, _, why in results), expected)
    fails = [f"{_label(row)}: {why}" for row, st, _, why in results if st is Status.FAIL]
    warns = [f"{_label(row)}: {why}" for row, st, _, why in results if st is Status.WARN]
    if fails:
        return failed(observed, expected, "; ".join(fails + warns))
    if warns:
        return warned(observed, expected, "; ".join(warns))
    return passed(observed, expected)


# --------------------------------------------------------------------------- PCI and driver


def _inventory(ctx: Context) -> Outcome:
    inv = ctx.obs("gpu.pci.inventory")
    p = ctx.policy
    if p.gpu_count == 0:
        expected = "no NVIDIA GPU (CPU pool)"
    elif p.gpu_count is None:
        expected = "at least one NVIDIA GPU"
    else:
        expected = plural(p.gpu_count, "NVIDIA GPU")
    error = inv.opt_text("error")
    if error is not None:
        return failed("PCI enumeration failed", expected, f"cannot enumerate PCI devices: {error}")
    gpus, switches = _pci(ctx)
    ids = sorted({f"10de:{g.text('device').lower().removeprefix('0x')}" for g in gpus})
    observed = plural(len(gpus), "NVIDIA GPU") + (f" ({', '.join(ids)})" if ids else "")
    if switches:
        observed += f", {plural(len(switches), 'NVSwitch')}"
    n = len(gpus)
    if p.gpu_count == 0:
        if n:
            return failed(observed, expected, f"found {plural(n, 'NVIDIA GPU')} but the pool expects none")
        return passed(observed, expected)
    if n == 0:
        return failed(
            observed,
            expected,
            "no NVIDIA GPU (vendor 0x10de, class 0x0300/0x0302) on the PCI bus: check the GPUs are seated, "
            "powered and enabled in the firmware",
        )
    if p.gpu_count is not None and n != p.gpu_count:
        return failed(
            observed,
            expected,
            f"found {plural(n, 'NVIDIA GPU')} on the PCI bus, the pool expects {p.gpu_count}",
        )
    return passed(observed, expected)


def _pci_driver(ctx: Context) -> Outcome:
    expected = "every GPU bound to nvidia, every NVSwitch to nvidia-nvswitch"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    gpus, switches = _pci(ctx)
    bound = ctx.obs("gpu.pci.driver").obj("drivers")
    bad = []
    for f, allowed in [(g, {"nvidia"}) for g in gpus] + [
        (s, {"nvidia", "nvidia-nvswitch"}) for s in switches
    ]:
        address = f.text("address")
        if not bound.has(address):
            bad.append(f"{norm_bdf(address)}: driver not reported")
            continue
        driver = bound.opt_text(address)
        if driver not in allowed:
            what = "has no driver bound" if driver is None else f"is bound to {driver}"
            bad.append(f"{norm_bdf(f.text('address'))} {what}")
    drivers = sorted({bound.opt_text(k) or "none" for k in bound.keys()})  # noqa: SIM118 - Obs is no dict
    observed = f"drivers in use: {', '.join(drivers)}"
    if bad:
        return failed(observed, expected, "; ".join(bad))
    return passed(observed, expected)


def _module(ctx: Context) -> Outcome:
    expected = "nvidia and nvidia_uvm loaded"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    modules = ctx.obs("gpu.driver.module").obj("modules")
    loaded = [m for m in modules.keys() if modules.flag(m)]  # noqa: SIM118 - Obs is no dict
    observed = f"loaded: {', '.join(loaded)}" if loaded else "no NVIDIA kernel module loaded"
    missing = [m for m in ("nvidia", "nvidia_uvm") if not (modules.has(m) and modules.flag(m))]
    if missing:
        return failed(observed, expected, f"kernel module {', '.join(missing)} not loaded")
    return passed(observed, expected)


def _driver_version(ctx: Context) -> Outcome:
    minimum = ctx.policy.min_driver_version
    expected = f"driver >= {minimum}" if minimum else "a loaded NVIDIA driver"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    o = ctx.obs("gpu.driver.version")
    version = o.opt_text("version")
    if version is None:
        why = o.opt_text("error") or "/proc/driver/nvidia/version is missing"
        return failed("no driver version", expected, f"the NVIDIA kernel driver is not loaded: {why}")
    flavor = o.opt_text("flavor") or "unknown"
    observed = f"{version} ({flavor} kernel module)"
    if minimum:
        have, want = version_tuple(version), version_tuple(minimum)
        if have is None or want is None:
            return failed(observed, expected, f"cannot compare driver version {version!r} with {minimum!r}")
        if have < want:
            return failed(observed, expected, f"driver {version} is older than the pool's minimum {minimum}")
    return passed(observed, expected)


def _device_nodes(ctx: Context) -> Outcome:
    expected = "/dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN for every GPU, as character devices"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    nodes = ctx.obs("gpu.driver.devices").obj("nodes")
    if ctx.obs("gpu.nvml.init").opt_text("error") is None:
        devices = ctx.obs("gpu.nvml.devices").objs("gpus")
        minors = [m for d in devices if (m := d.opt_num("minor")) is not None]
    else:
        minors = list(range(len(_pci(ctx)[0])))
    required = ["/dev/nvidiactl", "/dev/nvidia-uvm"] + [f"/dev/nvidia{m}" for m in sorted(minors)]
    missing = [p for p in required if not nodes.has(p) or nodes.text(p) == "missing"]
    wrong = [p for p in required if nodes.has(p) and nodes.text(p) not in ("char", "missing")]
    present = [p for p in required if nodes.has(p) and nodes.text(p) == "char"]
    observed = f"{len(present)} of {len(required)} present"
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)} (nvidia-modprobe -u -c=0 creates them)")
    if wrong:
        problems.append(f"not character devices: {', '.join(wrong)}")
    if problems:
        return failed(observed, expected, "; ".join(problems))
    return passed(observed, expected)


def _service(ctx: Context, name: str, daemon: str, required: bool, why_required: str) -> Outcome:
    expected = f"{daemon} running" if required else f"{daemon} running (not required)"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    o = ctx.obs(name)
    if o.flag("running"):
        pids = o.nums("pids")
        return passed(f"running (pid {', '.join(str(p) for p in pids)})", expected)
    if required:
        return failed("not running", expected, f"{daemon} is not running; {why_required}")
    return passed("not running (not required)", expected)


def _persistenced(ctx: Context) -> Outcome:
    return _service(
        ctx,
        "gpu.driver.persistenced",
        "nvidia-persistenced",
        ctx.policy.persistence_required,
        "the pool requires it: systemctl enable --now nvidia-persistenced",
    )


def _fabricmanager(ctx: Context) -> Outcome:
    return _service(
        ctx,
        "gpu.fabricmanager",
        "nv-fabricmanager",
        _fabric_required(ctx),
        "the NVSwitch fabric needs it: systemctl enable --now nvidia-fabricmanager",
    )
