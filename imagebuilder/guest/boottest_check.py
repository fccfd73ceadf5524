"""The boot test, inside the booted image: check what the node has and report a verdict.

Runs with the image's own ``python3`` (standard library only), from the NoCloud seed that
``imagebuilder test`` attaches (:mod:`imagebuilder.boottest`), in two parts:

``early`` (cloud-init ``bootcmd``, in cloud-init's init stage, before its ``ssh`` and
``write_files`` modules): what only the image *as shipped* can answer, judged before this first
boot changes it or from proof that this boot changed it:

* ``image/machine-id``: systemd saw no machine id (``/run/systemd/first-boot``, or
  ``/etc/machine-id`` written or mounted at this boot), i.e. the image's was empty;
* ``image/ssh-host-keys``: no ``/etc/ssh/ssh_host_*`` older than this boot;
* ``image/agent-config``: the agent's configuration folder exists and is empty;
* ``image/build-leftovers``: nothing the build used inside the target is left (the base's
  compiled pip, the staging medium's mount point and apt source, the no-daemons policy, the
  installer's logs, the provisioning hook). The host adds ``image/build-credentials``: none of the
  build's credentials in any byte of the image (imagebuilder.imagescan).

The image enables ``systemd-time-wait-sync.service`` so that the agent (ordered after
``time-sync.target``) never runs on a wrong clock. The boot test serves the guest time as a rack
does: its own NTP server on the host's loopback (:mod:`imagebuilder.sntp`), reached through the
relay that the seed's first ``bootcmd`` starts (:mod:`imagebuilder.guest.relay`), named in the file
a node-pool release writes (``write_files``); so the boot waits for the clock as a node's does, and
``node/time-sync`` requires the client synchronised. Only an image that enables the wait but
declares no time client (nothing for the boot test to configure) has the wait stopped for this
boot only (``mask --runtime``), with a console line saying so. It queues the ``late`` part as a
transient unit ordered after ``multi-user.target`` and ``cloud-final.service``.

``late``: the Kubernetes packages installed at the expected version and held, the staged
versions, every staged file (artifacts, Kubernetes debs, the agent's units) at its path with
its digest and mode, the agent's venv and version, its units enabled, the agent's own TPM code
reading the EK, ``nodeagent.service`` having run under systemd (and stopped for want of a
configuration, exit status 2, as an image without a node pool release must), the node's host
configuration, container runtime (its images imported) and GPU stack (``nodecheck.py``, next to this
script), the package list equal to the manifest's, and cloud-init finished without errors.

Each part writes its checks as one JSON line on the data port (``NODETRUST-BOOTTEST-EARLY`` /
``NODETRUST-BOOTTEST``, followed by the SHA-256 of the JSON, then the JSON) and a PASS/FAIL line
per check on the console; the late part then powers the VM off.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

STATE = Path("/run/nodetrust-boottest")
SCRIPT = "nodetrust-boottest.py"
NODE_SCRIPT = "nodecheck.py"  # the node checks (imagebuilder/guest/nodecheck.py), next to this script
EXPECT = "expect.json"
LATE_UNIT = "nodetrust-boottest-late"
TIME_WAIT_SYNC = "systemd-time-wait-sync.service"
Check = dict[str, Any]


def _run(*argv: str, timeout: float = 120) -> tuple[int, str]:
    """A command's exit status and its stdout+stderr (the guest has no builder chokepoint)."""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "SYSTEMD_PAGER": "", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _check(name: str, ok: bool, detail: str) -> Check:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _boot_time(root: Path) -> float:
    for line in (root / "proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return time.time() - float((root / "proc/uptime").read_text().split()[0])


# -- early: the image as shipped ---------------------------------------------------------------


def check_machine_id(root: Path, btime: float) -> Check:
    path = root / "etc/machine-id"
    evidence = []
    if (root / "run/systemd/first-boot").exists():
        evidence.append("systemd detected its first boot (/run/systemd/first-boot)")
    try:
        st = path.stat()
        content = path.read_text().strip()
    except OSError as exc:
        return _check("image/machine-id", False, f"/etc/machine-id cannot be read: {exc}")
    if st.st_mtime >= btime - 1:
        evidence.append("/etc/machine-id was written at this boot")
    if os.path.ismount(path):
        evidence.append("/etc/machine-id is a transient mount of this boot")
    if evidence:
        return _check("image/machine-id", True, "the image's machine id was empty: " + "; ".join(evidence))
    return _check(
        "image/machine-id",
        False,
        f"the image shipped a machine id ({content[:8]}..., written before this boot): every node "
        "booted from it would share it; the staging plan must empty /etc/machine-id",
    )


def check_ssh_host_keys(root: Path, btime: float) -> Check:
    shipped: list[str] = []
    fresh: list[str] = []
    for name in sorted(glob.glob(str(root / "etc/ssh/ssh_host_*"))):
        (fresh if os.stat(name).st_mtime >= btime - 1 else shipped).append(os.path.basename(name))
    if shipped:
        return _check(
            "image/ssh-host-keys",
            False,
            f"the image shipped SSH host keys {', '.join(shipped)}: every node would share them",
        )
    return _check(
        "image/ssh-host-keys", True, f"none in the image ({len(fresh)} made at this boot, none older)"
    )


def check_agent_config(root: Path, expect: dict[str, Any]) -> Check:
    folder = root / expect["agent"]["config_dir"].lstrip("/")
    if not folder.is_dir():
        return _check("image/agent-config", False, f"{folder} does not exist")
    entries = sorted(os.listdir(folder))
    mode = stat.S_IMODE(folder.stat().st_mode)
    if entries:
        return _check("image/agent-config", False, f"{folder} is not empty: {', '.join(entries)}")
    return _check("image/agent-config", mode == 0o700, f"{folder} is empty, mode {mode:04o}")


#: What ``stage.sh`` uses inside the target and must remove (or never leave) before the image ships.
BUILD_LEFTOVERS = (
    "var/lib/nodetrust-build",
    "var/lib/nodetrust-staging",
    "etc/apt/nodetrust-staging.list",
    "etc/apt/nodetrust-staging.d",
    "usr/sbin/policy-rc.d",
    "var/log/installer",  # the installer's logs and its copy of the autoinstall user-data (the webhook token)
    "usr/lib/nodetrust/provision-init",  # the provisioning boot's PID 1
)


def check_build_leftovers(root: Path) -> Check:
    left = [f"/{rel}" for rel in BUILD_LEFTOVERS if os.path.lexists(root / rel)]
    if left:
        return _check(
            "image/build-leftovers", False, f"the image ships what the build used: {', '.join(left)}"
        )
    return _check("image/build-leftovers", True, f"none of {len(BUILD_LEFTOVERS)} build paths in the image")


# -- late: the booted node ------------------------------------------------------------------------


def check_kubernetes(expect: dict[str, Any]) -> list[Check]:
    kube = expect.get("kubernetes") or {}
    if not kube:
        return []
    wanted, versions, held, problems = kube["installed"], [], [], []
    for package in kube["packages"]:
        rc, out = _run("dpkg-query", "-W", "-f=${Version}\t${Status}", package)
        if rc != 0:
            problems.append(f"{package} is not installed")
            continue
        version, _, status = out.partition("\t")
        versions.append(f"{package} {version}")
        if not version.startswith(wanted + "-") or not status.endswith("ok installed"):
            problems.append(f"{package} is {version} ({status}), expected {wanted}-*")
        if status.startswith("hold "):
            held.append(package)
    checks = [
        _check("kubernetes/installed", not problems, "; ".join(problems or versions)),
        _check(
            "kubernetes/held",
            set(held) == set(kube["packages"]),
            f"held: {', '.join(held) or 'none'} (expected {', '.join(kube['packages'])})",
        ),
    ]
    missing = []
    for version, folder in sorted(kube.get("staged", {}).items()):
        if not glob.glob(os.path.join(folder, "*.deb")):
            missing.append(f"{version} (no .deb in {folder})")
    checks.append(
        _check(
            "kubernetes/staged",
            not missing,
            "missing: " + ", ".join(missing)
            if missing
            else "staged: " + ", ".join(sorted(kube.get("staged", {}))),
        )
    )
    return checks


def _file_problem(root: Path, entry: dict[str, Any]) -> str:
    path = root / entry["path"].lstrip("/")
    if "link" in entry:
        if not path.is_symlink():
            return f"{entry['path']} is not a symbolic link"
        target = os.readlink(path)
        return "" if target == entry["link"] else f"{entry['path']} points to {target}, not {entry['link']}"
    if not path.is_file() or path.is_symlink():
        return f"{entry['path']} is missing"
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        return f"{entry['path']} has sha256 {digest.hexdigest()[:16]}..., expected {entry['sha256'][:16]}..."
    mode = stat.S_IMODE(path.stat().st_mode)
    if "mode" in entry and mode != int(entry["mode"], 8):
        return f"{entry['path']} has mode {mode:04o}, expected {entry['mode']}"
    return ""


def check_files(root: Path, expect: dict[str, Any]) -> list[Check]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for entry in expect.get("files", []):
        groups.setdefault(entry["group"], []).append(entry)
    checks = []
    for group, entries in sorted(groups.items()):
        problems = [p for p in (_file_problem(root, e) for e in entries) if p]
        detail = (
            f"{len(problems)} of {len(entries)} files wrong: " + "; ".join(problems[:4])
            if problems
            else f"{len(entries)} files at their paths with their digests"
        )
        checks.append(_check(f"files/{group}", not problems, detail))
    return checks


def check_agent(expect: dict[str, Any]) -> list[Check]:
    agent = expect["agent"]
    venv = agent["venv"]
    entry = os.path.join(venv, "bin", "nodeagent")
    checks = []
    rc, out = _run(
        os.path.join(venv, "bin", "python"),
        "-c",
        f"import importlib.metadata as m; print(m.version({agent['distribution']!r}))",
    )
    ok = rc == 0 and out.splitlines()[-1:] == [agent["version"]] and os.access(entry, os.X_OK)
    checks.append(
        _check(
            "agent/venv",
            ok,
            f"{agent['distribution']} {out.splitlines()[-1] if out else '?'} in {venv}"
            + ("" if os.access(entry, os.X_OK) else f"; {entry} is missing")
            + ("" if ok else f" (expected {agent['version']})"),
        )
    )
    states = []
    for unit in agent["units"]:
        _rc, state = _run("systemctl", "is-enabled", unit)
        states.append((unit, state.splitlines()[-1] if state else "unknown"))
    checks.append(
        _check(
            "agent/units",
            all(state == "enabled" for _unit, state in states),
            ", ".join(f"{unit} {state}" for unit, state in states),
        )
    )
    rc, out = _run(entry, "attest", "--print-ek-hash", timeout=300)
    last = out.splitlines()[-1] if out else ""
    tpm_ok = rc == 0 and len(last) == 64 and all(c in "0123456789abcdef" for c in last)
    checks.append(
        _check(
            "agent/tpm",
            tpm_ok,
            f"the agent read the EK through /dev/tpmrm0: sha256 {last}"
            if tpm_ok
            else f"nodeagent attest --print-ek-hash exited {rc}: {out[-400:]}",
        )
    )
    service = agent["service"]
    _rc, out = _run(
        "systemctl",
        "show",
        service,
        "--property=ActiveState,Result,ExecMainStatus,ExecMainStartTimestampMonotonic",
    )
    props = dict(line.partition("=")[::2] for line in out.splitlines())
    _rc, journal = _run("journalctl", "-b", "-u", service, "-o", "cat", "-n", "12", "--no-pager")
    # the agent's own last words, not systemd's bookkeeping ("nodeagent.service: Consumed ...")
    bookkeeping = (service + ":", "Started ", "Starting ", "Failed to start ", "Stopped ", "Deactivated ")
    said = [line for line in journal.splitlines() if line.strip() and not line.startswith(bookkeeping)]
    journal = "\n".join(said[-1:]) or journal
    ran = props.get("ExecMainStartTimestampMonotonic", "0") not in ("", "0")
    status = props.get("ExecMainStatus", "")
    checks.append(
        _check(
            "agent/service",
            ran and status == "2",
            (
                f"{service} ran at boot and stopped with status {status} (no configuration in the image, as "
                f"expected): {journal.splitlines()[-1] if journal else ''}"
            )
            if ran and status == "2"
            else f"{service}: {props} {journal[-400:]}",
        )
    )
    return checks


def check_packages(expect: dict[str, Any]) -> Check:
    rc, out = _run("dpkg-query", "-W", "-f=${binary:Package}\t${Version}\t${Architecture}\n")
    if rc != 0:
        return _check("packages", False, f"dpkg-query failed: {out[-300:]}")
    have = {}
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 3:
            have[(fields[0].split(":")[0], fields[2])] = fields[1]
    want = {(p["name"], p["architecture"]): p["version"] for p in expect.get("packages", [])}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    changed = sorted(f"{k[0]} {have[k]} != {want[k]}" for k in set(want) & set(have) if want[k] != have[k])
    problems = (
        ([f"missing {', '.join(n for n, _ in missing[:5])}"] if missing else [])
        + ([f"not in the manifest {', '.join(n for n, _ in extra[:5])}"] if extra else [])
        + changed[:5]
    )
    return _check(
        "packages",
        not problems,
        "; ".join(problems) if problems else f"the {len(have)} installed packages are the manifest's",
    )


def check_cloud_init(root: Path) -> Check:
    result_path = root / "run/cloud-init/result.json"
    status_path = root / "run/cloud-init/status.json"
    if not result_path.exists():
        return _check("cloud-init", False, "cloud-init has not finished (no /run/cloud-init/result.json)")
    result = json.loads(result_path.read_text()).get("v1", {})
    status = json.loads(status_path.read_text()).get("v1", {}) if status_path.exists() else {}
    errors = list(result.get("errors") or [])
    unfinished = []
    for stage, info in status.items():
        if isinstance(info, dict) and "errors" in info:
            errors += info.get("errors") or []
            errors += [f"recoverable: {e}" for e in (info.get("recoverable_errors") or {})]
            if info.get("start") and not info.get("finished"):
                unfinished.append(stage)
    if errors or unfinished:
        return _check(
            "cloud-init",
            False,
            "; ".join([*(str(e) for e in errors[:4]), *(f"{s} unfinished" for s in unfinished)]),
        )
    return _check("cloud-init", True, f"done, no errors (datasource {result.get('datasource', '?')})")


def _node_checks(root: Path, expect: dict[str, Any]) -> list[Check]:
    """The host configuration, the container runtime and the GPU stack (nodecheck.py, shipped beside us)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nodecheck", STATE / NODE_SCRIPT)
    if spec is None or spec.loader is None:
        return [_check("node", False, f"cannot load {STATE / NODE_SCRIPT}")]
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found: list[Check] = module.check_node(root, expect.get("node") or {})
    return found


# -- measured boot ---------------------------------------------------------------------------------

EVENT_LOG = Path("/sys/kernel/security/tpm0/binary_bios_measurements")
MAX_EVENT_LOG = 2 * 1024 * 1024  # what the attestation server reads (protocol.eventlog.MAX_LOG_BYTES)


def read_event_log(path: Path = EVENT_LOG) -> tuple[Check, str]:
    """The firmware's TCG event log, base64 for the report (the host compares it with the build's prediction)."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_EVENT_LOG + 1)
    except OSError as exc:
        return (
            _check("measured-boot/event-log", False, f"no TCG event log at {path} ({exc.strerror}): the boot chain "
                   "did not hand the firmware's log to the kernel (GRUB must start it with linuxefi)"),
            "",
        )  # fmt: skip
    if not data or len(data) > MAX_EVENT_LOG:
        return _check("measured-boot/event-log", False, f"the event log has {len(data)} bytes"), ""
    return (
        _check("measured-boot/event-log", True, f"{len(data)} bytes read from {path}"),
        base64.b64encode(data).decode(),
    )


# -- reporting --------------------------------------------------------------------------------------


def report(expect: dict[str, Any], marker: str, checks: list[Check], extra: dict[str, Any]) -> None:
    verdict = {"passed": all(c["ok"] for c in checks), "checks": checks, **extra}
    text = json.dumps(verdict, sort_keys=True, separators=(",", ":"))
    line = f"{marker} {hashlib.sha256(text.encode()).hexdigest()} {text}\n"
    with open(expect["data_port"], "w", encoding="utf-8") as port:
        port.write(line)
    _console(expect, [f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}" for c in checks])


def _console(expect: dict[str, Any], lines: list[str]) -> None:
    try:
        with open(expect.get("console", "/dev/console"), "w", encoding="utf-8") as console:
            for line in lines:
                console.write(f"nodetrust-boottest: {line}\n")
    except OSError:
        pass


def _guarded(name: str, func: Any, *args: Any) -> list[Check]:
    try:
        result = func(*args)
    except Exception:  # a broken check is a failed check, never a missing verdict
        return [_check(name, False, "the check itself failed: " + traceback.format_exc()[-500:])]
    return result if isinstance(result, list) else [result]


def early(seed: Path) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    for name in (SCRIPT, NODE_SCRIPT, EXPECT):
        shutil.copyfile(seed / name, STATE / name)
    expect = json.loads((STATE / EXPECT).read_text())
    root = Path("/")
    btime = _boot_time(root)
    checks = [
        *_guarded("image/machine-id", check_machine_id, root, btime),
        *_guarded("image/ssh-host-keys", check_ssh_host_keys, root, btime),
        *_guarded("image/agent-config", check_agent_config, root, expect),
        *_guarded("image/build-leftovers", check_build_leftovers, root),
    ]
    (STATE / "early.json").write_text(json.dumps(checks))
    report(expect, "NODETRUST-BOOTTEST-EARLY", checks, {"boot_time": btime})
    rc, state = _run("systemctl", "is-enabled", TIME_WAIT_SYNC)
    time_sync = ((expect.get("node") or {}).get("host") or {}).get("time_sync") or {}
    served = bool(time_sync.get("servers"))  # the boot test's NTP server, through the relay
    if state.strip() == "enabled" and not served:
        _console(
            expect,
            [
                f"this image enables {TIME_WAIT_SYNC} but configures no time client for the boot test to serve: "
                "it is stopped and masked for this boot only (the image keeps it enabled) so that "
                "time-sync.target and multi-user.target are reached"
            ],
        )
        _run("systemctl", "mask", "--runtime", TIME_WAIT_SYNC)
        _run("systemctl", "stop", "--no-block", TIME_WAIT_SYNC)
    rc, out = _run(
        "systemd-run",
        f"--unit={LATE_UNIT}",
        "--description=nodetrust boot test (late checks)",
        "--no-block",
        "--property=Type=oneshot",
        "--property=After=multi-user.target",
        "--property=After=cloud-final.service",
        "--",
        sys.executable,
        str(STATE / SCRIPT),
        "late",
    )
    if rc != 0:
        _console(expect, [f"FAIL cannot queue the late checks: {out}"])
    return 0


def late() -> int:
    expect = json.loads((STATE / EXPECT).read_text())
    root = Path("/")
    checks: list[Check] = json.loads((STATE / "early.json").read_text())
    checks += _guarded("kubernetes", check_kubernetes, expect)
    checks += _guarded("files", check_files, root, expect)
    checks += _guarded("agent", check_agent, expect)
    checks += _guarded("node", _node_checks, root, expect)
    checks += _guarded("packages", check_packages, expect)
    checks += _guarded("cloud-init", check_cloud_init, root)
    _rc, kernel = _run("uname", "-r")
    extra: dict[str, Any] = {"boot_time": _boot_time(root), "kernel": kernel}
    if expect.get("measured_boot"):
        found, log = read_event_log()
        checks.append(found)
        extra["event_log"] = log
    report(expect, "NODETRUST-BOOTTEST", checks, extra)
    _run("systemctl", "poweroff", "--no-block")
    return 0


def main(argv: list[str]) -> int:
    if argv[1:2] == ["early"] and len(argv) == 3:
        try:
            return early(Path(argv[2]))
        except Exception:
            traceback.print_exc()
            return 0  # never fail cloud-init's bootcmd: the host reports the missing verdict
    if argv[1:] == ["late"]:
        try:
            return late()
        except Exception:  # still a verdict (a failed one) and a powered-off VM, never a hang
            crash = _check("checker", False, "the late checks crashed: " + traceback.format_exc()[-600:])
            try:
                report(json.loads((STATE / EXPECT).read_text()), "NODETRUST-BOOTTEST", [crash], {})
            finally:
                _run("systemctl", "poweroff", "--no-block")
            return 1
    print(f"usage: {SCRIPT} early SEED | late", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
