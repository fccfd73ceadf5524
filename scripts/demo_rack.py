"""``make demo``'s node: a racked server on this machine, configured only by its release, joining a real cluster.

The rack (tests/support/rack.py) is a network namespace of the demo's own. Everything the management side
runs is inside it, on its loopback, and a server reaches it as ``10.0.2.2`` through QEMU's user-mode
network (started in the namespace, so it has no route anywhere else):

* the control plane: etcd, kube-apiserver and kube-controller-manager from ``make peers``, at the version
  the pool runs (tests/support/control_plane.py), on port 6443;
* ``nodeserver``: attestation on 8081, the join broker on 8082, the ``kubernetes`` token backend with a
  service account that has the documented Role, the ``cpu`` pool (every node check fatal, the pool's
  label and taint, only the build's boot admitted);
* the site NTP server (chronyd, port 123/udp) and the release server (HTTP, port 80; it also takes the
  imager's events at ``/events``);
* a stock spire-server v1.13.3 (``make peers``) with SPIRE's built-in ``tpm_devid`` attestor on 8090,
  trusting nodeserver's DevID CA and the EK CA: the cluster's workload identity.

The server (the VM: OVMF with its own NVRAM, an swtpm TPM with an EK certificate from a local EK CA)
gets the image one of two ways:

* default: its disk is the image (a copy-on-write overlay) and the node pool's cloud-init
  (``worker.user-data`` of the release) is on a second disk labelled CIDATA, as the imager would seed it;
* ``--ipxe``: it has two empty disks and boots from the network: Debian's iPXE ROM -> the release's
  ``entry.ipxe`` -> ``boot.ipxe`` -> the imager (kernel and initramfs pinned by digest) -> ``nodeimager``
  verifies the release with the pinned key, picks the disk by serial, writes and reads back the image,
  seeds the pool's cloud-init, creates the UEFI boot entry and reboots; the server then boots from that
  entry.

Either way nothing in the guest is the demo's: cloud-init writes the pool's configuration and
``nodeagent.service`` does the rest, attests, checks, quotes the boot, asks to join, switches Kubernetes
to the pool's version, runs the real ``kubeadm join``, and the kubelet registers the Node; then the agent
enrols a DevID with nodeserver and starts the image's spire-agent, which attests to the stock
spire-server with it (``tpm_devid``, through the node's kernel TPM). The demo only
watches from outside (the console, the server's audit log, the API server), then powers the server off
and reads its disk: the agent's state and journal, the packages it installed and held.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo_common import ROOT, TRUST_DOMAIN, VM_POOL, DemoError, leaked_tokens, say, step, wait_for_other_vms

NODE_NAME = "demo-node-1"
POOL = "cpu"
JOIN: dict[str, Any] = {
    "labels": {"nodetrust.io/demo": "true", "example.com/rack": "r1"},
    "taints": ["example.com/dedicated=demo:NoSchedule"],
}
TARGET_SERIAL, OTHER_SERIAL = "NODE0TARGET", "NODE1OTHER"
TARGET_GIB, OTHER_GIB = 8, 4
NODE_TIMEOUT_S = 1800  # boot, cloud-init, attest, checks, the version switch (apt under TCG), kubeadm, Ready
IMAGER_TIMEOUT_S = 1500
IMAGER_FAILED = re.compile(r"nodeimager-boot: nodeimager exited with status [1-9]\d*.*")
# The imager holds a QCOW2 in memory while it checks it (the fixture's is about 1.5 GB): its tmpfs is half
# the memory. The node itself needs less, but a real server has one size.
MEMORY_MIB = 5120
CONSOLE = re.compile(
    r"Linux version \S+|Reached target (Multi-User System|Cloud-init target)|Cloud-init v\. \S+ finished"
    r"|Started (nodeagent|kubelet|containerd)\S*|nodeimager(-boot)?: .*|nodetrust: .*|iPXE initiali[sz]ing.*"
    r"|BdsDxe: (loading|starting) .*"
)
# The VM's kubelet: systemd's cgroups (the image's containerd uses them), as kubeadm's defaults say, and the
# cluster CA where kubeadm join writes it on every node (kubeadm's default is the control plane's
# certificatesDir, here a folder of the demo's on the host, not a path a node has).
NODE_KUBELET_CONFIG: dict[str, Any] = {
    "apiVersion": "kubelet.config.k8s.io/v1beta1",
    "kind": "KubeletConfiguration",
    "cgroupDriver": "systemd",
    "authentication": {"x509": {"clientCAFile": "/etc/kubernetes/pki/ca.crt"}},
}
# The node's pod network: a bridge on the node, as a CNI plugin's DaemonSet would install it. A site
# configuration file of the node-pool release (imagebuilder release --file): configuration, no software.
CNI_CONFIG = {
    "cniVersion": "1.0.0",
    "name": "demo",
    "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}  # fmt: skip
CNI_PATH = "/etc/cni/net.d/10-demo.conflist"
SPIRE_TRUST_DOMAIN = "cluster.demo.nodetrust.test"
SPIRE_AGENT_CONF, SPIRE_AGENT_BUNDLE = "/etc/spire/agent/agent.conf", "/etc/spire/agent/bundle.pem"
SPIRE_AGENT_S = 600  # after the Node is Ready: the DevID enrolment and spire-agent's attestation (TCG)
DEVID_CREDENTIALS = (
    "/run/credentials/spire-agent.service"  # the unit's LoadCredential= copies (docs/attestation.md)
)


def spire_agent_conf(server: str, port: int) -> str:
    """The SPIRE agent's configuration a node-pool release writes (docs/attestation.md, "After the join")."""
    return f"""agent {{
  data_dir          = "/var/lib/spire-agent"
  log_level         = "INFO"
  server_address    = "{server}"
  server_port       = "{port}"
  socket_path       = "/run/spire-agent/public/api.sock"
  trust_bundle_path = "{SPIRE_AGENT_BUNDLE}"
  trust_domain      = "{SPIRE_TRUST_DOMAIN}"
}}
plugins {{
  NodeAttestor "tpm_devid" {{
    plugin_data {{
      tpm_device_path = "/dev/tpmrm0"
      devid_cert_path = "{DEVID_CREDENTIALS}/devid.crt.pem"
      devid_priv_path = "{DEVID_CREDENTIALS}/devid.priv.blob"
      devid_pub_path  = "{DEVID_CREDENTIALS}/devid.pub.blob"
    }}
  }}
  KeyManager "disk" {{ plugin_data {{ directory = "/var/lib/spire-agent" }} }}
  WorkloadAttestor "unix" {{ plugin_data {{}} }}
}}
"""


@dataclass
class Rack:
    """The management side, running in the rack's namespace."""

    work: Path
    cp: Any  # tests.support.control_plane.ControlPlane
    server: Any  # tests.support.serverproc.ServerProcess
    ntp: Any  # tests.support.ntp.NtpServer
    http: Any  # tests.imager.server.ReleaseServer
    spire: Any  # tests.support.spire.SpireServer
    releases: Path
    ek_ca: Any  # tests.support.swtpm.LocalCa
    stack: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)

    @property
    def audit_path(self) -> Path:
        return self.work / "server" / "data" / "audit.jsonl"

    def audit(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line.strip()]


def _ns_kubeconfig(identity_kubeconfig: Path, out: Path) -> Path:
    """The identity's kubeconfig, pointed at the API server as the namespace sees it (127.0.0.1:6443)."""
    import yaml

    from tests.support.rack import PORTS

    doc = yaml.safe_load(identity_kubeconfig.read_text())
    for entry in doc["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{PORTS['api']}"
    out.write_text(yaml.safe_dump(doc))
    out.chmod(0o600)
    return out


def start_rack(
    work: Path,
    stack: contextlib.ExitStack,
    *,
    version: str,
    measurements: Path | None,
    ek_ca: Any,
    spire: bool,
) -> Rack:
    """The control plane, nodeserver, the NTP server, the release server and (``spire``) spire-server, in one
    namespace; ``ek_ca``: the CA of the servers' EK certificates (tests.support.swtpm.LocalCa)."""
    from tests.imager.server import ReleaseServer
    from tests.support.control_plane import ControlPlane
    from tests.support.kube_identities import service_account
    from tests.support.ntp import NtpServer
    from tests.support.rack import GATEWAY, PORTS
    from tests.support.serverproc import ServerProcess

    began = time.monotonic()
    cp = ControlPlane.start(
        work / "cluster", kubelet_config=NODE_KUBELET_CONFIG, version=version, endpoint_host=GATEWAY
    )
    stack.callback(cp.stop)
    ns = cp.ns
    print(f"  the rack's network namespace: {ns.name} (only lo; the servers reach it as {GATEWAY})")
    print(f"  the control plane: etcd, kube-apiserver and kube-controller-manager v{version}, ready in "
          f"{cp.started_in_s:.0f} s; on the host: kubectl --kubeconfig {cp.admin_kubeconfig}")  # fmt: skip

    ek_ca.install_into(work / "server" / "ek-ca")
    who = service_account(cp, "nodeserver-demo", work)
    tokens_kubeconfig = _ns_kubeconfig(who.kubeconfig, work / "server" / "kubernetes.kubeconfig")
    profile = {**VM_POOL, "join": JOIN}
    pool: dict[str, Any] = {"profile": profile}
    if measurements is not None:
        import hashlib

        raw = measurements.read_bytes()
        name = str(json.loads(raw).get("image") or "release")
        pool["measured_boot"] = {
            "releases": [{"name": name, "measurements": str(measurements), "sha256": hashlib.sha256(raw).hexdigest()}],
            "nonce_ttl": "5m",
        }  # fmt: skip
    config = {
        "trust_domain": TRUST_DOMAIN,
        "data_dir": str(work / "server" / "data"),
        "listen": f"127.0.0.1:{PORTS['attest']}",
        "join_listen": f"127.0.0.1:{PORTS['join']}",
        "metrics_listen": "off",
        "ek_trust": {"ca_dir": str(work / "server" / "ek-ca")},
        "cluster": {
            "api_server_endpoint": f"{GATEWAY}:{PORTS['api']}",  # where the rack's servers reach it
            "ca_cert": str(cp.ca_cert),
            "kubernetes_version": f"v{version}",
        },
        "join": {"token_ttl": "15m"},
        "token_backend": {"type": "kubernetes", "kubeconfig": str(tokens_kubeconfig), "timeout": "30s"},
        "pools": {POOL: pool},
    }
    server = ServerProcess(config, work / "server" / "config.json", log=work / "server.log", netns=ns.name)
    stack.callback(server.stop)
    print(f"  nodeserver: trust domain {TRUST_DOMAIN}, trusting the local EK CA; attestation on {GATEWAY}:"
          f"{PORTS['attest']}, join broker on {GATEWAY}:{PORTS['join']}; tokens go into the cluster as "
          f"{who.user} (the documented Role)")  # fmt: skip
    print(f"  pool {POOL}: every node check fatal (the cpu preset; min_free_disk_gib 2 for the 6 GiB fixture "
          f"disk), labels {JOIN['labels']}, taint {JOIN['taints'][0]}"
          + ("; only the build's boot is admitted (its boot-measurements.json)" if measurements else ""))  # fmt: skip
    ntp = NtpServer.start(work / "ntp", ns=ns, port=PORTS["ntp"])
    stack.callback(ntp.stop)
    print(f"  the site NTP server: Debian's chronyd on {GATEWAY}:{PORTS['ntp']}/udp (it never sets a clock)")
    releases = work / "releases"
    releases.mkdir()
    sock = ns.socket()
    sock.bind(("127.0.0.1", PORTS["http"]))
    sock.listen(64)
    http = ReleaseServer(releases, sock=sock)
    stack.callback(http.close)
    print(f"  the release server: http://{GATEWAY}/ (its folder {releases}); the imager's events to /events")
    spire_server = None
    if spire:
        spire_server = start_spire(work, stack, ns.name, ek_ca)
        print(f"  spire-server v1.13.3 (stock, make peers): trust domain {SPIRE_TRUST_DOMAIN} on {GATEWAY}:"
              f"{PORTS['spire']}, NodeAttestor tpm_devid trusting nodeserver's DevID CA and the EK CA")  # fmt: skip
    print(f"  the rack is up in {time.monotonic() - began:.0f} s")
    return Rack(work, cp, server, ntp, http, spire_server, releases, ek_ca)


def start_spire(work: Path, stack: contextlib.ExitStack, netns: str, ek_ca: Any) -> Any:
    """A stock spire-server whose tpm_devid trusts nodeserver's DevID CA (``nodeserver devid-ca``)."""
    from tests.support.peers import run
    from tests.support.rack import PORTS
    from tests.support.spire import SpireServer, devid_server_attestor

    folder = work / "spire"
    folder.mkdir()
    devid_ca = folder / "devid-ca.pem"
    exported = run([sys.executable, "-m", "server.cli", "devid-ca", "-c", work / "server" / "config.json"],
                   env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    devid_ca.write_text(exported.stdout)
    endorsement = folder / "ek-ca.pem"  # the EK vendors' CAs, issuers included
    endorsement.write_bytes(ek_ca.root_cert.read_bytes() + ek_ca.issuer_cert.read_bytes())
    spire = SpireServer(folder, SPIRE_TRUST_DOMAIN, devid_server_attestor(devid_ca, endorsement),
                        port=PORTS["spire"], netns=netns, log_level="INFO")  # fmt: skip
    spire.start()
    stack.callback(spire.stop)
    return spire


def make_release(
    rack: Rack, folder: Path, build_pub: Path, *, bootenv: Path, kubeadm: Path, ipxe: bool
) -> tuple[Path, dict[str, Any]]:
    """``imagebuilder release`` of the build for the cpu pool, as an operator runs it."""
    from imagebuilder.sign import generate_keypair
    from tests.support.rack import GATEWAY, PORTS

    work = rack.work
    private, public = generate_keypair("ecdsa-p256")
    (work / "release.key").write_bytes(private)
    (work / "release.key").chmod(0o600)
    (work / "release.pub").write_bytes(public)
    (work / "bundle.pem").write_bytes(rack.server.bundle)
    (work / "cni.conflist").write_text(json.dumps(CNI_CONFIG, indent=2) + "\n")
    spire: list[str] = []
    if rack.spire is not None:  # the SPIRE agent's configuration, and the agent told to enrol and start it
        (work / "spire-agent.conf").write_text(spire_agent_conf(GATEWAY, PORTS["spire"]))
        (work / "spire-bundle.pem").write_bytes(rack.spire.bundle_pem())
        spire = ["--file", f"{SPIRE_AGENT_CONF}={work / 'spire-agent.conf'}",
                 "--file", f"{SPIRE_AGENT_BUNDLE}={work / 'spire-bundle.pem'}",
                 "--agent-setting", "devid_enrol=true", "--agent-setting", "spire_agent_unit=spire-agent.service"]  # fmt: skip
    import yaml

    (work / "pool.yaml").write_text(yaml.safe_dump({"name": POOL, **VM_POOL, "join": JOIN}, sort_keys=False))
    argv = ["release", str(folder), "--build-key", str(build_pub), "--key", str(work / "release.key"),
            "--out", str(rack.releases), "--base-url", f"http://{GATEWAY}/", "--imager", str(bootenv),
            "--pool", POOL, "--server", f"{GATEWAY}:{PORTS['attest']}", "--join-server", f"{GATEWAY}:{PORTS['join']}",
            "--trust-domain", TRUST_DOMAIN, "--bundle", str(work / "bundle.pem"), "--node-name", NODE_NAME,
            "--ntp", GATEWAY, "--pool-profile", str(work / "pool.yaml"),
            "--file", f"{CNI_PATH}={work / 'cni.conflist'}",
            *spire,
            # the version switch installs debs under TCG: minutes; the agent's default deadline is for hardware
            "--agent-setting", "deadline_s=1200",
            "--hint", f"serial={TARGET_SERIAL}", "--events-url", f"http://{GATEWAY}/events",
            "--kubeadm", str(kubeadm), "--json"]  # fmt: skip
    print("  $ imagebuilder " + " ".join(argv[:-1]))
    made = subprocess.run([sys.executable, "-m", "imagebuilder.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, check=False)  # fmt: skip
    if made.returncode != 0:
        raise DemoError(f"imagebuilder release failed ({made.returncode}):\n{made.stderr.strip()[-3000:]}")
    info: dict[str, Any] = json.loads(made.stdout)
    release = Path(info["folder"])
    print(f"  {release.name}: signed by {info['key']} (the iPXE script pins it)")
    for path in sorted(release.iterdir()):
        print(f"    {path.name:34} {path.stat().st_size:>12,d} bytes")
    if ipxe:
        print(f"  a server boots it from http://{GATEWAY}/{release.name}/entry.ipxe")
    return release, info


class Watch:
    """Prints what is new at each call: console milestones, audit lines, the Node's condition."""

    AUDIT_KEYS = ("event", "result", "reason", "pool", "node_name", "ek_trust", "verdict", "release",
                  "checked_pcrs", "token_id", "token_revoked", "warned_checks")  # fmt: skip

    def __init__(self, rack: Rack) -> None:
        self.rack = rack
        self.audit_seen = 0
        self.node = ""
        self.console_seen: dict[Path, int] = {}

    def __call__(self, boot: Any = None) -> None:
        if boot is not None:
            lines = boot.lines()
            for line in lines[self.console_seen.get(boot.console, 0) :]:
                found = CONSOLE.search(line)
                if found:
                    print(f"  [console] {found.group(0)[:150]}", flush=True)
            self.console_seen[boot.console] = len(lines)
        audit = self.rack.audit()
        for entry in audit[self.audit_seen :]:
            shown = {k: entry[k] for k in self.AUDIT_KEYS if k in entry}
            print(f"  [nodeserver audit] {json.dumps(shown)}", flush=True)
        self.audit_seen = len(audit)
        state = _node_state(self.rack)
        if state and state != self.node:
            print(f"  [kube-apiserver] node {NODE_NAME}: {state}", flush=True)
            self.node = state


def _node(rack: Rack) -> dict[str, Any] | None:
    got = rack.cp.kubectl("get", "node", NODE_NAME, "--ignore-not-found", "-o", "json", check=False)
    if got.returncode != 0 or not got.stdout.strip():
        return None
    doc: dict[str, Any] = json.loads(got.stdout)
    return doc


def _ready(doc: dict[str, Any] | None) -> bool:
    """Ready, and the node lifecycle controller has lifted its own ``node.kubernetes.io/*`` taints (it does so a
    moment after Ready): what is left are the pool's taints."""
    if doc is None:
        return False
    lifecycle = [t for t in doc["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in doc["status"].get("conditions", []))
    return ready and not lifecycle


def _node_state(rack: Rack) -> str:
    doc = _node(rack)
    if doc is None:
        return ""
    info = doc["status"].get("nodeInfo", {})
    return f"{'Ready' if _ready(doc) else 'NotReady'}, kubelet {info.get('kubeletVersion')}"


def provision(rack: Rack, release: Path, machine: Any, *, poll: Watch) -> list[dict[str, Any]]:
    """--ipxe: the server boots from the network into the imager, which writes its disk and reboots."""
    from tests.support.rack import GATEWAY

    url = f"http://{GATEWAY}/{release.name}/entry.ipxe"
    wait_for_other_vms()
    started = time.monotonic()
    with machine.power_on(rack.cp.ns, netboot=url, name="provision") as boot:
        print(f"  powered on (console {boot.console}); the firmware netboots {url}", flush=True)
        deadline = time.monotonic() + IMAGER_TIMEOUT_S
        while boot.running():
            poll(boot)
            failed = IMAGER_FAILED.search(boot.text())
            if (
                failed
            ):  # the imager's init stops in a shell for the operator: no need to wait for the deadline
                raise DemoError(f"the imager failed: {failed.group(0)}; its console: {boot.console}")
            if time.monotonic() > deadline:
                raise DemoError(f"the imager did not finish in {IMAGER_TIMEOUT_S} s: see {boot.console}")
            time.sleep(2)
        poll(boot)
    events: list[dict[str, Any]] = list(rack.http.recorder.events)
    for event in events:
        print(f"  [imager event] {json.dumps(event)[:200]}")
    (rack.work / "release-server.json").write_text(
        json.dumps({"requests": rack.http.recorder.requests, "events": events}, indent=1) + "\n"
    )
    if [e.get("event") for e in events][-1:] != ["done"]:
        raise DemoError(f"the imager did not finish its work: events {[e.get('event') for e in events]}")
    print(f"  provisioned in {time.monotonic() - started:.0f} s; the imager rebooted the server")
    return events


def compare_written(image: Path, target: Path, work: Path) -> str:
    """``qemu-img compare`` of the image's partitions with the written disk (the GPT areas at both ends are
    rewritten when the backup table moves to the disk's end); the tool's own words, or "" when they match."""
    from tests.support.peers import run

    virtual = int(json.loads(run(["qemu-img", "info", "--output=json", image]).stdout)["virtual-size"])
    body = f"offset={1 << 20},size={virtual - (2 << 20)}"
    got = run(["qemu-img", "compare", "--image-opts", f"driver=raw,{body},file.driver=qcow2,file.file.filename={image}",
               f"driver=raw,{body},file.filename={target}"], check=False, timeout=900)  # fmt: skip
    (work / "compare.txt").write_text(f"exit {got.returncode}\n{got.stdout}{got.stderr}")
    return "" if got.returncode == 0 else (got.stdout + got.stderr).strip()


def first_boot(rack: Rack, machine: Any, *, poll: Watch) -> float:
    """Power on and watch until the Node is Ready (or the chain fails); then power off. Returns seconds."""
    wait_for_other_vms()
    started = time.monotonic()
    with machine.power_on(rack.cp.ns, name="node") as boot:
        print(f"  powered on (console {boot.console})", flush=True)
        deadline = time.monotonic() + NODE_TIMEOUT_S
        while True:
            poll(boot)
            audit = rack.audit()
            refused = [e for e in audit if e.get("result") not in ("ok", None) and e.get("event") == "join"]
            if refused and not any(e.get("event") == "join" and e.get("result") == "ok" for e in audit):
                # the agent retries transient refusals; a policy refusal is final: no need to wait the deadline
                final = [e for e in refused if e.get("reason") in ("policy_denied", "boot_not_accepted")]
                if final:
                    raise DemoError(f"the server refused the node: {json.dumps(final[-1])[:600]}")
            if _ready(_node(rack)):
                break
            if not boot.running():
                raise DemoError(f"the server stopped before its Node was Ready: see {boot.console}")
            if time.monotonic() > deadline:
                raise DemoError(f"no Ready Node {NODE_NAME} after {NODE_TIMEOUT_S} s: see {boot.console}")
            time.sleep(3)
        seconds = time.monotonic() - started
        print(f"  the Node is Ready {seconds:.0f} s after power-on", flush=True)
        # then the agent enrols the DevID and starts spire-agent, which attests to spire-server with it
        limit = time.monotonic() + SPIRE_AGENT_S
        while (
            rack.spire is not None
            and not _spire_agents(rack)
            and time.monotonic() < limit
            and boot.running()
        ):
            poll(boot)
            time.sleep(3)
        poll(boot)
        agents = _spire_agents(rack)
        for agent in agents:
            print(f"  [spire-server] agent {agent.get('id', {}).get('path')} attested with "
                  f"{agent.get('attestation_type')}", flush=True)  # fmt: skip
        if rack.spire is not None:
            (rack.work / "spire-agents.json").write_text(json.dumps(agents, indent=1) + "\n")
        print("  pressing the power button", flush=True)
        boot.power_off(timeout=180)
    return seconds


def _spire_agents(rack: Rack) -> list[dict[str, Any]]:
    from tests.support.peers import PeerError

    try:
        agents: list[dict[str, Any]] = rack.spire.agents()
    except (PeerError, ValueError):  # the server's CLI failed or said nothing readable: nothing attested yet
        return []
    return agents


@dataclass
class NodeDisk:
    """The server's root file system, read offline after power-off (debugfs: no mount, no loop device)."""

    raw: Path
    offset: int

    @classmethod
    def open(cls, disk: Path, fmt: str, work: Path) -> NodeDisk:
        from tests.support.peers import run

        raw = disk
        if fmt != "raw":
            raw = work / "node-disk.raw"
            run(["qemu-img", "convert", "-O", "raw", disk, raw], timeout=900)
        table = json.loads(run(["sfdisk", "-J", raw]).stdout)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        root = max(table["partitions"], key=lambda p: int(p["size"]))
        return cls(raw, int(root["start"]) * sector)

    def _debugfs(self, request: str) -> subprocess.CompletedProcess[str]:
        from tests.support.peers import run

        return run(["debugfs", "-R", request, f"{self.raw}?offset={self.offset}"], check=False, timeout=300)

    def read(self, path: str) -> str | None:
        """A text file's contents, or None when it is not there."""
        got = self._debugfs(f"cat {path}")
        if "File not found" in got.stderr:
            return None
        return got.stdout

    def listdir(self, path: str) -> list[str]:
        names = [
            f.split("/")[5] for f in self._debugfs(f"ls -p {path}").stdout.splitlines() if f.count("/") >= 6
        ]
        return sorted(n for n in names if n not in (".", ".."))

    def dump(self, path: str, out: Path) -> bool:
        got = self._debugfs(f"dump {path} {out}")
        return out.exists() and "File not found" not in got.stderr


def read_node(disk: NodeDisk, work: Path) -> dict[str, Any]:
    """What the node kept: the agent's state, the Kubernetes packages and their holds, the agent's journal."""
    found: dict[str, Any] = {}
    state = disk.read("/var/lib/nodeagent/state.json")
    found["state"] = json.loads(state) if state else None
    found["joined_marker"] = disk.read("/var/lib/nodeagent/joined") is not None
    status = disk.read("/var/lib/dpkg/status") or ""
    packages: dict[str, dict[str, str]] = {}
    for para in status.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", para, re.MULTILINE))
        if fields.get("Package") in ("kubeadm", "kubelet", "kubectl"):
            packages[fields["Package"]] = {
                "version": fields.get("Version", ""),
                "status": fields.get("Status", ""),
            }
    found["packages"] = packages
    journal_text = ""
    for machine in disk.listdir("/var/log/journal"):
        for name in disk.listdir(f"/var/log/journal/{machine}"):
            if name.endswith(".journal"):
                local = work / "journal" / machine / name
                local.parent.mkdir(parents=True, exist_ok=True)
                disk.dump(f"/var/log/journal/{machine}/{name}", local)
    if (work / "journal").is_dir():
        from tests.support.peers import run

        got = run(["journalctl", "--directory", work / "journal", "--no-pager", "-o", "short-monotonic"],
                  check=False, timeout=300)  # fmt: skip
        journal_text = got.stdout
    found["journal"] = journal_text
    found["devid_cert"] = disk.read("/var/lib/nodeagent/devid/devid.crt.pem")
    return found


def show_node(rack: Rack, node: dict[str, Any] | None) -> None:
    got = rack.cp.kubectl("get", "node", NODE_NAME, "-o", "wide", check=False)
    say("$ kubectl get node " + NODE_NAME + " -o wide\n" + (got.stdout or got.stderr).rstrip())
    if node is not None:
        labels = {
            k: v for k, v in node["metadata"].get("labels", {}).items() if not k.startswith("kubernetes.io/")
        }
        say(f"labels: {json.dumps(labels, sort_keys=True)}")
        say(f"taints: {json.dumps(node['spec'].get('taints', []))}")


def verdict(
    rack: Rack, *, node: dict[str, Any] | None, kept: dict[str, Any], version: str, release_name: str | None,
    events: list[dict[str, Any]] | None, logs: list[Path],
) -> list[str]:  # fmt: skip
    """What went wrong, from the server's records, the API server and the node's disk; empty when all held."""
    problems = []
    audit = rack.audit()
    attests = [e for e in audit if e.get("event") == "attest"]
    joins = [e for e in audit if e.get("event") == "join"]
    if not any(e.get("result") == "ok" and e.get("ek_trust") == "ca" for e in attests):
        problems.append("the server's audit log has no successful attestation with a CA-trusted EK")
    granted = [
        e
        for e in joins
        if e.get("result") == "ok" and e.get("node_name") == NODE_NAME and e.get("pool") == POOL
    ]
    if not granted:
        problems.append(f"the server's audit log has no successful join of {NODE_NAME} in the {POOL} pool")
    for join in granted:
        if join.get("verdict") != "pass" or join.get("warned_checks"):
            problems.append(
                f"the report did not pass every check: {join.get('verdict')}, warned {join.get('warned_checks')}"
            )
        if release_name is not None and join.get("release") != release_name:
            problems.append(
                f"the quote proved release {join.get('release')!r}, not the build {release_name!r}"
            )
    token_ids = {e.get("token_id") for e in granted}
    revoked = {
        e.get("token_id") for e in audit if e.get("event") == "joined" and e.get("token_revoked") is True
    }
    if not token_ids or not token_ids <= revoked:
        problems.append(f"tokens issued {sorted(map(str, token_ids))}, revoked {sorted(map(str, revoked))}")
    left = rack.cp.kubectl("-n", "kube-system", "get", "secrets", "-l", "app.kubernetes.io/managed-by=nodetrust",
                           "-o", "name", check=False).stdout.strip()  # fmt: skip
    if left:
        problems.append(f"a token the broker issued is still in the cluster: {left}")
    if not _ready(node):
        problems.append(f"the Node {NODE_NAME} is not Ready")
    elif node is not None:
        labels = node["metadata"].get("labels", {})
        for key, value in {**JOIN["labels"], "nodetrust.io/pool": POOL}.items():
            if labels.get(key) != value:
                problems.append(f"the Node's label {key} is {labels.get(key)!r}, not {value!r}")
        taints = [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in node["spec"].get("taints", [])]
        if JOIN["taints"][0] not in taints:
            problems.append(f"the Node's taints {taints} lack the pool's {JOIN['taints'][0]}")
        kubelet = node["status"].get("nodeInfo", {}).get("kubeletVersion")
        if kubelet != f"v{version}":
            problems.append(f"the Node's kubelet is {kubelet}, not the pool's v{version}")
    packages = kept.get("packages") or {}
    for name in ("kubeadm", "kubelet", "kubectl"):
        got = packages.get(name) or {}
        if not str(got.get("version", "")).startswith(f"{version}-") or not str(
            got.get("status", "")
        ).startswith("hold "):
            problems.append(f"the node's {name} package is {got or 'absent'}, not {version} held")
    state = kept.get("state") or {}
    if state.get("kubernetes_version") != version or not kept.get("joined_marker"):
        problems.append(
            f"the agent's state says {state.get('step')!r}, Kubernetes {state.get('kubernetes_version')!r}"
        )
    if events is not None:
        names = [e.get("event") for e in events]
        if names != ["verified", "disk-chosen", "written", "boot-entry", "done"]:
            problems.append(f"the imager's events are {names}")
        elif events[1].get("disk", {}).get("serial") != TARGET_SERIAL:
            problems.append(
                f"the imager chose {events[1].get('disk')}, not the disk with serial {TARGET_SERIAL}"
            )
    if rack.spire is not None:
        problems += _spire_problems(rack, kept)
    texts = [kept.get("journal") or ""] + [p.read_text(errors="replace") for p in logs if p.exists()]
    for text in texts:
        for token in leaked_tokens(text, token_ids):
            problems.append(f"a join token appears in a log: {token[:6]}.<redacted>")
    return problems


def _spire_problems(rack: Rack, kept: dict[str, Any]) -> list[str]:
    """The node's spire-agent attested to the stock spire-server with tpm_devid, with the DevID nodeserver
    issued and the node keeps; the same identity in both servers' words."""
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    pem = kept.get("devid_cert")
    if not pem:
        return ["the node has no DevID certificate in /var/lib/nodeagent/devid"]
    leaf = x509.load_pem_x509_certificates(pem.encode())[0]
    digest = hashlib.sha1(leaf.public_bytes(Encoding.DER), usedforsecurity=False).hexdigest()
    want = f"/spire/agent/tpm_devid/{digest}"
    agents = _spire_agents(rack)
    mine = [a for a in agents if a.get("id", {}).get("path") == want]
    problems = []
    if not mine or mine[0].get("attestation_type") != "tpm_devid":
        problems.append(f"spire-server has no tpm_devid agent {want}: {[a.get('id') for a in agents]}")
    issued = [e for e in rack.audit() if e.get("event") == "devid" and e.get("result") == "ok"]
    if not any(str(e.get("devid_agent_id", "")).endswith(want) for e in issued):
        problems.append(f"nodeserver's audit log has no DevID issued for {want}")
    return problems


def rack_chain(
    work: Path,
    *,
    folder: Path,
    build_pub: Path,
    manifest: dict[str, Any],
    version: str,
    accel: str,
    ipxe: bool,
) -> int:
    """The demo after the image: the rack, the release, the server's boots, the verdict. Exit status."""
    from tests.support.bootenv import imager_bootenv
    from tests.support.kube_debs import control_plane_binaries
    from tests.support.peers import run
    from tests.support.rack import Disk, Server
    from tests.support.swtpm import LocalCa, manufacture

    measured = folder / "boot-measurements.json"
    enabled = ((manifest.get("contents") or {}).get("node") or {}).get("enabled") or []
    spire = "spire-agent.service" in enabled
    with contextlib.ExitStack() as stack:
        step(
            2,
            "The server's TPM: an swtpm state with an EK certificate from a local EK CA (its manufacturer)",
        )
        ek_ca = LocalCa(work / "ek-ca")
        manufacture(work / "tpm", ek_ca)
        for private in (work / "ek-ca", work / "tpm"):
            private.chmod(0o700)
        print(
            f"  manufactured {work / 'tpm'}; the server's firmware and kernel reach it through swtpm's socket"
        )
        if not spire:
            print(
                "  this image ships no spire-agent.service: the workload-identity step (DevID, SPIRE) is left out"
            )

        step(3, "The rack: a network namespace with the management side; servers reach it as 10.0.2.2")
        rack = start_rack(work, stack, version=version, measurements=measured if measured.is_file() else None,
                          ek_ca=ek_ca, spire=spire)  # fmt: skip

        step(
            4,
            "The release set: the iPXE script, the imager, the image and the node pool's cloud-init, signed",
        )
        bootenv = imager_bootenv()
        kubeadm = control_plane_binaries(version) / "kubeadm"
        release, _info = make_release(rack, folder, build_pub, bootenv=bootenv, kubeadm=kubeadm, ipxe=ipxe)

        step(5, "The server: UEFI firmware with its own NVRAM, that TPM, its disks")
        vm = work / "server-vm"
        vm.mkdir(mode=0o700)
        image = next(folder.glob("*.qcow2"))
        poll = Watch(rack)
        events = None
        if ipxe:
            disks = [Disk(vm / "target.img", TARGET_SERIAL), Disk(vm / "other.img", OTHER_SERIAL)]
            for disk, gib in zip(disks, (TARGET_GIB, OTHER_GIB), strict=True):
                with disk.path.open("wb") as fh:
                    fh.truncate(gib << 30)
            print(f"  two empty disks: serial {TARGET_SERIAL} ({TARGET_GIB} GiB, the release's hint) and "
                  f"{OTHER_SERIAL} ({OTHER_GIB} GiB); accelerator {accel}")  # fmt: skip
            machine = Server(vm, tpm_state=work / "tpm", disks=disks, accel=accel, memory_mib=MEMORY_MIB)
            step(
                "5a",
                "Provisioning: iPXE -> the imager -> the verified image on the hinted disk -> boot entry",
            )
            events = provision(rack, release, machine, poll=poll)
            node_disk, fmt = disks[0].path, "raw"
            differs = compare_written(image, node_disk, work)
            if differs:
                raise DemoError(f"the written disk is not the signed image: {differs[:600]}")
            print(
                f"  qemu-img compare: the image's partitions on {TARGET_SERIAL} are the signed image, byte for byte"
            )
        else:
            from imagebuilder.media import make_seed
            from imager.seed import meta_data

            overlay = vm / "disk.qcow2"
            run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", image, overlay])
            user = (release / "worker.user-data").read_text()
            meta = meta_data(release=release.name, disk_id=TARGET_SERIAL).decode()
            seed = make_seed(user, meta, vm / "seed.iso")
            print(f"  its disk: the image {image.name} (a copy-on-write overlay, serial {TARGET_SERIAL}); the node "
                  f"pool's cloud-init (the release's worker.user-data) on a CIDATA disk; accelerator {accel}")  # fmt: skip
            disks = [Disk(overlay, TARGET_SERIAL, "qcow2"), Disk(seed, "CIDATA")]
            machine = Server(vm, tpm_state=work / "tpm", disks=disks, accel=accel, memory_mib=MEMORY_MIB)
            node_disk, fmt = overlay, "qcow2"

        step(6, "First boot: cloud-init writes the pool's configuration; nodeagent attests, checks, joins")
        first_boot(rack, machine, poll=poll)

        step(7, "The node in the cluster")
        node = _node(rack)
        (work / "node.json").write_text(json.dumps(node, indent=1) + "\n")
        show_node(rack, node)

        step(8, "The node's disk, read after power-off: the agent's state, the packages, the journal")
        kept = read_node(NodeDisk.open(node_disk, fmt, vm), vm)
        (work / "kept.json").write_text(
            json.dumps({k: v for k, v in kept.items() if k != "journal"}, indent=1)
        )
        (work / "journal.txt").write_text(kept["journal"])
        state = kept.get("state") or {}
        say(
            f"/var/lib/nodeagent/state.json: step {state.get('step')}, Kubernetes {state.get('kubernetes_version')}"
        )
        for name, pkg in sorted((kept.get("packages") or {}).items()):
            say(f"{name} {pkg['version']} ({pkg['status']})")
        agent_lines = [line for line in kept["journal"].splitlines() if " nodeagent[" in line]
        say("nodeagent's journal (last lines):\n" + "\n".join(agent_lines[-12:]))
        logs = [p for p in vm.glob("*.console.log")] + [work / "server.log"]
        rack.server.stop()

        step(9, "The verdict")
        problems = verdict(rack, node=node, kept=kept, version=version,
                           release_name=json.loads(measured.read_text()).get("image") if measured.is_file() else None,
                           events=events, logs=logs)  # fmt: skip
        if problems:
            print("\n\033[1mdemo: FAILED\033[0m")
            for problem in problems:
                print(f"  - {problem}")
            return 1
    print(
        "\n\033[1mdemo: the server booted the signed image, proved its TPM identity and its boot, passed every "
        f"check, and joined the cluster: {NODE_NAME} is Ready.\033[0m"
    )
    return 0
