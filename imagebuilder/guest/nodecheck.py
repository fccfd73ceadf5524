"""The boot test's node checks, inside the booted image: host configuration, container runtime, GPU stack.

Standard library only (it runs with the image's own ``python3``, next to ``boottest_check.py``, which
imports it). ``expect["node"]`` is the manifest's ``contents.node`` (:func:`imagebuilder.nodespec.expectations`);
:func:`check_names` lists the checks it yields, in order, for the host's completeness check.

Checked, not trusted: every file the definition's ``host``, ``container_runtime`` and ``gpu`` keys put into
the image at its path with its digest, mode and owner; the units enabled and masked; the kernel modules
loaded and the sysctls applied at this boot; no active swap; the unified cgroup hierarchy; the time
client running with no server of the image's own (the node-pool release names them); containerd
running with its socket, CRI enabled, the systemd cgroup driver and the sandbox image configured, every
imported image in its ``k8s.io`` store and listed by ``crictl``; the GPU stack's packages installed without
DKMS, its kernel modules built for the running kernel, its units enabled, containerd's nvidia runtime (or
CDI) configured. What a GPU would add (the modules loading, the daemons running) is the agent's GPU checks'
business on a real node: the VM has no GPU.
"""

from __future__ import annotations

import glob
import grp
import hashlib
import os
import pwd
import stat
import subprocess
from pathlib import Path
from typing import Any

Check = dict[str, Any]
_ENV = {"LC_ALL": "C.UTF-8", "SYSTEMD_PAGER": "", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _run(*argv: str, timeout: float = 120) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, **_ENV})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _check(name: str, ok: bool, detail: str) -> Check:
    return {"name": name, "ok": bool(ok), "detail": detail}


def check_names(node: dict[str, Any]) -> list[str]:
    """The checks :func:`check_node` yields for ``node`` (``contents.node``), in order."""
    if not node:
        return []
    names = ["node/files", "node/units"]
    if node.get("host"):
        names += ["node/kernel-modules", "node/sysctls", "node/swap"]
        if node["host"].get("cgroup"):
            names.append("node/cgroup")
        if node["host"].get("time_sync"):
            names.append("node/time-sync")
    if node.get("container_runtime"):
        names += ["container-runtime/containerd", "container-runtime/images"]
    if node.get("gpu"):
        names += ["gpu/packages", "gpu/kernel-modules"]
        if node["gpu"].get("toolkit_mode"):
            names.append("gpu/container-toolkit")
    return names


# -- files and units -------------------------------------------------------------------------------


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def _file_problem(root: Path, entry: dict[str, Any]) -> str:
    path = root / entry["path"].lstrip("/")
    if path.is_symlink() or not path.is_file():
        return f"{entry['path']} is missing"
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
        return f"{entry['path']} is not the file the build wrote (sha256 differs)"
    st = path.stat()
    if stat.S_IMODE(st.st_mode) != int(entry["mode"], 8):
        return f"{entry['path']} has mode {stat.S_IMODE(st.st_mode):04o}, expected {entry['mode']}"
    owner = entry["owner"] if ":" in entry["owner"] else f"{entry['owner']}:{entry['owner']}"
    if _owner(st) != owner:
        return f"{entry['path']} is owned by {_owner(st)}, expected {owner}"
    return ""


def check_files(root: Path, node: dict[str, Any]) -> Check:
    entries = node.get("files", [])
    problems = [p for p in (_file_problem(root, e) for e in entries) if p]
    groups = sorted({e["group"] for e in entries})
    return _check(
        "node/files",
        not problems,
        "; ".join(problems[:4])
        if problems
        else f"{len(entries)} files ({', '.join(groups)}) with digest, mode, owner",
    )


def _unit_state(unit: str) -> str:
    _rc, out = _run("systemctl", "is-enabled", unit)
    return out.splitlines()[-1] if out else "unknown"


def check_units(node: dict[str, Any]) -> Check:
    wrong = []
    for unit in node.get("enabled", []):
        state = _unit_state(unit)
        if state not in ("enabled", "enabled-runtime", "static", "alias"):
            wrong.append(f"{unit} is {state}, not enabled")
    for unit in node.get("masked", []):
        state = _unit_state(unit)
        if state not in ("masked", "masked-runtime"):
            wrong.append(f"{unit} is {state}, not masked")
    counts = f"{len(node.get('enabled', []))} enabled, {len(node.get('masked', []))} masked"
    return _check(
        "node/units", not wrong, "; ".join(wrong) if wrong else f"{counts}: as the definition says"
    )


# -- host ----------------------------------------------------------------------------------------------


def _loaded_modules(root: Path) -> set[str]:
    found = {line.split()[0] for line in (root / "proc/modules").read_text().splitlines() if line.strip()}
    found |= {p.name for p in (root / "sys/module").iterdir()} if (root / "sys/module").is_dir() else set()
    return found


def check_host(root: Path, host: dict[str, Any]) -> list[Check]:
    checks = []
    loaded = _loaded_modules(root)
    missing = [m for m in host.get("kernel_modules", []) if m.replace("-", "_") not in loaded]
    checks.append(_check("node/kernel-modules", not missing,
                         f"not loaded: {', '.join(missing)}" if missing
                         else f"loaded at boot: {', '.join(host.get('kernel_modules', [])) or 'none asked'}"))  # fmt: skip
    wrong = []
    for key, want in sorted(host.get("sysctls", {}).items()):
        path = root / "proc/sys" / key.replace(".", "/")
        try:
            have = " ".join(path.read_text().split())
        except OSError as exc:
            wrong.append(f"{key}: {exc.strerror}")
            continue
        if have != " ".join(str(want).split()):
            wrong.append(f"{key} = {have}, expected {want}")
    checks.append(_check("node/sysctls", not wrong, "; ".join(wrong) if wrong
                         else f"{len(host.get('sysctls', {}))} applied at boot"))  # fmt: skip
    swaps = [line for line in (root / "proc/swaps").read_text().splitlines()[1:] if line.strip()]
    if host.get("swap", True):
        checks.append(_check("node/swap", True, f"swap allowed by the definition ({len(swaps)} active)"))
    else:
        state = _unit_state("swap.target")
        ok = not swaps and state == "masked"
        checks.append(_check("node/swap", ok, "no active swap; swap.target masked" if ok
                             else f"active swap: {swaps}; swap.target {state}"))  # fmt: skip
    if host.get("cgroup"):
        mounts = [line.split() for line in (root / "proc/self/mountinfo").read_text().splitlines()]
        fstype = next(
            (m[m.index("-") + 1] for m in mounts if len(m) > 4 and m[4] == "/sys/fs/cgroup"), "none"
        )
        controllers = (
            (root / "sys/fs/cgroup/cgroup.controllers").read_text().split() if fstype == "cgroup2" else []
        )
        ok = fstype == "cgroup2" and {"cpu", "memory", "pids"} <= set(controllers)
        checks.append(
            _check("node/cgroup", ok, f"/sys/fs/cgroup is {fstype}; controllers {' '.join(controllers)}")
        )
    ts = host.get("time_sync")
    if ts:
        _rc, active = _run("systemctl", "is-active", ts["unit"])
        enabled = _unit_state(ts["unit"])
        ok = enabled == "enabled" and active.splitlines()[-1:] == ["active"]
        detail = (
            f"{ts['unit']} {enabled} and {active.splitlines()[-1] if active else '?'}; the site's servers come from "
            f"the node-pool release ({ts['release_file']})"
        )
        if ts.get("servers"):  # the boot test served it time: the client must have synchronised with it
            synced, said = _synchronised(str(ts["client"]))
            if _unit_state(TIME_WAIT_SYNC) == "enabled":  # it held time-sync.target until the clock was set
                _rc, waited = _run("systemctl", "is-active", TIME_WAIT_SYNC)
                synced = synced and waited.splitlines()[-1:] == ["active"]
                said = f"{TIME_WAIT_SYNC}: {waited}\n{said}"
            ok = ok and synced
            detail += f"; synchronised with {' '.join(ts['servers'])}: {'yes' if synced else 'NO'}\n{said}"
        checks.append(_check("node/time-sync", ok, detail))
    return checks


TIME_WAIT_SYNC = "systemd-time-wait-sync.service"


def _synchronised(client: str) -> tuple[bool, str]:
    """Whether the time client has set the clock from its servers, and what it says about it."""
    if client == "chrony":
        _rc, out = _run("chronyc", "-n", "tracking")
        fields = {
            k.strip(): v for k, _, v in (line.partition(":") for line in out.splitlines() if ":" in line)
        }
        leap = fields.get("Leap status", "").strip()
        reference = fields.get("Reference ID", "").strip()
        return leap == "Normal" and not reference.startswith("00000000"), out
    _rc, synced = _run("timedatectl", "show", "-p", "NTPSynchronized", "--value")
    _rc, status = _run("timedatectl", "timesync-status")
    return synced.strip() == "yes", f"NTPSynchronized={synced.strip()}\n{status}"


# -- container runtime ------------------------------------------------------------------------------


def _config_dump() -> tuple[int, str]:
    return _run("containerd", "config", "dump")


def check_runtime(root: Path, runtime: dict[str, Any]) -> list[Check]:
    socket = root / runtime["socket"].lstrip("/")
    _rc, active = _run("systemctl", "is-active", "containerd.service")
    _rc, version = _run("containerd", "--version")
    _rc, plugins = _run("ctr", "plugins", "ls")
    cri_ok = any(line.split()[:2] == ["io.containerd.grpc.v1", "cri"] and line.split()[-1] == "ok"
                 for line in plugins.splitlines())  # fmt: skip
    rc, dump = _config_dump()
    problems = []
    if active.splitlines()[-1:] != ["active"]:
        problems.append(f"containerd.service is {active}")
    if not (socket.exists() and stat.S_ISSOCK(socket.stat().st_mode)):
        problems.append(f"no socket at {runtime['socket']}")
    if not cri_ok:
        problems.append("the CRI plugin is not loaded (ctr plugins ls)")
    if rc != 0:
        problems.append(f"containerd config dump failed: {dump[-200:]}")
    else:
        if runtime.get("systemd_cgroup") and "SystemdCgroup = true" not in dump:
            problems.append("runc's SystemdCgroup is not true")
        if f'sandbox_image = "{runtime["sandbox_image"]}"' not in dump:
            problems.append(f"the sandbox image is not {runtime['sandbox_image']}")
    checks = [_check("container-runtime/containerd", not problems, "; ".join(problems) if problems else
                     f"{version.split()[2] if len(version.split()) > 2 else version} running, socket "
                     f"{runtime['socket']}, CRI enabled, systemd cgroups, sandbox {runtime['sandbox_image']}")]  # fmt: skip
    rc, listed = _run("ctr", "-n", runtime["namespace"], "images", "ls", "-q")
    have = set(listed.split()) if rc == 0 else set()
    missing = [ref for ref in runtime.get("images", []) if ref not in have]
    rc, crictl = _run("crictl", "images", "-o", "json")
    seen_by_crictl = [ref for ref in runtime.get("images", []) if f'"{ref}"' in crictl] if rc == 0 else []
    ok = not missing and len(seen_by_crictl) == len(runtime.get("images", []))
    detail = (
        f"{len(runtime.get('images', []))} imported into {runtime['namespace']} at build time, listed by crictl: "
        + ", ".join(runtime.get("images", []))
        if ok
        else f"missing from containerd: {', '.join(missing) or 'none'}; crictl sees {len(seen_by_crictl)}"
        + ("" if rc == 0 else f" (crictl images failed: {crictl[-200:]})")
    )
    checks.append(_check("container-runtime/images", ok, detail))
    return checks


# -- GPU -----------------------------------------------------------------------------------------------


def check_gpu(root: Path, gpu: dict[str, Any]) -> list[Check]:
    problems = []
    for package in gpu["packages"]:
        rc, out = _run("dpkg-query", "-W", "-f=${Status}", package)
        if rc != 0 or not out.endswith("ok installed"):
            problems.append(f"{package} is not installed")
    rc, out = _run("dpkg-query", "-W", "-f=${Status}", "dkms")
    if rc == 0 and out.endswith("ok installed"):
        problems.append("dkms is installed: the driver must come precompiled for the image's kernel")
    checks = [_check("gpu/packages", not problems, "; ".join(problems) if problems
                     else f"{len(gpu['packages'])} installed, no DKMS")]  # fmt: skip
    _rc, kernel = _run("uname", "-r")
    base = root / "lib/modules" / kernel
    found: dict[str, str] = {}
    for module in gpu["modules"]:
        names = {module, module.replace("_", "-")}
        hits = sorted(p for n in names for p in glob.glob(str(base / "**" / f"{n}.ko*"), recursive=True))
        if hits:
            found[module] = hits[0]
    missing = [m for m in gpu["modules"] if m not in found]
    # precompiled: each module file belongs to an installed package (a DKMS build belongs to none)
    unowned = [
        m for m, path in found.items() if _run("dpkg-query", "-S", "/" + os.path.relpath(path, root))[0] != 0
    ]
    ok = not missing and not unowned
    if ok:
        detail = f"precompiled for the running kernel {kernel}: {', '.join(found)} (from {gpu['kernel_modules_package']})"
    else:
        detail = f"for the running kernel {kernel}: missing {', '.join(missing) or 'none'}"
        detail += f"; not from a package: {', '.join(unowned)}" if unowned else ""
    checks.append(_check("gpu/kernel-modules", ok, detail))
    mode = gpu.get("toolkit_mode")
    if mode:
        rc, dump = _config_dump()
        if mode == "runtime":
            binary = gpu.get("runtime_binary") or ""
            ok = (
                rc == 0
                and f'BinaryName = "{binary}"' in dump
                and os.access(root / binary.lstrip("/"), os.X_OK)
            )
            detail = (
                f"containerd's nvidia runtime runs {binary}"
                if ok
                else f"no nvidia runtime with {binary} in containerd"
            )
        else:
            ok = rc == 0 and "enable_cdi = true" in dump
            detail = "containerd has CDI enabled" if ok else "containerd's CDI is not enabled"
        checks.append(_check("gpu/container-toolkit", ok, detail))
    return checks


def check_node(root: Path, node: dict[str, Any]) -> list[Check]:
    """Every node check for ``node`` (``contents.node``); names as :func:`check_names` lists them."""
    if not node:
        return []
    checks = [check_files(root, node), check_units(node)]
    if node.get("host"):
        checks += check_host(root, node["host"])
    if node.get("container_runtime"):
        checks += check_runtime(root, node["container_runtime"])
    if node.get("gpu"):
        checks += check_gpu(root, node["gpu"])
    return checks
