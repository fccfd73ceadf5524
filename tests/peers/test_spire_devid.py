"""Real SPIRE v1.13.3 both ways with SPIRE's built-in ``tpm_devid``, the DevID enrolled by nodeserver.

One swtpm (UNIX socket, as SPIRE's go-tpm opens it) with an EK certificate from the suite's swtpm CA;
nodeagent attests with its EK to nodeserver and enrols an LDevID (RSA and ECC keys): no tpm2-tools,
no hand-made certificate. Then:

* nodeagent attests with that DevID to a stock spire-server (``devid_ca_path`` = nodeserver's DevID
  CA), which names it exactly as nodeserver does (SPIFFE ID and selectors compared);
* the real spire-agent attests with it to the stock spire-server: a node enrolled by nodetrust gets its
  workload identity from stock SPIRE with no third-party plugin; again from a private mount namespace
  whose /dev/tpm0 is the swtpm socket, found by the agent itself (the plugin tests' trick);
* the real spire-agent attests with it to nodeserver and stays up through several agent SVID
  rotations (nodeserver's shortest agent SVID TTL, 1m): it never exits, its health endpoints answer
  live and ready, and nodeserver's audit shows each re-attestation;
* the agent.conf a node-pool release writes (docs/attestation.md), with the DevID files where the
  image's spire-agent.service hands them over, attests to the stock spire-server and serves the
  Workload API where workloads reach it.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.attest_client import ServerTarget, attest
from agent.devid_client import DevidFiles, Enrolled, attest_devid, enrol
from tests.support.peers import PeerError, run, spawn, stop
from tests.support.server import ServerThread, server_config
from tests.support.spire import (
    SpireAgent,
    SpireServer,
    devid_agent_attestor,
    devid_server_attestor,
    spire_binary,
    wait_for_line,
)
from tests.support.swtpm import LocalCa, Swtpm, manufacture, missing_tools
from tests.support.tpm_mntns import argv_prefix
from tests.systemd.test_spire_agent_unit import CREDENTIALS, documented_agent_conf

TD = "example.org"
ROTATIONS = 3


@dataclass
class Node:
    base: Path
    tpm: Swtpm
    nodeserver: ServerThread
    endorsement_ca: Path  # swtpm-localca root + issuer: spire-server's endorsement_ca_path
    devids: dict[str, Enrolled]

    @property
    def target(self) -> ServerTarget:
        return ServerTarget.parse(self.nodeserver.address, TD, self.nodeserver.bundle)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    try:
        spire_binary("spire-server")
        spire_binary("spire-agent")
    except PeerError as exc:
        pytest.fail(f"SPIRE v1.13.3 is not built: {exc}", pytrace=False)
    if missing_tools():
        pytest.fail(f"swtpm tools missing: {', '.join(missing_tools())}", pytrace=False)
    base = tmp_path_factory.mktemp("spire-devid")
    ca = LocalCa(base / "swtpm-ca")
    manufacture(base / "tpm", ca)
    ca.install_into(base / "ek-ca")
    endorsement = base / "endorsement-ca.pem"
    endorsement.write_bytes(ca.root_cert.read_bytes() + ca.issuer_cert.read_bytes())
    tpm = Swtpm(base / "tpm", unix=True).start()
    srv = ServerThread(
        server_config(base / "nodeserver", ek_trust={"ca_dir": str(base / "ek-ca")}, agent_svid_ttl="1m")
    ).start()
    try:
        n = Node(base, tpm, srv, endorsement, {})
        svid = attest(
            n.target, tcti=tpm.tcti, state_dir=base / "agent-state"
        )  # the EK attestation comes first
        srv.admit(svid.spiffe_id)  # and a granted join (tests/peers/test_host_join.py joins for real)
        for alg in ("rsa", "ecc"):
            n.devids[alg] = enrol(n.target, tcti=tpm.tcti, files=DevidFiles(base / f"devid-{alg}"), alg=alg)
        yield n
    finally:
        srv.stop()
        tpm.stop()


@pytest.fixture(scope="module")
def spire_server(node: Node) -> Iterator[SpireServer]:
    ca = node.devids["rsa"].files.ca_path  # nodeserver's DevID CA, as enrolment wrote it
    server = SpireServer(node.base / "spire-server", TD, devid_server_attestor(ca, node.endorsement_ca))
    try:
        server.start()
    except PeerError as exc:
        server.stop()
        pytest.fail(f"spire-server did not start: {exc}", pytrace=False)
    (node.base / "spire-bundle.pem").write_bytes(server.bundle_pem())
    yield server
    server.stop()


def _selectors(doc: dict[str, object]) -> set[str]:
    raw = doc.get("selectors") or []
    assert isinstance(raw, list)
    return {f"{s['type']}:{s['value']}" for s in raw if isinstance(s, dict)}


@pytest.mark.parametrize("alg", ["rsa", "ecc"])
def test_nodeagent_attests_to_spire_server_with_the_enrolled_devid(
    node: Node, spire_server: SpireServer, alg: str
) -> None:
    enrolled = node.devids[alg]
    target = ServerTarget.parse(f"127.0.0.1:{spire_server.port}", TD, spire_server.bundle_pem())
    svid = attest_devid(target, tcti=node.tpm.tcti, files=enrolled.files, state_dir=node.base / f"s-{alg}")
    assert svid.spiffe_id == enrolled.agent_id
    assert svid.reattestable
    shown = spire_server.agent_show(svid.spiffe_id)
    agent = shown.get("agent", shown)
    assert isinstance(agent, dict)
    assert agent["attestation_type"] == "tpm_devid"
    assert agent.get("can_reattest") is True
    # nodeserver names the same DevID exactly as spire-server does: same ID, same selectors.
    mine = attest_devid(
        node.target, tcti=node.tpm.tcti, files=enrolled.files, state_dir=node.base / f"n-{alg}"
    )
    assert mine.spiffe_id == svid.spiffe_id
    store = node.nodeserver.app.store
    assert store is not None
    record = store.get_agent(mine.spiffe_id)
    assert record is not None
    assert set(record.selectors) == _selectors(agent)
    assert any(s.startswith("tpm_devid:ca:fingerprint:") for s in record.selectors)


def test_spire_agent_with_the_enrolled_devid_attests_to_stock_spire_server(
    node: Node, spire_server: SpireServer
) -> None:
    files = node.devids["rsa"].files
    agent = SpireAgent(
        node.base / "agent-to-spire",
        TD,
        spire_server.port,
        node.base / "spire-bundle.pem",
        devid_agent_attestor(node.tpm.device_path, files.cert_path, files.priv_path, files.pub_path),
    ).start()
    try:
        assert agent.wait_attested() == node.devids["rsa"].agent_id
        wait_for_line(agent.log_path, r"Starting Workload and SDS APIs", proc=agent.proc, timeout=60)
        assert "Agent is healthy" in agent.healthcheck().stdout
    finally:
        assert agent.stop() == 0


def test_spire_agent_finds_the_tpm_in_a_private_mount_namespace(
    node: Node, spire_server: SpireServer
) -> None:
    """The trick the plugin tests need, checked here without the plugin: no tpm_device_path, so spire-agent
    looks for /dev/tpmN itself and finds the swtpm socket behind the namespace's /dev/tpm0."""
    files = node.devids["rsa"].files
    agent = SpireAgent(
        node.base / "agent-in-mntns",
        TD,
        spire_server.port,
        node.base / "spire-bundle.pem",
        devid_agent_attestor(None, files.cert_path, files.priv_path, files.pub_path),
    ).start(argv_prefix=argv_prefix(node.tpm.device_path, node.base / "mntns"))
    try:
        assert agent.wait_attested() == node.devids["rsa"].agent_id
        # spire-agent stopped while its manager still fetches the bundle exits 1 ("Agent crashed: context
        # canceled"): stop it once it serves, so that its exit status says something about the attestation
        wait_for_line(agent.log_path, r"Starting Workload and SDS APIs", proc=agent.proc, timeout=60)
    finally:
        assert agent.stop() == 0
    assert not Path("/dev/tpm0").exists() or Path("/dev/tpm0").resolve() != node.tpm.device_path


def test_spire_agent_stays_healthy_against_nodeserver_through_rotations(node: Node) -> None:
    files = node.devids["rsa"].files
    bundle = node.base / "nodeserver-bundle.pem"
    bundle.write_bytes(node.nodeserver.bundle)
    agent = SpireAgent(
        node.base / "agent-to-nodeserver",
        TD,
        node.nodeserver.app.ports.attest,
        bundle,
        devid_agent_attestor(node.tpm.device_path, files.cert_path, files.priv_path, files.pub_path),
    ).start()
    crash = (
        r"Agent crashed",
        r"Failed to fetch authorized entries",
        r"Failed to retrieve attestation result",
    )
    try:
        agent_id = agent.wait_attested()
        assert agent_id == node.devids["rsa"].agent_id
        # Each rotation of a re-attestable agent is a whole tpm_devid attestation (SPIRE >= 1.10).
        wait_for_line(
            agent.log_path,
            r"Successfully reattested node",
            proc=agent.proc,
            timeout=120 * ROTATIONS,
            fail_on=crash,
            count=ROTATIONS,
        )
        assert agent.proc is not None and agent.proc.poll() is None  # never exited, never restarted
        assert agent.http_status("/live") == 200
        assert agent.http_status("/ready") == 200
        assert "Agent is healthy" in agent.healthcheck().stdout
        log = agent.log_path.read_text()
        # One process, one node attestation from scratch: everything after it was a rotation.
        assert log.count("Starting agent") == 1 and log.count("Node attestation was successful") == 1
    finally:
        rc = agent.stop()
    assert rc == 0, "spire-agent did not stop gracefully"
    attests = [
        line
        for line in node.nodeserver.audit_lines()
        if line.get("event") == "attest" and line.get("spiffe_id") == agent_id
    ]
    ok = [line for line in attests if line.get("result") == "ok"]
    assert len(ok) >= 1 + ROTATIONS, attests
    assert all(line.get("attestor") == "tpm_devid" for line in ok)
    assert len({line.get("svid_serial") for line in ok}) == len(ok)  # a new SVID each time


def test_the_release_agent_conf_attests_with_the_devid_the_unit_hands_over(
    node: Node, spire_server: SpireServer
) -> None:
    """docs/attestation.md's agent.conf (what a node-pool release writes) with the real spire-agent.

    Its paths are moved into this test's folders: the credentials folder holds copies of the DevID files,
    as the unit's LoadCredential= makes them in /run/credentials/spire-agent.service/, the TPM is the
    swtpm socket, and the Workload API socket's folder does not exist yet (the unit's RuntimeDirectory
    does, its public/ subfolder does not): spire-agent makes it, reachable by every workload.
    """
    base = node.base / "release-conf"
    creds = base / "credentials"
    creds.mkdir(parents=True)
    files = node.devids["rsa"].files
    for path in (files.cert_path, files.priv_path, files.pub_path):
        shutil.copy(path, creds / path.name)
    run_dir = Path(tempfile.mkdtemp(prefix="nt-run-"))  # a short path: UNIX socket names are short
    conf = documented_agent_conf()
    for old, new in (
        (CREDENTIALS, str(creds)),
        ('"/dev/tpmrm0"', f'"{node.tpm.device_path}"'),
        ('"/var/lib/spire-agent"', f'"{base / "data"}"'),
        ('"/run/spire-agent/', f'"{run_dir}/'),
        ('"/etc/spire/agent/bundle.pem"', f'"{node.base / "spire-bundle.pem"}"'),
        ('"spire.example.org"', '"127.0.0.1"'),
        ('"8081"', f'"{spire_server.port}"'),
    ):
        assert old in conf, old
        conf = conf.replace(old, new)
    assert f'trust_domain      = "{TD}"' in conf
    (base / "agent.conf").write_text(conf)
    (base / "data").mkdir()
    log = base / "spire-agent.log"
    proc = spawn([spire_binary("spire-agent"), "run", "-config", base / "agent.conf"], log_path=log)
    try:
        line = wait_for_line(
            log,
            r"Node attestation was successful",
            proc=proc,
            timeout=90,
            fail_on=(r"Failed to retrieve attestation result", r"Agent crashed"),
        )[0]
        assert node.devids["rsa"].agent_id in line
        wait_for_line(log, r"Starting Workload and SDS APIs", proc=proc, timeout=60)
        socket = run_dir / "public" / "api.sock"
        assert stat.S_IMODE((run_dir / "public").stat().st_mode) == 0o755
        assert stat.S_ISSOCK(socket.stat().st_mode) and stat.S_IMODE(socket.stat().st_mode) == 0o777
        health = run([spire_binary("spire-agent"), "healthcheck", "-socketPath", socket], check=False)
        assert "Agent is healthy" in health.stdout, health.stdout + health.stderr
    finally:
        assert stop(proc) == 0
        shutil.rmtree(run_dir, ignore_errors=True)
