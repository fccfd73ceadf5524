"""``make demo``, inside the booted node image: the agent's steps, each reported to the host.

The host (``scripts/demo.py``) puts this file, the agent's configuration, the trust bundle and
the pool profile in the VM's NoCloud seed (``write_files`` under ``/run/nodetrust-demo``) and
runs ``guest.py run /run/nodetrust-demo`` from cloud-init's ``runcmd``, i.e. after
``multi-user.target``: by then ``nodeagent.service`` has already run once under systemd and
stopped for want of a configuration (exit status 2), as the image ships it. Then:

1. ``boot``: the TPM device and that first, unconfigured run of the service;
2. ``configure``: the configuration goes into ``/etc/nodeagent`` (0600);
3. ``attest``: ``nodeagent attest`` with the VM's TPM (the host's swtpm, whose EK certificate
   the server trusts) through ``10.0.2.100`` (relayed by QEMU to the server on the host);
4. ``check``: ``nodeagent check`` against the CPU pool profile;
5. ``join``: ``systemctl start nodeagent.service``: the real unit runs ``nodeagent run``
   (verify, join credentials over mutual TLS, ``kubeadm join``), and its journal;
6. ``kubeadm``: what the kubeadm stand-in received;
7. ``status``: ``nodeagent status``.

Each step is one line on the data port (``/dev/ttyS1``): ``NODETRUST-DEMO <json>``; the last
one is ``{"done": true, "ok": ...}``, then the VM powers itself off.

``guest.py kubeadm join --config FILE`` is the image's kubeadm for this demo (the agent's
``kubeadm`` setting points at a wrapper running it): a stand-in, as no cluster can run here.
It checks the call as kubeadm would (argv, one ``kubeadm.k8s.io/v1beta4`` JoinConfiguration,
token format, pinned CA, DNS-1123 node name, ``unix://`` CRI socket) and that the file is 0600,
records the configuration with the token's secret half redacted, and prints kubeadm's success
output. The host validates the recorded document against the full v1beta4 schema
(``tests/support/kubeadm_double.py``'s).

Runs with the agent's virtual environment's Python (standard library, plus PyYAML for the
kubeadm stand-in), as root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DATA_PORT = "/dev/ttyS1"
MARK = "NODETRUST-DEMO "
CONFIG_DIR = Path("/etc/nodeagent")
RECORD = Path("/var/lib/nodetrust-demo/kubeadm-calls.jsonl")
VENV = Path("/opt/nodeagent/venv")
NODEAGENT = str(VENV / "bin" / "nodeagent")
UNIT = "nodeagent.service"
TOKEN = re.compile(r"\b([a-z0-9]{6})\.[a-z0-9]{16}\b")
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CA_HASH = re.compile(r"sha256:[0-9a-f]{64}")
KUBEADM_SUCCESS = """[preflight] Running pre-flight checks
[kubelet-start] Writing kubelet configuration to file "/var/lib/kubelet/config.yaml"
[kubelet-start] Starting the kubelet
[kubelet-start] Waiting for the kubelet to perform the TLS Bootstrap

This node has joined the cluster (nodetrust demo kubeadm stand-in: no cluster was contacted).
"""


# The node's loopback services (the attestation and join servers, the site NTP server) are carried to
# the host by the relay (imagebuilder/guest/relay.py), which the seed's bootcmd starts as
# nodetrust-relay.service before anything waits for the clock.
RELAY_UNIT = "nodetrust-relay.service"


def _relay_running(seconds: float) -> tuple[bool, str]:
    """Whether the relay unit is running (waiting at most ``seconds``), and its journal."""
    deadline = time.monotonic() + seconds
    while True:
        _, state = _run("systemctl", "is-active", RELAY_UNIT, timeout=30)
        if state.strip() == "active" or time.monotonic() > deadline:
            break
        time.sleep(1)
    _, journal = _run("journalctl", "--no-pager", "-o", "cat", "-u", RELAY_UNIT, timeout=30)
    return state.strip() == "active", f"{RELAY_UNIT}: {state.strip()}\n{journal}"


def _wait_for_time_sync(seconds: float) -> str:
    """Wait (at most ``seconds``) for systemd-timesyncd to synchronise with the release's NTP server, which
    it reaches through the relay; what timedatectl then says."""
    deadline = time.monotonic() + seconds
    while True:
        _, synced = _run("timedatectl", "show", "-p", "NTPSynchronized", "--value", timeout=30)
        if synced.strip() == "yes" or time.monotonic() > deadline:
            break
        time.sleep(2)
    _, status = _run("timedatectl", "timesync-status", timeout=30)
    _, waited = _run("systemctl", "is-active", "systemd-time-wait-sync.service", timeout=30)
    return f"NTPSynchronized={synced.strip()}\nsystemd-time-wait-sync.service: {waited.strip()}\n{status}"


def _run(*argv: str, timeout: float = 900) -> tuple[int, str]:
    env = {**os.environ, "LC_ALL": "C.UTF-8", "SYSTEMD_PAGER": "", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    try:
        proc = subprocess.run(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"{argv[0]}: {exc}"
    return proc.returncode, proc.stdout.strip()


def report(entry: dict[str, Any]) -> None:
    line = MARK + json.dumps(entry, sort_keys=True) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    try:
        with open(DATA_PORT, "w", encoding="utf-8") as port:
            port.write(line)
    except OSError as exc:
        print(f"demo: cannot write to {DATA_PORT}: {exc}", file=sys.stderr)


def step(n: int, name: str, ok: bool, output: str, **detail: Any) -> bool:
    report({"step": n, "name": name, "ok": ok, "output": output, **detail})
    return ok


def _unit(*props: str) -> dict[str, str]:
    _, out = _run("systemctl", "show", UNIT, *(f"--property={p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def run(seed: Path) -> bool:
    demo = json.loads((seed / "demo.json").read_text())

    # 1. boot: the TPM, and the service's first run without a configuration.
    first = _unit("ActiveState", "Result", "ExecMainStatus")
    tpm = Path("/dev/tpmrm0")
    ok = tpm.exists()
    text = (
        f"{tpm} {'present' if ok else 'MISSING'}; {UNIT} at boot, with no configuration: "
        f"{first.get('ActiveState')} ({first.get('Result')}, exit status {first.get('ExecMainStatus')})"
    )
    if not step(1, "boot", ok, text, unit=first):
        return False

    # The servers, through the host: 127.0.0.1:<port> here, relayed over the one guest forward.
    running, relayed = _relay_running(60)
    if not running:
        step(2, "relay", False, f"the relay to the host's services is not running:\n{relayed}")
        return False
    synced = relayed + "\n" + _wait_for_time_sync(float(demo.get("time_sync_s", 0)))

    # 2. configure.
    CONFIG_DIR.mkdir(mode=0o700, exist_ok=True)
    for name in ("config.yaml", "bundle.pem", "pool.yaml"):
        target = CONFIG_DIR / name
        shutil.copyfile(seed / name, target)
        target.chmod(0o600)
    listing = "\n".join(f"{stat.filemode(p.stat().st_mode)} {p}" for p in sorted(CONFIG_DIR.iterdir()))
    step(2, "configure", True, listing + "\n--- /etc/nodeagent/config.yaml ---\n"
         + (CONFIG_DIR / "config.yaml").read_text().strip() + f"\n--- time ---\n{synced}")  # fmt: skip

    # 3. attest.
    rc, out = _run(
        NODEAGENT, "-v", "attest",
        "--server", demo["server"],
        "--trust-domain", demo["trust_domain"],
        "--bundle", str(CONFIG_DIR / "bundle.pem"),
        "--require-ek-cert",
        timeout=600,
    )  # fmt: skip
    if not step(3, "attest", rc == 0, out, rc=rc):
        return False

    # 4. check.
    rc, out = _run(NODEAGENT, "check", "--pool", str(CONFIG_DIR / "pool.yaml"), timeout=600)
    if not step(4, "check", rc == 0, out, rc=rc):
        return False

    # 5. join, by the real unit.
    _run("systemctl", "reset-failed", UNIT)
    rc, out = _run("systemctl", "start", UNIT, timeout=900)
    unit = _unit("ActiveState", "Result", "ExecMainStatus", "InvocationID")
    _, journal = _run(
        "journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={unit.get('InvocationID', '')}"
    )
    joined = Path("/var/lib/nodeagent/joined").exists()
    ok = rc == 0 and unit.get("Result") == "success" and joined
    text = (
        f"systemctl start {UNIT}: exit {rc}{(' ' + out) if out else ''}\n"
        f"{UNIT}: {unit.get('ActiveState')} ({unit.get('Result')}, exit status {unit.get('ExecMainStatus')}); "
        f"/var/lib/nodeagent/joined {'present' if joined else 'absent'}\n--- journalctl -u {UNIT} ---\n{journal}"
    )
    step(5, "join", ok, text, rc=rc, unit=unit, joined=joined)

    # 6. what kubeadm received.
    calls = [json.loads(line) for line in RECORD.read_text().splitlines()] if RECORD.exists() else []
    step(
        6,
        "kubeadm",
        ok and bool(calls) and all(c["valid"] for c in calls),
        f"{len(calls)} call(s)",
        calls=calls,
    )

    # 7. status.
    rc, out = _run(NODEAGENT, "status", timeout=60)
    step(7, "status", rc == 0, out, rc=rc)
    return ok and bool(calls)


# -- the kubeadm stand-in -------------------------------------------------------------------------


def _redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        return TOKEN.sub(r"\1.<redacted>", value)
    return value


def _validate(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["the JoinConfiguration is not a mapping"]
    errors = []
    if doc.get("apiVersion") != "kubeadm.k8s.io/v1beta4" or doc.get("kind") != "JoinConfiguration":
        errors.append(
            f"expected kubeadm.k8s.io/v1beta4 JoinConfiguration, got {doc.get('apiVersion')} {doc.get('kind')}"
        )
    discovery = doc.get("discovery") or {}
    bootstrap = discovery.get("bootstrapToken") or {}
    if not TOKEN.fullmatch(str(bootstrap.get("token", ""))):
        errors.append("discovery.bootstrapToken.token is not a bootstrap token ([a-z0-9]{6}.[a-z0-9]{16})")
    host, _, port = str(bootstrap.get("apiServerEndpoint", "")).rpartition(":")
    if not host or not port.isdigit():
        errors.append("discovery.bootstrapToken.apiServerEndpoint is not HOST:PORT")
    hashes = bootstrap.get("caCertHashes") or []
    if not bootstrap.get("unsafeSkipCAVerification") and not (
        hashes and all(CA_HASH.fullmatch(str(h)) for h in hashes)
    ):
        errors.append(
            "discovery.bootstrapToken.caCertHashes: the API server's CA must be pinned (sha256:<hex>)"
        )
    registration = doc.get("nodeRegistration") or {}
    if not DNS1123.fullmatch(str(registration.get("name", ""))):
        errors.append(f"nodeRegistration.name {registration.get('name')!r} is not a DNS-1123 name")
    if not str(registration.get("criSocket", "")).startswith("unix://"):
        errors.append("nodeRegistration.criSocket is not a unix:// socket")
    return errors


def _kubernetes_installed() -> dict[str, Any]:
    """What runs beside kubeadm: ``kubelet --version``, the Kubernetes packages' versions and holds."""
    _, kubelet = _run("kubelet", "--version", timeout=120)
    _, listed = _run("dpkg-query", "-W", "-f", "${Package} ${Version}\n", "kubeadm", "kubelet", "kubectl")
    _, held = _run("apt-mark", "showhold")
    packages = dict(line.split(" ", 1) for line in listed.splitlines() if line.count(" ") == 1)
    version = [line for line in kubelet.splitlines() if line.startswith("Kubernetes v")]
    return {
        "kubelet_version": version[-1] if version else kubelet[-200:],
        "packages": packages,
        "held": sorted(held.split()),
    }


def kubeadm(argv: list[str]) -> int:
    if argv[:1] == ["version"]:
        print("kubeadm version: nodetrust demo stand-in")
        return 0
    config, errors = None, []
    if len(argv) == 3 and argv[:2] == ["join", "--config"]:
        config = Path(argv[2])
    elif len(argv) == 2 and argv[0] == "join" and argv[1].startswith("--config="):
        config = Path(argv[1].split("=", 1)[1])
    else:
        errors.append(f"the demo's kubeadm stand-in only takes `join --config FILE`, got {argv}")
    doc: Any = None
    mode = ""
    if config is not None:
        import yaml

        try:
            mode = f"{stat.S_IMODE(config.stat().st_mode):04o}"
            docs = [d for d in yaml.safe_load_all(config.read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as exc:
            docs = []
            errors.append(f"unable to read config from {config}: {exc}")
        if mode and mode != "0600":
            errors.append(f"{config} has mode {mode}; it holds a bootstrap token and must be 0600")
        if len(docs) == 1:
            doc = docs[0]
            errors += _validate(doc)
        elif docs:
            errors.append(f"expected one JoinConfiguration document, got {len(docs)}")
    RECORD.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with RECORD.open("a", encoding="utf-8") as fh:
        entry = {
            "argv": _redact(argv),
            "config": _redact(doc),
            "mode": mode,
            "valid": not errors,
            "errors": errors,
            **_kubernetes_installed(),
        }
        fh.write(json.dumps(entry) + "\n")
    if errors:
        for error in errors:
            print(f"error execution phase preflight: {error}", file=sys.stderr)
        return 1
    print(KUBEADM_SUCCESS, end="")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["kubeadm"]:
        return kubeadm(argv[1:])
    if len(argv) != 2 or argv[0] != "run":
        print("usage: guest.py run SEED_DIR | guest.py kubeadm join --config FILE", file=sys.stderr)
        return 2
    ok = False
    try:
        ok = run(Path(argv[1]))
    except Exception as exc:  # every failure must reach the host, then the VM powers off
        report({"step": 0, "name": "error", "ok": False, "output": f"{type(exc).__name__}: {exc}"})
    finally:
        report({"done": True, "ok": ok})
        time.sleep(1)
        _run("systemctl", "poweroff", "--no-block", timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
