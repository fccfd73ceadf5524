"""``make demo``: a node image built, booted with a TPM, attested, checked and joined, printing each step.

The default chain (docs/demo.md):

1. the image: ``imagebuilder lock`` and ``build`` of ``examples/fixture-node.yaml`` (the fixture
   installer ISO and the stand-in payloads, served on the loopback), or of
   ``examples/ubuntu-2404-node.yaml`` when ``UBUNTU_ISO`` names the Ubuntu 24.04 server ISO;
   ``--image FOLDER`` boots an image already built instead;
2. a TPM: an swtpm state manufactured on the host with an EK certificate from a local EK CA;
3. the server: ``nodeserver`` on 127.0.0.1, a fresh trust domain trusting that EK CA, with a
   CPU node pool, a stand-in cluster CA and the ``file`` bootstrap-token backend;
4. the node: the image booted under libvirt with that TPM and a NoCloud seed that configures
   the agent; the guest reaches the server only through ``10.0.2.100:8080``, one QEMU character
   device to a relay on the host's loopback that carries each of the guest's connections to the
   server's attest or join port and nowhere else (user-mode networking, ``restrict=on``). Inside,
   ``scripts/demo_guest.py`` reports each step on the VM's data port: the agent attests, runs
   its checks against the CPU pool, and ``nodeagent.service`` gets join credentials and runs
   ``kubeadm join`` (a stand-in that checks and records the JoinConfiguration: no cluster can
   run here); then the VM powers off;
5. the token as the file backend wrote it (its secret redacted here), the server's audit lines,
   and the host's verdict: read from the server's audit log and token folder, not the console.

``--host-only`` runs the same agent steps on the host against the swtpm socket, without an
image or a VM (seconds instead of minutes). Everything runs from a temporary folder under
/var/tmp and is stopped and removed at the end (``--keep`` keeps the folder), even on failure,
Ctrl-C or SIGTERM; libvirtd/virtlogd are started if they are not running, and then stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from demo_common import (
    NODE_NAME,
    ROOT,
    TRUST_DOMAIN,
    VM_POOL,
    DemoError,
    demo_kubernetes_version,
    leaked_tokens,
    pool_profile_text,
    say,
    server_config,
    show_measured_boot,
    show_token_and_audit,
    step,
    token_secrets,
)
from demo_host import host_chain

FIXTURE_DEFINITION = ROOT / "examples" / "fixture-node.yaml"
UBUNTU_DEFINITION = ROOT / "examples" / "ubuntu-2404-node.yaml"
# The VM tier's download cache: offline, the fixture build only works from what it holds.
DEFAULT_CACHE = ROOT / ".cache" / "imagebuilder-vm-tests"
GUEST_ATTEST_PORT, GUEST_JOIN_PORT = 8081, 8082  # the guest relay's ports on the node's loopback
GUEST_NTP_PORT = 123  # UDP: the site NTP server (chronyd on the host), through the same relay
TIMESYNCD_DROP_IN = "/etc/systemd/timesyncd.conf.d/50-nodetrust.conf"  # nodespec.RELEASE_TIME_SERVERS
TIME_SYNC_S = 180  # how long the node waits for its clock to synchronise before its checks
GUEST_FORWARD = "10.0.2.100:8080"  # imagebuilder.domain.GUEST_FORWARD: the one stream to the host
SEED_DIR = "/run/nodetrust-demo"
VENV_PYTHON = "/opt/nodeagent/venv/bin/python3"
KUBEADM_STAND_IN = "/usr/local/sbin/nodetrust-demo-kubeadm"  # /run is mounted noexec
OTHER_VM_WAIT_S = 1800
VM_IDLE_S, VM_TOTAL_S = 600, 1500
CONSOLE_MILESTONES = re.compile(
    r"Linux version|Reached target (Basic System|Multi-User|Cloud-init)|Cloud-init v\. \S+ (running|finished)"
    r"|Power-Off|reboot: Power down"
)
# The boot loader or the kernel gave up: no point waiting for the idle limit.
BOOT_FAILURE = re.compile(
    r"grub rescue>|^error: invalid arch-independent ELF magic|Kernel panic - not syncing"
)
ESC = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# -- the VM chain: services, image, seed, boot ------------------------------------------------------


def _qemu_user_in_kvm_group() -> None:
    """As scripts/services.sh does: QEMU's user joins /dev/kvm's group, or libvirt re-probes QEMU
    on every domain start (~100 s each). Idempotent; only before libvirtd starts."""
    import grp
    import pwd

    kvm = Path("/dev/kvm")
    try:
        user = pwd.getpwnam("libvirt-qemu")
    except KeyError:
        return
    if not kvm.exists():
        return
    group = grp.getgrgid(kvm.stat().st_gid)
    if user.pw_gid != group.gr_gid and user.pw_name not in group.gr_mem:
        subprocess.run(["/usr/sbin/usermod", "-aG", group.gr_name, user.pw_name], check=True)


@contextlib.contextmanager
def libvirt_services(work: Path) -> Iterator[None]:
    """virtlogd and libvirtd, started here only if they are not running; stopped only if started here."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    sockets = {
        "virtlogd": Path("/var/run/libvirt/virtlogd-sock"),
        "libvirtd": Path("/var/run/libvirt/libvirt-sock"),
    }
    try:
        for name, sock in sockets.items():
            running = subprocess.run(["pgrep", "-x", name], capture_output=True, check=False).returncode == 0  # noqa: S607
            if running:
                continue
            binary = Path("/usr/sbin") / name
            if not binary.exists():
                raise DemoError(f"{binary} is missing: run `make deps` (installs libvirt-daemon-system)")
            if name == "libvirtd":
                _qemu_user_in_kvm_group()
            Path("/var/run/libvirt").mkdir(parents=True, exist_ok=True)
            Path("/var/log/libvirt/qemu").mkdir(parents=True, exist_ok=True)
            with (work / f"{name}.log").open("wb") as log:
                proc = subprocess.Popen([str(binary)], stdout=log, stderr=subprocess.STDOUT)
            started.append((name, proc))
            print(f"  started {name} (pid {proc.pid}); it is stopped at the end")
            deadline = time.monotonic() + 20
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DemoError(f"{name} did not come up; its log: {work / f'{name}.log'}")
                time.sleep(0.2)
        yield
    finally:
        for name, proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            print(f"  stopped {name} (pid {proc.pid}), which the demo started")


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


def _definition_variant(example: Path, out: Path, iso_url: str | None) -> Path:
    """``example`` with its relative paths made absolute (and the ISO URL replaced), written to ``out``."""
    import yaml

    data = yaml.safe_load(example.read_text())
    data["agent"]["source"] = str((example.parent / data["agent"]["source"]).resolve())
    repo = data.get("kubernetes", {}).get("repository", {})
    if "keyring" in repo:
        repo["keyring"] = str((example.parent / repo["keyring"]).resolve())
    for artifact in data.get("artifacts", []):
        checksums = artifact.get("checksums", {})
        if "keyring" in checksums:
            checksums["keyring"] = str((example.parent / checksums["keyring"]).resolve())
    for source in data.get("apt_sources", []):
        if "keyring" in source and not source["keyring"].startswith("/"):
            source["keyring"] = str((example.parent / source["keyring"]).resolve())
    if iso_url is not None:
        data["installer"]["iso"]["url"] = iso_url
        data["installer"]["iso"].pop("mirrors", None)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def check_ubuntu_iso(value: str) -> Path:
    path = Path(value).expanduser()
    hint = "set UBUNTU_ISO to the Ubuntu 24.04 live server ISO (ubuntu-24.04.4-live-server-amd64.iso), or unset it"
    if not path.is_file():
        raise DemoError(f"UBUNTU_ISO={value}: no such file; {hint} to build the fixture image")
    try:
        with path.open("rb") as fh:
            fh.seek(0x8001)
            magic = fh.read(5)
    except OSError as exc:
        raise DemoError(f"UBUNTU_ISO={value} cannot be read: {exc.strerror}; {hint}") from None
    if magic != b"CD001":
        raise DemoError(f"UBUNTU_ISO={value} is not an ISO 9660 image; {hint}")
    return path.resolve()


def imagebuilder_cmd(args: list[str], env: dict[str, str]) -> str:
    """Run ``imagebuilder ARGS``, echoing its log; return the last folder it printed (the build's)."""
    print("  $ imagebuilder " + " ".join(args), flush=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "imagebuilder.cli", *args],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    last = ""
    if proc.stdout is None:
        raise DemoError("imagebuilder has no output pipe")
    try:
        for line in proc.stdout:
            if line.strip():
                if Path(line.strip()).is_absolute() and Path(line.strip()).is_dir():
                    last = line.strip()  # the build folder, on stdout (interleaved with the log)
                print("    " + line.rstrip(), flush=True)
        rc = proc.wait()
    except BaseException:
        proc.terminate()  # the builder removes its own VM and work directory on SIGTERM
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if rc != 0:
        raise DemoError(f"imagebuilder {args[0]} failed with exit status {rc} (its messages are above)")
    return last


def build_image(work: Path, stack: contextlib.ExitStack, cache: Path, ubuntu_iso: str | None) -> Path:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}
    if ubuntu_iso:
        iso = check_ubuntu_iso(ubuntu_iso)
        print(f"  UBUNTU_ISO={iso}: building examples/ubuntu-2404-node.yaml (needs the Ubuntu archive)")
        definition = _definition_variant(UBUNTU_DEFINITION, work / "ubuntu-2404-node.yaml", f"file://{iso}")
    else:
        from fixtures.installer.build import build_installer_iso
        from tests.support.payload_server import PayloadServer, build_payloads

        print("  no UBUNTU_ISO: the fixture image (a Debian-based fixture installer stands in for Ubuntu's)")
        fixture_iso = build_installer_iso().iso
        print(f"  fixture installer ISO: {fixture_iso}")
        payloads = PayloadServer(build_payloads(ROOT / ".cache" / "imagebuilder-payloads"))
        stack.callback(payloads.close)
        print(f"  stand-in payloads served at {payloads.url}")
        env.update(IMAGEBUILDER_FIXTURE_ISO=str(fixture_iso), IMAGEBUILDER_PAYLOADS=payloads.url)
        definition = _definition_variant(FIXTURE_DEFINITION, work / "fixture-node.yaml", None)
    lock = work / (definition.stem + ".lock.json")
    imagebuilder_cmd(["lock", str(definition), "--lock", str(lock), "--cache-dir", str(cache)], env)
    build = ["build", str(definition), "--lock", str(lock), "--cache-dir", str(cache),
             "--out", str(work / "out"), "--work-dir", str(work)]  # fmt: skip
    helptext = subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", "build", "--help"], cwd=ROOT, env=env,
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    if "--no-test" in helptext:
        build.append("--no-test")  # the demo boots the image itself, right after
    wait_for_other_vms()
    return Path(imagebuilder_cmd(build, env))


def image_of(folder: Path) -> tuple[Path, dict[str, Any]]:
    if not folder.is_dir():
        raise DemoError(
            f"--image {folder}: not a folder; pass a build folder published by `imagebuilder build`"
        )
    images = sorted(folder.glob("*.qcow2"))
    manifest = folder / "manifest.json"
    if len(images) != 1 or not manifest.is_file():
        raise DemoError(
            f"--image {folder}: expected one *.qcow2 and manifest.json (a folder published by `imagebuilder build`)"
        )
    return images[0], json.loads(manifest.read_text())


def user_data(*, bundle: bytes, kubeadm_path: str) -> str:
    import yaml

    from imagebuilder import nodespec
    from imagebuilder.guest import relay

    seed = SEED_DIR
    config = {
        "server": f"127.0.0.1:{GUEST_ATTEST_PORT}",
        "join_server": f"127.0.0.1:{GUEST_JOIN_PORT}",
        "trust_domain": TRUST_DOMAIN,
        "bundle": "/etc/nodeagent/bundle.pem",
        "tcti": "device:/dev/tpmrm0",
        "require_ek_cert": True,
        "pool": "cpu",
        "pool_profile": "/etc/nodeagent/pool.yaml",
        "node_name": NODE_NAME,
        "kubeadm": kubeadm_path,
        "deadline_s": 900.0,  # under TCG the staged version's packages take minutes to install
    }
    demo = {
        "server": config["server"],
        "trust_domain": TRUST_DOMAIN,
        "time_sync_s": TIME_SYNC_S,
    }

    def file(path: str, content: str, mode: str = "0600") -> dict[str, str]:
        return {"path": path, "owner": "root:root", "permissions": mode, "content": content}

    cloud = {
        # The relay to the host (the servers and the site NTP server, chronyd on the host) starts first: the
        # image enables systemd-time-wait-sync (the agent must not run on a wrong clock), so the boot waits
        # until the node's clock is set from the release's NTP server, as a racked node's does.
        "bootcmd": [
            relay.bootcmd(
                GUEST_FORWARD, [GUEST_ATTEST_PORT, GUEST_JOIN_PORT], [GUEST_NTP_PORT], default_route=True
            )
        ],
        "write_files": [
            file(f"{seed}/guest.py", (ROOT / "scripts" / "demo_guest.py").read_text(), "0700"),
            file(kubeadm_path, f'#!/bin/sh\nexec {VENV_PYTHON} {seed}/guest.py kubeadm "$@"\n', "0700"),
            file(f"{seed}/demo.json", json.dumps(demo) + "\n"),
            file(f"{seed}/config.yaml", yaml.safe_dump(config, sort_keys=False)),
            file(f"{seed}/bundle.pem", bundle.decode()),
            file(f"{seed}/pool.yaml", pool_profile_text(VM_POOL)),
            # the site NTP server, as a node-pool release names it (imagebuilder.release.cloudinit.TIMESYNCD)
            file(
                TIMESYNCD_DROP_IN, nodespec.time_servers_file("systemd-timesyncd", ["127.0.0.1"])[1], "0644"
            ),
        ],
        "runcmd": [[VENV_PYTHON, f"{seed}/guest.py", "run", seed]],
    }
    return "#cloud-config\n" + yaml.safe_dump(cloud, sort_keys=False)


class GuestSteps:
    """Prints the guest's ``NODETRUST-DEMO`` lines from the data port as they arrive."""

    TITLES = {
        1: "The node booted with the host's TPM; nodeagent.service ran once, unconfigured",
        2: "cloud-init's seed configures the agent (/etc/nodeagent)",
        3: "The agent attests the TPM to the server on the host and receives its X509-SVID",
        4: "The agent checks the GPUs and the node against the CPU pool",
        5: "nodeagent.service (nodeagent run): join credentials over mutual TLS, then kubeadm join",
        6: "What the image's kubeadm (the demo's stand-in) received",
        7: "nodeagent status",
    }

    def __init__(self, first: int) -> None:
        self.first = first
        self.entries: list[dict[str, Any]] = []
        self.done: dict[str, Any] | None = None

    def on_console(self, line: str) -> None:
        line = ESC.sub("", line).strip()
        if BOOT_FAILURE.search(line):
            raise DemoError(
                f"the image does not boot: its console says {line[:200]!r}; rebuild it "
                "(without --no-test, `imagebuilder build` boot-tests the image before publishing it)"
            )
        if CONSOLE_MILESTONES.search(line):
            print(f"  [console] {line[:160]}", flush=True)

    def on_data(self, line: str) -> bool:
        _, mark, payload = line.partition("NODETRUST-DEMO ")
        if not mark:
            return False
        try:
            entry = json.loads(payload)
        except ValueError:
            print(f"  [data port] unreadable: {line[:200]}")
            return False
        if entry.get("done"):
            self.done = entry
            return True
        self.entries.append(entry)
        n = int(entry.get("step", 0))
        title = self.TITLES.get(n, str(entry.get("name")))
        step(f"{self.first}.{n}" if n else "!", f"{title}{'' if entry.get('ok') else '  -- FAILED'}")
        if entry.get("name") == "kubeadm":
            import yaml

            for call in entry.get("calls", []):
                print(
                    f"  kubeadm {' '.join(call['argv'])}  (file mode {call['mode']}, valid: {call['valid']})"
                )
                packages = ", ".join(f"{n} {v}" for n, v in sorted((call.get("packages") or {}).items()))
                print(
                    f"  beside it: {call.get('kubelet_version')} ({packages}; held: {', '.join(call.get('held') or [])})"
                )
                for error in call.get("errors", []):
                    print(f"    error: {error}")
                if call.get("config"):
                    say(yaml.safe_dump(call["config"], sort_keys=False), "    ")
        elif entry.get("name") == "check":
            say("\n".join(str(entry.get("output", "")).splitlines()[-16:]))
        else:
            say(str(entry.get("output", "")))
        return False


def validate_join_configuration(config: dict[str, Any]) -> list[str]:
    """The recorded (redacted) JoinConfiguration against kubeadm's v1beta4 schema."""
    import jsonschema

    from tests.support.kubeadm_double import SCHEMA

    doc = json.loads(json.dumps(config).replace("<redacted>", "0" * 16))  # a well-formed placeholder secret
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)
    ]


def verdict(
    work: Path, audit: list[dict[str, Any]], guest: GuestSteps, logs: list[Path], *, kubernetes_version: str
) -> list[str]:
    """What went wrong, from the server's own records first; empty when the whole chain happened."""
    problems = []
    attests = [e for e in audit if e.get("event") == "attest"]
    joins = [e for e in audit if e.get("event") == "join"]
    if not any(e.get("result") == "ok" and e.get("ek_trust") == "ca" for e in attests):
        problems.append("the server's audit log has no successful attestation with a CA-trusted EK")
    if not any(
        e.get("result") == "ok" and e.get("node_name") == NODE_NAME and e.get("pool") == "cpu" for e in joins
    ):
        problems.append(f"the server's audit log has no successful join of {NODE_NAME} in the cpu pool")
    if bad := [e for e in audit if e.get("result") != "ok"]:
        problems.append(f"{len(bad)} audit line(s) are not ok: {bad}")
    token_ids = {e.get("token_id") for e in joins if e.get("result") == "ok"}
    revoked = {
        e.get("token_id") for e in audit if e.get("event") == "joined" and e.get("token_revoked") is True
    }
    manifests = {
        p.stem.removeprefix("bootstrap-token-") for p in (work / "server" / "tokens").glob("*.yaml")
    }
    if not token_ids or not token_ids <= revoked or token_ids & manifests:
        problems.append(
            f"the audit log issued tokens {sorted(map(str, token_ids))} and revoked {sorted(map(str, revoked))}; "
            f"the token folder still has {sorted(manifests)}: the node's report must revoke the token it used"
        )
    by_step = {e.get("name"): e for e in guest.entries}
    for name in ("attest", "check", "join", "kubeadm"):
        if not (by_step.get(name) or {}).get("ok"):
            problems.append(f"the node's {name} step did not succeed (see above)")
    calls = (by_step.get("kubeadm") or {}).get("calls") or []
    if calls and calls[-1].get("config"):
        config = calls[-1]["config"]
        problems += [f"JoinConfiguration: {e}" for e in validate_join_configuration(config)]
        token_id = str(config.get("discovery", {}).get("bootstrapToken", {}).get("token", "")).partition(
            "."
        )[0]
        if token_id not in token_ids:
            problems.append(
                f"kubeadm received token {token_id}, the server issued {sorted(map(str, token_ids))}"
            )
    if calls:
        # the join answer's version was the installed one when kubeadm ran (agent.kubeversion)
        running = calls[-1].get("kubelet_version")
        if running != f"Kubernetes v{kubernetes_version}":
            problems.append(f"kubeadm ran beside kubelet {running!r}, not the pool's v{kubernetes_version}")
        packages = calls[-1].get("packages") or {}
        wrong = {n: v for n, v in packages.items() if not str(v).startswith(f"{kubernetes_version}-")}
        if set(packages) != {"kubeadm", "kubelet", "kubectl"} or wrong:
            problems.append(f"the installed Kubernetes packages are {packages}, not {kubernetes_version}")
        if not {"kubeadm", "kubelet", "kubectl"} <= set(calls[-1].get("held") or []):
            problems.append(f"the Kubernetes packages are not all held: {calls[-1].get('held')}")
    if guest.done is None or not guest.done.get("ok"):
        problems.append("the node did not report the chain as complete")
    # the secrets themselves are gone with their revoked manifests: a token of this id in any form but
    # the redacted one is a leaked secret
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        for secret in [*token_secrets(work), *leaked_tokens(text, token_ids)]:
            if secret in text:
                problems.append(f"a join token's secret appears in {log}: it must never be logged")
    return problems


def vm_chain(work: Path, args: argparse.Namespace) -> int:
    from imagebuilder.bootvm import BootSpec, BootVm
    from imagebuilder.media import make_seed
    from tests.support.serverproc import ServerProcess
    from tests.support.swtpm import LocalCa, manufacture

    with contextlib.ExitStack() as stack:
        step(0, "Services: libvirtd and virtlogd")
        stack.enter_context(libvirt_services(work))
        if args.image:
            step(1, f"The image: {args.image} (--image, not built)")
            folder = Path(args.image).resolve()
        else:
            step(
                1,
                "The image: imagebuilder lock and build (about 4 minutes here under TCG, less on a cached base)",
            )
            started = time.monotonic()
            folder = build_image(work, stack, Path(args.cache_dir), args.ubuntu_iso)
            print(f"  built {folder} in {time.monotonic() - started:.0f} s")
        image, manifest = image_of(folder)
        kube = manifest.get("kubernetes") or {}
        version = args.kubernetes_version or demo_kubernetes_version(kube)
        accel = args.accel or str((manifest.get("accelerator") or {}).get("name") or "tcg")
        print(f"  {image.name}: {manifest.get('name')} {manifest.get('build_id')}, {manifest.get('architecture')}; "
              f"booting it under {accel} (what its build used; --accel overrides)")  # fmt: skip

        step(2, f"A TPM for the node: an swtpm state with an EK certificate from a local EK CA (in {work})")
        ca = LocalCa(work / "ek-ca")
        (work / "ek-ca").chmod(0o700)
        manufacture(work / "tpm", ca)
        (work / "tpm").chmod(0o700)
        print(f"  manufactured {work / 'tpm'}; QEMU reaches it through swtpm's socket only")

        step(
            3,
            f"The server on the host: a fresh trust domain {TRUST_DOMAIN}, trusting that EK CA, with a CPU pool",
        )
        ca.install_into(work / "server" / "ek-ca")
        config = work / "server" / "config.yaml"
        measured = (
            folder / "boot-measurements.json"
        )  # the build's prediction: the pool admits only that boot
        config.write_text(
            json.dumps(
                server_config(
                    work, measured if measured.is_file() else None, kubernetes_version=version, pool=VM_POOL
                ),
                indent=2,
            )
        )
        staged = ", ".join(map(str, kube.get("staged") or [])) or "none"
        switch = (
            "the agent installs its staged packages and holds them before kubeadm join"
            if version != kube.get("installed")
            else "the image's installed version"
        )
        print(f"  the cluster runs Kubernetes v{version}; the image installs {kube.get('installed')} and stages "
              f"{staged}: {switch}")  # fmt: skip
        print(f"  $ server.cli run --config {config}")
        server = stack.enter_context(ServerProcess(None, config, log=work / "server.log"))
        print(f"  {server.line}")
        from tests.support.ntp import NtpServer

        ntp = stack.enter_context(NtpServer.start(work / "ntp"))
        print(
            f"  the site NTP server: Debian's chronyd on 127.0.0.1:{ntp.port} (it never sets this host's clock)"
        )
        from imagebuilder.guest.relay import host_relay

        ports = {GUEST_ATTEST_PORT: server.attest_port, GUEST_JOIN_PORT: server.join_port}
        relay = stack.enter_context(host_relay(ports, {GUEST_NTP_PORT: ntp.port}))
        print(
            f"  the node's only route: {GUEST_FORWARD}, a QEMU character device to the relay on 127.0.0.1:{relay}"
        )
        for guest_port, host_port in ports.items():
            print(f"  the node's 127.0.0.1:{guest_port} -> the relay -> 127.0.0.1:{host_port}")
        print(f"  the node's UDP 127.0.0.1:{GUEST_NTP_PORT} -> the relay -> UDP 127.0.0.1:{ntp.port}")

        step(
            4,
            "The node: the image booted under libvirt with that TPM and a NoCloud seed configuring the agent",
        )
        vmdir = work / "vm"
        vmdir.mkdir()
        seed = make_seed(
            user_data(bundle=server.bundle, kubeadm_path=KUBEADM_STAND_IN),
            f"instance-id: nodetrust-demo-{secrets.token_hex(4)}\nlocal-hostname: {NODE_NAME}\n",
            work / "seed.iso",
        )
        seed.chmod(0o644)
        spec = BootSpec(
            image=image,
            seed=seed,
            accel=accel,
            arch=str(manifest.get("architecture") or "amd64"),
            tpm_state=work / "tpm",
            listener_port=relay,
        )
        wait_for_other_vms()
        guest = GuestSteps(4)
        started = time.monotonic()
        with BootVm(spec, vmdir, label="demo") as vm:
            print(
                f"  domain {vm.domain.name if vm.domain else '?'}; console {vm.console}; data port {vm.data}",
                flush=True,
            )
            vm.follow(
                on_console=guest.on_console,
                on_data=guest.on_data,
                idle_s=VM_IDLE_S,
                total_s=VM_TOTAL_S,
                what="the demo node",
            )
            vm.wait_stopped(120)
        print(
            f"\n  the node ran for {time.monotonic() - started:.0f} s and is powered off; its VM is removed"
        )
        logs = [vmdir / "console.log", vmdir / "data.log", work / "server.log"]
        server.stop()

        step(5, "The token, as the file backend wrote it for an operator to apply, and the audit trail")
        audit = show_token_and_audit(work)
        show_measured_boot(audit)
        problems = verdict(work, audit, guest, logs, kubernetes_version=version)
        if problems:
            print("\n\033[1mdemo: FAILED\033[0m")
            for problem in problems:
                print(f"  - {problem}")
            print(f"  the node's console: {vmdir / 'console.log'} (kept with --keep)")
            return 1
    print(
        "\n\033[1mdemo: the node booted from the image proved its TPM identity, passed its checks, "
        "and joined with a one-time token.\033[0m"
    )
    return 0


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host-only", action="store_true",
                        help="the agent's steps on the host against swtpm: no image, no VM (seconds)")  # fmt: skip
    parser.add_argument("--image", metavar="FOLDER",
                        help="boot this build folder (published by `imagebuilder build`) instead of building")  # fmt: skip
    parser.add_argument("--tampered-boot", action="store_true",
                        help="with --host-only: then reboot into another command line; the re-check is refused")  # fmt: skip
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (server data, token, console, built image)")  # fmt: skip
    parser.add_argument("--accel", choices=("kvm", "tcg"), help="override the image's build accelerator")
    parser.add_argument("--kubernetes-version", metavar="X.Y.Z",
                        help="the cluster's version in the join answer (default: the image's newest staged version "
                             "of the minor below its installed one, else the installed one)")  # fmt: skip
    parser.add_argument(
        "--cache-dir", default=str(DEFAULT_CACHE), help=f"download cache (default {DEFAULT_CACHE})"
    )
    parser.add_argument("--ubuntu-iso", default=os.environ.get("UBUNTU_ISO") or None,
                        help="the Ubuntu 24.04 live server ISO (default $UBUNTU_ISO): build the real image")  # fmt: skip
    args = parser.parse_args()
    from tests.support.swtpm import missing_tools

    missing = missing_tools()
    if missing:
        print(
            f"demo: missing {', '.join(missing)}; run `make deps` (installs swtpm and swtpm-tools)",
            file=sys.stderr,
        )
        return 1
    if not args.host_only and os.geteuid() != 0:
        print(
            "demo: the VM chain needs root (qemu:///system); run it as root, or use --host-only",
            file=sys.stderr,
        )
        return 1
    if args.ubuntu_iso and not (args.host_only or args.image):
        try:
            args.ubuntu_iso = str(check_ubuntu_iso(args.ubuntu_iso))
        except DemoError as exc:
            print(f"demo: error: {exc}", file=sys.stderr)
            return 1
    signal.signal(signal.SIGTERM, _sigterm)
    # Under /var/tmp: QEMU (another user) must traverse to the VM's folder; nothing else is readable.
    work = Path(tempfile.mkdtemp(prefix="nodetrust-demo-", dir="/var/tmp"))
    work.chmod(0o711)
    began = time.monotonic()
    try:
        rc = host_chain(work, tampered=args.tampered_boot) if args.host_only else vm_chain(work, args)
    except DemoError as exc:
        print(f"\ndemo: error: {exc}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print("\ndemo: interrupted; cleaning up", file=sys.stderr)
        rc = 130
    except Exception as exc:
        from imagebuilder.errors import BuildError

        if not isinstance(exc, BuildError):
            raise
        print(
            f"\ndemo: error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr
        )
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if args.keep:
            print(f"demo: kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    waited = f" ({WAITED[0]:.0f} s of it waiting for other VMs)" if WAITED[0] >= 1 else ""
    print(f"demo: {time.monotonic() - began:.0f} s in all{waited}")
    return rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
