"""What both ``make demo`` chains share: the printing, the server's configuration, the token and audit view."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TRUST_DOMAIN = "demo.nodetrust.test"
NODE_NAME = "demo-node-1"
# The booted image is a node: its pool keeps every node check as the preset has it (fatal), with room
# for the fixture image's 6 GiB disk (the preset asks 20 GiB free). The host of --host-only is not a node
# (no container runtime, no kubelet of the image): there, and only there, the node checks warn.
VM_POOL: dict[str, Any] = {"preset": "cpu", "node": {"min_free_disk_gib": 2}}
HOST_POOL: dict[str, Any] = {"preset": "cpu", "checks": {"warn": ["node.*"]}}


def pool_profile_text(pool: dict[str, Any]) -> str:
    """The pool as the node's own profile file (``nodeagent check --pool``): the server's, named cpu."""
    import yaml

    return yaml.safe_dump({"name": "cpu", **pool}, sort_keys=False)


class DemoError(Exception):
    """A step failed; the message says which and what to do."""


OTHER_VM_WAIT_S = 1800


WAITED = [0.0]  # seconds spent waiting for other VMs (not the demo's own time)


def _alive(pid: str) -> bool:
    """Not a zombie (an exited QEMU its parent has not reaped yet still matches ``pgrep``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_other_vms() -> None:
    """One VM at a time on this machine: wait while another QEMU runs."""
    began = time.monotonic()
    deadline, said = began + OTHER_VM_WAIT_S, False
    while True:
        found = subprocess.run(["pgrep", "-f", "qemu-system"], capture_output=True, text=True, check=False)  # noqa: S607
        others = [
            pid for pid in found.stdout.split() if pid.strip() and int(pid) != os.getpid() and _alive(pid)
        ]
        if not others:
            WAITED[0] += time.monotonic() - began
            return
        if time.monotonic() > deadline:
            raise DemoError(
                f"another VM (qemu pids {', '.join(others)}) ran for {OTHER_VM_WAIT_S} s: retry later"
            )
        if not said:
            print(
                f"  another VM is running (qemu pids {', '.join(others)}): waiting for it to finish",
                flush=True,
            )
            said = True
        time.sleep(10)


def step(n: int | str, text: str) -> None:
    print(f"\n\033[1m[{n}] {text}\033[0m", flush=True)


def say(text: str, indent: str = "  ") -> None:
    print(indent + text.rstrip().replace("\n", "\n" + indent), flush=True)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("  $ " + " ".join(argv[2:] if argv[:2] == [sys.executable, "-m"] else argv), flush=True)
    return subprocess.run(argv, text=True, capture_output=True, cwd=ROOT, check=False, **kwargs)  # type: ignore[call-overload,no-any-return]


def server_config(
    work: Path,
    measurements: Path | None = None,
    *,
    kubernetes_version: str = "1.36.3",
    pool: dict[str, Any] = HOST_POOL,
) -> dict[str, Any]:
    """A fresh trust domain on loopback ports, trusting the EK CA in ``work/server/ek-ca``; with
    ``measurements`` (a build's boot-measurements.json) the pool admits only that release's boot. The
    join answer names ``kubernetes_version``: the version the node's agent makes the installed one."""
    from tests.support.joinenv import cluster_ca

    cluster_ca(work / "server" / "cluster-ca.pem")
    tokens = work / "server" / "tokens"
    tokens.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {
        "trust_domain": TRUST_DOMAIN,
        "data_dir": str(work / "server" / "data"),
        "listen": "127.0.0.1:0",
        "join_listen": "127.0.0.1:0",
        "metrics_listen": "off",
        "ek_trust": {"ca_dir": str(work / "server" / "ek-ca")},
        "cluster": {
            "api_server_endpoint": "192.0.2.10:6443",
            "ca_cert": str(work / "server" / "cluster-ca.pem"),
            "kubernetes_version": f"v{kubernetes_version}",
        },
        "join": {"token_ttl": "15m"},
        "token_backend": {"type": "file", "directory": str(tokens)},
        "pools": {"cpu": {"profile": dict(pool), **_measured(measurements)}},
    }


def demo_kubernetes_version(kubernetes: dict[str, Any]) -> str:
    """The control plane's version for the demo, from the image's manifest ``kubernetes`` entry
    (``installed``, ``staged``): the newest staged version of the minor below the installed one when
    the image stages one (the pool's control plane a minor behind: the node switches its kubelet before
    joining), else the installed version."""

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    installed = str(kubernetes.get("installed") or "1.36.3")
    major, minor = key(installed)[:2]
    below = [str(v) for v in kubernetes.get("staged") or [] if key(str(v))[:2] == (major, minor - 1)]
    return max(below, key=key) if below else installed


def _measured(measurements: Path | None) -> dict[str, Any]:
    if measurements is None:
        return {}
    import hashlib

    raw = measurements.read_bytes()
    name = str(json.loads(raw).get("image") or "release")
    release = {"name": name, "measurements": str(measurements), "sha256": hashlib.sha256(raw).hexdigest()}
    return {"measured_boot": {"releases": [release], "nonce_ttl": "5m"}}


def show_measured_boot(audit: list[dict[str, Any]]) -> None:
    """The admitted joins' releases and PCRs, from the audit log (what the server verified)."""
    for entry in audit:
        if entry.get("result") == "ok" and entry.get("release"):
            print(
                f"  measured boot verified: quote signed by the attested AK over the server's nonce, event log replayed "
                f"to it; booted release {entry['release']} (PCRs {entry.get('checked_pcrs')} compared, "
                f"{entry.get('unchecked_pcrs')} quoted but not compared)"
            )


def token_secrets(work: Path) -> list[str]:
    import yaml

    found = []
    for manifest in sorted((work / "server" / "tokens").glob("*.yaml")):
        data = (yaml.safe_load(manifest.read_text()) or {}).get("stringData") or {}
        if data.get("token-secret"):
            found.append(str(data["token-secret"]))
    return found


def leaked_tokens(text: str, token_ids: set[Any]) -> list[str]:
    """Every whole bootstrap token (``id.secret``) of ``token_ids`` in ``text``."""
    found = []
    for token_id in sorted(str(t) for t in token_ids if t):
        found += re.findall(rf"(?<![a-z0-9]){re.escape(token_id)}\.[a-z0-9]{{16}}(?![a-z0-9])", text)
    return found


def show_token_and_audit(work: Path) -> list[dict[str, Any]]:
    """Print the token manifests (the secret half redacted) and the audit lines; return the audit."""
    for manifest in sorted((work / "server" / "tokens").glob("*.yaml")):
        print(f"  {manifest} (mode {oct(manifest.stat().st_mode & 0o777)}; its token-secret redacted here):")
        text = re.sub(
            r"(token-secret:\s*)(\S+)", lambda m: f"{m.group(1)}<redacted: {len(m.group(2))} characters>",
            manifest.read_text().strip(),
        )  # fmt: skip
        say(text, "    ")
    path = work / "server" / "data" / "audit.jsonl"
    lines = path.read_text().strip().splitlines() if path.exists() else []
    for line in lines:
        print("  " + line)
    return [json.loads(line) for line in lines]
