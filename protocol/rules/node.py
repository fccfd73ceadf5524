"""Rules of the node preflight checks: what kubelet and kubeadm need from the host."""

from __future__ import annotations

import ipaddress

from protocol.k8s import node_name_problem
from protocol.rules.base import Context, Outcome, failed, passed, version_tuple

REQUIRED_SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
)
REQUIRED_CGROUP_CONTROLLERS = ("cpu", "memory", "pids")
# Kubernetes version skew policy: the kubelet may be up to three minor versions
# older than kube-apiserver (since v1.28) and never newer.
KUBELET_MAX_MINOR_SKEW = 3
GIB = 1024**3
# The kernel's maxerror saturates at 16 s while no NTP daemon disciplines the clock; systemd's
# ntp_synced() treats anything below it as synchronised (STA_UNSYNC may be set to spare the RTC).
UNSYNCED_MAX_ERROR_US = 16_000_000


def _time_sync(ctx: Context) -> Outcome:
    expected = "kernel clock synchronised (adjtimex maxerror below 16 s, as systemd judges it)"
    o = ctx.obs("node.time_sync")
    error = o.opt_text("error")
    if error is not None:
        return failed("unknown", expected, f"cannot read the clock state: {error}")
    max_error = o.num("max_error_us")
    shown = f"max error {max_error / 1_000_000:g} s"
    if max_error < UNSYNCED_MAX_ERROR_US:
        return passed(f"synchronised ({shown})", expected)
    return failed(
        f"not synchronised ({shown})",
        expected,
        "the kernel clock is not synchronised: start chrony or systemd-timesyncd and wait for sync",
    )


def _swap(ctx: Context) -> Outcome:
    expected = "no active swap"
    o = ctx.obs("node.swap")
    if (error := o.opt_text("error")) is not None:
        return failed("unknown", expected, f"cannot read /proc/swaps: {error}")
    devices = o.objs("devices")
    if devices:
        names = ", ".join(d.text("name") for d in devices)
        return failed(
            f"swap on {names}", expected, f"swap is on ({names}): swapoff -a and remove it from fstab"
        )
    return passed("swap off", expected)


def _modules(ctx: Context) -> Outcome:
    expected = "overlay and br_netfilter available"
    o = ctx.obs("node.kernel_modules")
    missing, shown = [], []
    for name in ("overlay", "br_netfilter"):
        m = o.obj(name)
        if m.flag("available"):
            shown.append(f"{name} ({m.opt_text('evidence') or 'loaded'})")
        else:
            missing.append(name)
    observed = ", ".join(shown) if shown else "neither available"
    if missing:
        return failed(
            observed,
            expected,
            f"kernel module {', '.join(missing)} not loaded: modprobe {' '.join(missing)}",
        )
    return passed(observed, expected)


def _sysctl(ctx: Context) -> Outcome:
    expected = ", ".join(f"{k}=1" for k in REQUIRED_SYSCTLS)
    values = ctx.obs("node.sysctl").obj("values")
    bad, shown = [], []
    for key in REQUIRED_SYSCTLS:
        v = values.opt_text(key) if values.has(key) else None
        shown.append(f"{key}={v if v is not None else 'absent'}")
        if v != "1":
            bad.append(f"{key} is {v if v is not None else 'absent'}")
    if bad:
        return failed(", ".join(shown), expected, "; ".join(bad) + " (set them in /etc/sysctl.d/)")
    return passed(", ".join(shown), expected)


def _cgroup(ctx: Context) -> Outcome:
    expected = f"cgroup v2 at /sys/fs/cgroup with {', '.join(REQUIRED_CGROUP_CONTROLLERS)}"
    o = ctx.obs("node.cgroup")
    fs_type = o.opt_text("fs_type")
    if fs_type != "cgroup2":
        return failed(
            f"/sys/fs/cgroup is {fs_type or 'not mounted'}",
            expected,
            "the node does not run the unified cgroup v2 hierarchy "
            "(boot with systemd.unified_cgroup_hierarchy=1)",
        )
    controllers = o.texts("controllers")
    missing = [c for c in REQUIRED_CGROUP_CONTROLLERS if c not in controllers]
    observed = f"cgroup v2, controllers {' '.join(controllers) or 'none'}"
    if missing:
        return failed(observed, expected, f"cgroup controller {', '.join(missing)} not available")
    return passed(observed, expected)


def _runtime(ctx: Context) -> Outcome:
    expected = "containerd or CRI-O installed, with its socket present"
    runtimes = ctx.obs("node.container_runtime").objs("runtimes")
    shown, problems = [], []
    for r in runtimes:
        name, version, socket = r.text("name"), r.opt_text("version"), r.text("socket")
        if version is None:
            problems.append(f"{name}: {r.opt_text('error') or 'not installed'}")
            continue
        shown.append(f"{name} {version}")
        if r.flag("socket_present"):
            return passed(f"{name} {version}, {socket}", expected)
        problems.append(f"{name} {version} is installed but {socket} is absent (is the service running?)")
    return failed(
        ", ".join(shown) or "none", expected, "no usable container runtime: " + "; ".join(problems)
    )


def _network(ctx: Context) -> Outcome:
    expected = "a global IPv4 address and a default route"
    o = ctx.obs("node.network")
    if (error := o.opt_text("error")) is not None:
        return failed("unknown", expected, f"cannot read the routing tables: {error}")
    usable = []
    for a in o.texts("ipv4_addresses"):
        try:
            ip = ipaddress.IPv4Address(a)
        except ValueError:
            continue
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            usable.append(a)
    route = o.opt_obj("default_route")
    shown = f"addresses {', '.join(usable) or 'none'}"
    if route is not None:
        shown += f", default via {route.text('gateway')} dev {route.text('interface')}"
    problems = []
    if not usable:
        problems.append("no IPv4 address other than loopback or link-local")
    if route is None:
        problems.append("no IPv4 default route")
    if problems:
        return failed(shown, expected, "; ".join(problems))
    return passed(shown, expected)


def _disk(ctx: Context) -> Outcome:
    need = ctx.policy.min_free_disk_gib
    expected = f">= {need} GiB free for images and logs"
    problems, shown = [], []
    for p in ctx.obs("node.disk").objs("paths"):
        path = p.text("path")
        if (error := p.opt_text("error")) is not None:
            problems.append(f"{path}: {error}")
            continue
        free = p.num("free_bytes")
        shown.append(f"{path}: {free / GIB:.1f} GiB free")
        if free < need * GIB:
            problems.append(f"{path} has {free / GIB:.1f} GiB free, the pool needs {need} GiB")
    if not shown and not problems:
        problems.append("no path measured")
    if problems:
        return failed("; ".join(shown) or "unknown", expected, "; ".join(problems))
    return passed("; ".join(shown), expected)


def _hostname(ctx: Context) -> Outcome:
    expected = (
        "a valid Kubernetes node name once lower-cased, as kubelet and kubeadm do (RFC 1123 subdomain)"
    )
    o = ctx.obs("node.hostname")
    name = o.opt_text("hostname")
    if name is None:
        return failed("unknown", expected, f"cannot read the host name: {o.opt_text('error')}")
    node_name = name.strip().lower()
    observed = name if node_name == name else f"{name} (node name {node_name})"
    why = node_name_problem(node_name)
    if why:
        return failed(observed, expected, f"host name {name!r} cannot be a node name: {why}")
    return passed(observed, expected)


def _kubelet(ctx: Context) -> Outcome:
    """The skew policy judges the kubelet that will run at the join: ``will_run`` (the image's carried
    version the agent installs before kubeadm runs, agent.kubeversion) when the report has it, else the
    installed one. The installed kubelet must answer ``--version`` either way."""
    cp = ctx.policy.control_plane_version
    expected = (
        f"kubelet within {KUBELET_MAX_MINOR_SKEW} minor versions below control plane {cp}, never newer"
        if cp
        else "kubelet installed"
    )
    o = ctx.obs("node.kubelet")
    installed = o.opt_text("version")
    if installed is None:
        return failed(
            "not installed", expected, f"kubelet unusable: {o.opt_text('error') or 'not installed'}"
        )
    will_run = o.opt_text("will_run") if o.has("will_run") else None
    version = installed
    observed = f"kubelet {installed}"
    if will_run is not None:
        carried = o.texts("carried")
        if will_run.lstrip("v") not in [c.lstrip("v") for c in carried]:
            return failed(
                observed,
                expected,
                f"kubelet {will_run} will run, but the image carries only {', '.join(carried)}",
            )
        if will_run.lstrip("v") != installed.lstrip("v"):
            observed = f"kubelet {installed} installed; {will_run} will run at the join (staged)"
        version = will_run
    if not cp:
        if ctx.policy.kubelet_skew_required:
            return failed(
                observed, expected, "the pool requires the skew check but sets no control_plane_version"
            )
        return passed(observed, expected)
    have, want = version_tuple(version), version_tuple(cp)
    if have is None or want is None or len(have) < 2 or len(want) < 2:
        return failed(observed, expected, f"cannot compare kubelet {version!r} with control plane {cp!r}")
    if have[0] != want[0] or have[1] > want[1]:
        return failed(observed, expected, f"kubelet {version} is newer than the control plane {cp}")
    if want[1] - have[1] > KUBELET_MAX_MINOR_SKEW:
        return failed(
            observed,
            expected,
            f"kubelet {version} is {want[1] - have[1]} minor versions behind the control plane {cp} "
            f"(at most {KUBELET_MAX_MINOR_SKEW})",
        )
    return passed(observed, expected)
