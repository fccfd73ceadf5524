"""Rules of the NVML checks (per GPU), the NVSwitch fabric, and kernel-log XIDs."""

from __future__ import annotations

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
from protocol.rules.gpu import (
    APPLICATION_XIDS,
    BAD_CLOCK_REASONS,
    FABRIC_STATES,
    NOT_SUPPORTED,
    Judgement,
    _fabric_required,
    _gpu_gate,
    _label,
    _nvml_gate,
    _pci,
    _per_gpu,
    norm_bdf,
    nvml_error_text,
)

_OK = Status.PASS
_FAIL = Status.FAIL
_WARN = Status.WARN
_SKIP = Status.SKIP

CORRUPTED_INFOROM = "NVML_ERROR_CORRUPTED_INFOROM"
FUNCTION_NOT_FOUND = "NVML_ERROR_FUNCTION_NOT_FOUND"
INVALID_ARGUMENT = "NVML_ERROR_INVALID_ARGUMENT"
NVLINK_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS
NVLINK_ACTIVE = 1  # nvmlDeviceGetNvLinkState: NVML_FEATURE_ENABLED
# NVML_GPU_RECOVERY_ACTION_* (nvml.h) -> (name, what to do). At first boot nothing runs on the
# GPUs, so "drain" has nothing to wait for: the reset or reboot is what remains.
RECOVERY_ACTIONS = {
    1: ("GPU_RESET", "reset the GPU (nvidia-smi -r -i {index}) or reboot the node"),
    2: ("NODE_REBOOT", "reboot the node"),
    3: (
        "DRAIN_P2P",
        "drain peer-to-peer (NVLink) work from the GPU, then reset it (nvidia-smi -r -i {index})",
    ),
    4: (
        "DRAIN_AND_RESET",
        "drain the GPU's work, then reset it (nvidia-smi -r -i {index}) or reboot the node",
    ),
    5: ("RECOVER_IMEX_DOMAIN", "recover the GPU's IMEX domain (restart nvidia-imex on the domain's nodes)"),
    6: ("BUS_RESET", "reset the GPU's PCI bus (reboot the node)"),
    7: ("SYSTEM_REBOOT", "reboot the system (a full power cycle)"),
}


def _nvml_init(ctx: Context) -> Outcome:
    expected = "NVML initialises"
    gate = _gpu_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    o = ctx.obs("gpu.nvml.init")
    error = o.opt_text("error")
    if error is not None:
        message = o.opt_text("message") or ""
        detail = f"{nvml_error_text(error)}: {message}" if message else nvml_error_text(error)
        return failed("NVML failed to initialise", expected, f"NVML cannot be used: {detail}")
    cuda = o.opt_num("cuda_driver_version")
    observed = (
        f"NVML {o.opt_text('nvml_version') or '?'}, driver {o.opt_text('driver_version') or '?'}, "
        f"CUDA driver API {_cuda_text(cuda) if cuda is not None else '?'}"
    )
    return passed(observed, expected)


def _cuda_text(version: int) -> str:
    return f"{version // 1000}.{(version % 1000) // 10}"


def _driver_match(ctx: Context) -> Outcome:
    expected = "NVML library version equals the kernel module version"
    gate = _nvml_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    o = ctx.obs("gpu.nvml.driver_match")
    lib, kernel = o.opt_text("nvml_driver_version"), o.opt_text("kernel_driver_version")
    if kernel is None:
        return skipped("the kernel module version is unknown (see gpu.driver.version)", expected)
    if lib is None:
        return failed(
            "NVML reported no driver version", expected, "nvmlSystemGetDriverVersion returned nothing"
        )
    observed = f"library {lib}, kernel module {kernel}"
    if lib != kernel:
        return failed(
            observed, expected, f"NVML library {lib} and kernel module {kernel} differ: reboot the node"
        )
    return passed(observed, expected)


def _cuda(ctx: Context) -> Outcome:
    minimum = ctx.policy.min_cuda_version
    expected = f"CUDA driver API >= {minimum}" if minimum else "a CUDA driver API version"
    gate = _nvml_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    version = ctx.obs("gpu.cuda.version").opt_num("cuda_driver_version")
    if version is None:
        return failed("not reported", expected, "nvmlSystemGetCudaDriverVersion_v2 returned nothing")
    observed = _cuda_text(version)
    if minimum:
        want = version_tuple(minimum)
        if want is None:
            return failed(observed, expected, f"cannot compare with {minimum!r}")
        if (version // 1000, (version % 1000) // 10) < want[:2]:
            return failed(
                observed, expected, f"the driver supports CUDA {observed}, the pool needs {minimum}"
            )
    return passed(observed, expected)


def _count(ctx: Context) -> Outcome:
    expected = "NVML sees every GPU on the PCI bus"
    gate = _nvml_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    o = ctx.obs("gpu.nvml.count")
    count, bus_ids = o.num("count"), o.texts("bus_ids")
    pci = {norm_bdf(g.text("address")) for g in _pci(ctx)[0]}
    observed = f"NVML: {count}, PCI bus: {len(pci)}"
    problems = []
    if count != len(pci):
        problems.append(f"NVML counts {plural(count, 'GPU')}, the PCI bus has {len(pci)}")
    stray = sorted(norm_bdf(b) for b in bus_ids if norm_bdf(b) not in pci)
    if stray:
        problems.append(f"NVML GPUs not found among the PCI GPUs: {', '.join(stray)}")
    if problems:
        return failed(observed, expected, "; ".join(problems))
    return passed(observed, expected)


def _devices(ctx: Context) -> Outcome:
    expected = "every GPU reachable through NVML"
    gate = _nvml_gate(ctx)
    if gate is not None:
        return replace(gate, expected=expected)
    rows = sorted(ctx.obs("gpu.nvml.devices").objs("gpus"), key=lambda r: r.num("index"))
    bad = [(r, e) for r in rows if (e := r.opt_text("error")) is not None]
    observed = f"{len(rows) - len(bad)} of {len(rows)} reachable"
    if bad:
        reason = "; ".join(f"{_label(r)}: {nvml_error_text(e)}" for r, e in bad)
        reached = {norm_bdf(b) for r in rows if r.opt_text("error") is None and (b := r.opt_text("bus_id"))}
        orphans = sorted(a for g in _pci(ctx)[0] if (a := norm_bdf(g.text("address"))) not in reached)
        if orphans:
            reason += f" (PCI GPUs NVML does not reach: {', '.join(orphans)})"
        return failed(observed, expected, reason)
    return passed(observed, expected)


def _error(row: Obs, key: str = "error") -> str | None:
    return row.opt_text(key)


def _model(ctx: Context) -> Outcome:
    model = ctx.policy.gpu_model
    expected = model or "any model"

    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            return _FAIL, "name unreadable", nvml_error_text(e)
        name = row.text("name")
        if model and name.strip() != model:
            return _FAIL, name, f"is {name}, the pool expects {model}"
        return _OK, name, ""

    return _per_gpu(ctx, "gpu.model", expected, judge)


def _identity(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        uuid = row.opt_text("uuid")
        if uuid is None or not uuid.startswith(("GPU-", "MIG-")):
            return _FAIL, "no UUID", f"NVML returned no usable UUID ({uuid!r})"
        if row.opt_text("serial") is None:
            return _OK, "UUID readable, no serial", ""
        return _OK, "UUID and serial readable", ""

    return _per_gpu(ctx, "gpu.identity", "a UUID for every GPU (reported to the server)", judge)


def _pcie(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            return _FAIL, "link unreadable", nvml_error_text(e)
        cg, mg, cw, mw = row.num("curr_gen"), row.num("max_gen"), row.num("curr_width"), row.num("max_width")
        seen = f"Gen{cg} x{cw}"
        if cw < mw:
            return _FAIL, seen, f"link trained to x{cw}, capable of x{mw}: reseat the GPU or check the riser"
        if cg < mg:
            return _WARN, seen, f"link at Gen{cg}, capable of Gen{mg} (an idle GPU may train down)"
        return _OK, seen, ""

    return _per_gpu(ctx, "gpu.pcie", "link width and generation at their maximum", judge)


def _ecc_mode(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            if e == NOT_SUPPORTED:
                return _WARN, "ECC not supported", "this GPU has no ECC"
            return _FAIL, "ECC mode unreadable", nvml_error_text(e)
        current, pending = row.num("current"), row.num("pending")
        seen = "enabled" if current else "disabled"
        if current != pending:
            return _FAIL, f"{seen}, pending change", "an ECC mode change is pending: reboot the node"
        if not current:
            return _FAIL, seen, "ECC is disabled: nvidia-smi -e 1, then reboot"
        return _OK, seen, ""

    return _per_gpu(ctx, "gpu.ecc.mode", "ECC enabled, no change pending", judge)


def _ecc_errors(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            if e == NOT_SUPPORTED:
                return _WARN, "no ECC counters", "this GPU reports no ECC counters"
            return _FAIL, "counters unreadable", nvml_error_text(e)
        n = row.num("volatile_uncorrected")
        seen = f"{n} uncorrectable"
        if n:
            return _FAIL, seen, f"{n} uncorrectable ECC errors since the driver loaded"
        return _OK, seen, ""

    return _per_gpu(ctx, "gpu.ecc.errors", "no volatile uncorrectable ECC error", judge)


def _memory(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        rows, pages = row.obj("remapped_rows"), row.obj("retired_pages")
        problems: list[str] = []
        seen: list[str] = []
        rows_err, pages_err = rows.opt_text("error"), pages.opt_text("error")
        if rows_err is None:
            unc, pending, failure = rows.num("uncorrectable"), rows.num("pending"), rows.num("failure")
            seen.append(
                f"remapped rows {rows.num('correctable')}+{unc}, pending {pending}, failed {failure}"
            )
            if failure:
                problems.append("a row remapping failed: the GPU needs replacing")
            if pending:
                problems.append("a row remap is pending: reset the GPU (nvidia-smi -r) or reboot")
            if unc >= 512:
                problems.append(f"{unc} rows remapped for uncorrectable errors (limit 512)")
        elif rows_err != NOT_SUPPORTED:
            problems.append(f"remapped rows unreadable: {nvml_error_text(rows_err)}")
        if pages_err is None:
            sbe, dbe, pending = pages.num("single_bit"), pages.num("double_bit"), pages.num("pending")
            seen.append(f"retired pages {sbe}+{dbe}, pending {pending}")
            if pending:
                problems.append("a page retirement is pending: reboot")
            if sbe + dbe > 63:
                problems.append(f"{sbe + dbe} retired pages (limit 63)")
        elif pages_err != NOT_SUPPORTED:
            problems.append(f"retired pages unreadable: {nvml_error_text(pages_err)}")
        if problems:
            return _FAIL, "; ".join(seen) or "unreadable", "; ".join(problems)
        if not seen:
            return _WARN, "no data", "the GPU supports neither row remapping nor page retirement"
        return _OK, "; ".join(seen), ""

    return _per_gpu(ctx, "gpu.memory", "no pending or failed row remap or page retirement", judge)


def _persistence_mode(ctx: Context) -> Outcome:
    required = ctx.policy.persistence_required

    def judge(row: Obs) -> Judgement:
        bad = _FAIL if required else _WARN
        if (e := _error(row)) is not None:
            return bad, "unreadable", nvml_error_text(e)
        if row.flag("enabled"):
            return _OK, "enabled", ""
        return bad, "disabled", "persistence mode is off: run nvidia-persistenced (or nvidia-smi -pm 1)"

    expected = "enabled" + ("" if required else " (recommended)")
    return _per_gpu(ctx, "gpu.persistence_mode", expected, judge)


def _mig(ctx: Context) -> Outcome:
    policy = str(ctx.policy.mig)

    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            if e != NOT_SUPPORTED:
                return _FAIL, "unreadable", nvml_error_text(e)
            if policy == "enabled":
                return _FAIL, "MIG not supported", "this GPU has no MIG, the pool requires it"
            return _OK, "MIG not supported", ""
        current, pending = row.num("current"), row.num("pending")
        seen = "MIG " + ("enabled" if current else "disabled")
        if current != pending:
            seen += ", change pending"
            return _FAIL, seen, "a MIG mode change is pending: reset the GPU or reboot"
        if policy == "disabled" and current:
            return _FAIL, seen, "MIG is enabled, the pool forbids MIG (nvidia-smi -mig 0)"
        if policy == "enabled" and not current:
            return _FAIL, seen, "MIG is disabled, the pool requires MIG (nvidia-smi -mig 1)"
        return _OK, seen, ""

    expected = {"disabled": "MIG disabled", "enabled": "MIG enabled"}.get(
        policy, "MIG either way, no change pending"
    )
    return _per_gpu(ctx, "gpu.mig", expected, judge)


def _thermal(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            return _FAIL, "unreadable", nvml_error_text(e)
        temp, reasons = row.num("temperature_c"), row.num("clocks_event_reasons")
        active = [text for bit, text in BAD_CLOCK_REASONS.items() if reasons & bit]
        seen = f"{temp} °C"
        if active:
            return _FAIL, f"{seen}, {', '.join(active)}", f"clocks held back: {', '.join(active)}"
        return _OK, seen, ""

    return _per_gpu(ctx, "gpu.thermal", "no thermal or power-brake slowdown", judge)


def _fabric(ctx: Context) -> Outcome:
    required = _fabric_required(ctx)

    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            if required:
                return _FAIL, "unreadable", f"fabric state unreadable: {nvml_error_text(e)}"
            return _OK, "not reported", ""
        state, status = row.num("state"), row.num("status")
        text = FABRIC_STATES.get(state, f"state {state}")
        if state == 3:
            if status != 0:
                return (
                    _FAIL,
                    f"{text}, status {status}",
                    f"fabric registration finished with NVML error {status}",
                )
            return _OK, f"{text} (clique {row.opt_num('clique_id')})", ""
        if state == 0:
            if required:
                return _FAIL, text, "the GPU reports no NVLink fabric, the pool requires the NVSwitch fabric"
            return _OK, "no fabric", ""
        why = f"fabric training {text}: wait for nvidia-fabricmanager to finish, then check again"
        return (_FAIL if required else _WARN), text, why

    expected = "fabric state completed" if required else "no fabric required"
    return _per_gpu(ctx, "gpu.fabric", expected, judge)


def _xid(ctx: Context) -> Outcome:
    expected = f"no XID since boot other than application XIDs {sorted(APPLICATION_XIDS)}"
    o = ctx.obs("gpu.xid")
    events = o.objs("events")
    if not events and ctx.policy.gpu_count == 0 and not _pci(ctx)[0]:
        return skipped("the pool expects no GPUs and none is present", expected)
    error = o.opt_text("error")
    if error is not None and not events:
        return warned("kernel log unreadable", expected, f"cannot read the kernel log: {error}")
    critical, ignored = [], []
    for ev in events:
        xid, count = ev.num("xid"), ev.num("count")
        where = ev.text("address")
        text = f"Xid {xid} on {where} ({count}x)"
        message = ev.opt_text("message")
        if xid in APPLICATION_XIDS:
            ignored.append(text)
        else:
            critical.append(f"{text}: {message}" if message else text)
    log = o.text("log")
    if critical:
        kinds = sorted(
            {(ev.num("xid"), ev.text("address")) for ev in events if ev.num("xid") not in APPLICATION_XIDS}
        )
        shown = ", ".join(f"Xid {x} on {a}" for x, a in kinds)
        return failed(f"critical: {shown} (from {log})", expected, "; ".join(critical))
    observed = f"no critical XID in {log}" + (
        f" (application XIDs: {', '.join(ignored)})" if ignored else ""
    )
    return passed(observed, expected)


def _inforom(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        e = _error(row)
        if e is None:
            return _OK, "valid", ""
        if e == NOT_SUPPORTED:
            return _SKIP, "not supported", "infoROM validation is not supported (NVML_ERROR_NOT_SUPPORTED)"
        if e == CORRUPTED_INFOROM:
            return (
                _FAIL,
                "corrupted",
                "infoROM corrupted (NVML_ERROR_CORRUPTED_INFOROM): keep the GPU out of service; "
                "have its infoROM reflashed or the board RMAed through NVIDIA support",
            )
        return (
            _FAIL,
            "validation failed",
            f"infoROM validation failed: {nvml_error_text(e)}; if it persists, have the infoROM "
            "reflashed or the board RMAed through NVIDIA support",
        )

    return _per_gpu(ctx, "gpu.inforom", "infoROM valid", judge)


def _recovery_action(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        if (e := _error(row)) is not None:
            if e in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                return _SKIP, "not supported", f"nvmlDeviceGetFieldValues is not supported ({e})"
            return _FAIL, "unreadable", f"nvmlDeviceGetFieldValues failed: {nvml_error_text(e)}"
        if (fe := row.opt_text("field_error")) is not None:
            if fe in (NOT_SUPPORTED, INVALID_ARGUMENT):
                return (
                    _SKIP,
                    "not reported",
                    f"the driver does not report NVML_FI_DEV_GET_GPU_RECOVERY_ACTION ({fe}; older drivers lack it)",
                )
            return _FAIL, "unreadable", f"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: {nvml_error_text(fe)}"
        action = row.num("action")
        if action == 0:
            return _OK, "none", ""
        name, todo = RECOVERY_ACTIONS.get(
            action, (str(action), "an action this version does not know: see NVIDIA's NVML documentation")
        )
        return (
            _FAIL,
            name,
            f"the driver requests recovery action {name} (NVML_GPU_RECOVERY_ACTION {action}): "
            + todo.format(index=row.num("index")),
        )

    return _per_gpu(ctx, "gpu.recovery_action", "recovery action NONE", judge)


def _nvlink(ctx: Context) -> Outcome:
    required = _fabric_required(ctx)
    want = ctx.policy.nvlink_count

    def judge(row: Obs) -> Judgement:
        links = row.objs("links")
        count = row.opt_num("link_count")
        if count is not None and len(links) != min(count, NVLINK_MAX_LINKS):
            raise Malformed(f"{row.where}: {len(links)} links for a link count of {count}")
        unreadable = [(ln.num("link"), e) for ln in links if (e := ln.opt_text("error")) is not None]
        down = [
            ln.num("link")
            for ln in links
            if ln.opt_text("error") is None and ln.num("state") != NVLINK_ACTIVE
        ]
        active = len(links) - len(unreadable) - len(down)
        if not links:
            err = row.opt_text("count_error")
            seen = "no NVLink"
            if want is not None:
                return _FAIL, seen, f"the GPU reports no NVLink, the pool expects {want} active links"
            if required:
                return _FAIL, seen, "the GPU reports no NVLink, the pool requires the NVSwitch fabric"
            return _SKIP, seen, f"no NVLink ({err})" if err else "no NVLink (link count 0)"
        seen = f"{active} of {len(links)} links active"
        problems = []
        if down:
            problems.append(
                f"NVLink {', '.join(str(n) for n in down)} inactive: reset the GPU (nvidia-smi -r) or "
                "reboot; if a link stays down, have the GPU baseboard serviced"
            )
        if unreadable:
            problems.append(
                "state unreadable: " + ", ".join(f"link {n}: {nvml_error_text(e)}" for n, e in unreadable)
            )
        if want is not None and active != want:
            problems.append(f"{active} active links, the pool expects {want}")
        if not problems:
            return _OK, f"{active} links active", ""
        if not active and not unreadable and not required and want is None:
            return _WARN, seen, "no NVLink is active (no NVLink bridge or switch connected?)"
        return _FAIL, seen, "; ".join(problems)

    if want is not None:
        expected = f"{want} active NVLinks per GPU"
    elif required:
        expected = "every NVLink active (the pool requires the NVSwitch fabric)"
    else:
        expected = "every NVLink active (GPUs without NVLink skipped)"
    return _per_gpu(ctx, "gpu.nvlink", expected, judge)


def _mib(used: int | None) -> str:
    return "memory unknown" if used is None else f"{used // 2**20} MiB"


def _processes(ctx: Context) -> Outcome:
    def judge(row: Obs) -> Judgement:
        found: list[str] = []
        problems: list[str] = []
        unsupported = 0
        for kind in ("compute", "graphics"):
            e = row.opt_text(f"{kind}_error")
            if e is not None:
                if e == NOT_SUPPORTED:
                    unsupported += 1
                else:
                    problems.append(f"{kind} processes unreadable: {nvml_error_text(e)}")
                continue
            for proc in row.objs(kind):
                found.append(f"{kind} pid {proc.num('pid')} ({_mib(proc.opt_num('used_memory'))})")
        if found:
            why = (
                f"running: {', '.join(found)}; nothing should use the GPUs before the node joins: "
                "find what started it and stop it"
            )
            return _FAIL, plural(len(found), "process"), "; ".join([why, *problems])
        if problems:
            return _FAIL, "unreadable", "; ".join(problems)
        if unsupported == 2:
            return _SKIP, "not supported", "process lists are not supported (NVML_ERROR_NOT_SUPPORTED)"
        return _OK, "no process", ""

    return _per_gpu(ctx, "gpu.processes", "no compute or graphics process on any GPU", judge)
