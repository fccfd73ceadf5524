"""``bench/attest.py --against spire-server``: the same boot storm against nodeserver and a real
spire-server v1.13.3, one after the other in one run, with each figure and the ratio nodeserver/SPIRE.

Load: N simulated agents (software TPM doubles, tests/support/simdevid.py and simtpm.py), C at a
time, from ``--clients`` processes, each agent on its own TLS connection. Attestors:

* ``tpm_devid`` (always; SPIRE's built-in attestor, no plugin): each agent has its own RSA EK with
  a certificate from a bench EK CA, an RSA AK, an ECC P-256 DevID key certified by the AK, and a
  DevID certificate from a bench DevID CA; it answers the credential activation and signs the nonce;
* ``tpm`` (when ``--tpm-plugin DIR`` or ``NODETRUST_SPIRE_TPM_PLUGIN`` names a folder holding
  spire-tpm-plugin's ``tpm_attestor_server``): bench/attest.py's own agents.

Figures per server: attestations/s, p50 and p99 latency, server CPU per attestation (utime + stime
of the server and every descendant: SPIRE's plugin processes count), peak RSS (VmHWM, summed over
the same processes). Both servers write SQLite on every attestation; SPIRE's rate limits are off
and nodeserver's per-address limits lifted (every simulated node comes from 127.0.0.1). The two
share the machine with the clients: compare ratios from one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.attest import CACHE, TRUST_DOMAIN, Prepared, distinct_rsa_keys, fan_out, prepare

SPIRE = "spire-server v1.13.3"


@dataclass
class DevidAgent:
    payload: bytes  # the tpm_devid AttestationRequest JSON
    csr: bytes
    ek_der: bytes  # EK private key, to answer the credential activation
    ak_name: bytes
    devid_der: bytes  # DevID private key (PKCS#8), to sign the nonce


def prepare_devid(n: int) -> tuple[bytes, bytes, list[DevidAgent]]:
    """(EK CA PEM, DevID root PEM, ``n`` agents), cached under .cache/bench/."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from agent.svid import make_csr, new_key
    from protocol.tpm_devid import encode_attestation_request
    from tests.support.simdevid import DevidPki, SimDevidTpm
    from tests.support.simtpm import SimCa, SimulatedTpm

    path = CACHE / f"devid-agents-v1-{n}.pickle"
    if path.exists():
        with path.open("rb") as fh:
            ek_pem, devid_pem, rows = pickle.load(fh)  # noqa: S301 - our own cache file
            return ek_pem, devid_pem, [DevidAgent(*row) for row in rows]
    ek_ca, pki = SimCa.create("Benchmark EK CA"), DevidPki.create("Benchmark DevID")
    aks = [SimulatedTpm.create(None).ak for _ in range(50)]
    der = serialization.Encoding.DER
    pkcs8 = serialization.PrivateFormat.PKCS8
    out = []
    for i, ek in enumerate(distinct_rsa_keys(n)):
        devid = ec.generate_private_key(ec.SECP256R1())
        sim = SimDevidTpm(
            ek=ek,
            ek_cert=ek_ca.issue_ek_cert(ek.public_key()),
            ak=aks[i % len(aks)],
            devid=devid,
            chain=pki.chain(devid.public_key(), cn=f"bench-node-{i}"),
        )
        out.append(
            DevidAgent(
                payload=encode_attestation_request(sim.request()),
                csr=make_csr(new_key()),
                ek_der=ek.private_bytes(der, pkcs8, serialization.NoEncryption()),
                ak_name=sim.name(sim.ak_public()),
                devid_der=devid.private_bytes(der, pkcs8, serialization.NoEncryption()),
            )
        )
        if (i + 1) % 1000 == 0:
            print(f"  prepared {i + 1}/{n} tpm_devid agents", file=sys.stderr, flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    rows = [(a.payload, a.csr, a.ek_der, a.ak_name, a.devid_der) for a in out]
    with path.open("wb") as fh:
        pickle.dump((ek_ca.pem(), pki.root_pem(), rows), fh)
    return ek_ca.pem(), pki.root_pem(), out


# -- one simulated tpm_devid agent -------------------------------------------------------------------
async def _one_devid(host: str, port: int, bundle: bytes, agent: DevidAgent) -> tuple[float, str]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    from agent.tls import SpiffeTLSContext
    from protocol import tpm2
    from protocol._gen.spire.api.server.agent.v1 import agent_pb2
    from protocol.credential import Credential, activate_credential
    from protocol.spiffe import server_id
    from protocol.tpm_devid import ChallengeResponse, decode_challenge, encode_challenge_response
    from tests.support.rawclient import ATTEST, params

    start = time.monotonic()
    channel = Channel(host, port, ssl=SpiffeTLSContext(bundle, [server_id(TRUST_DOMAIN)]))
    try:
        async with channel.request(
            ATTEST,
            Cardinality.STREAM_STREAM,
            agent_pb2.AttestAgentRequest,
            agent_pb2.AttestAgentResponse,
            timeout=60,
        ) as stream:
            await stream.send_message(params(agent.payload, agent.csr, "tpm_devid"))
            reply = await stream.recv_message()
            if reply is None:
                return time.monotonic() - start, "no challenge"
            ch = decode_challenge(reply.challenge)
            ek = serialization.load_der_private_key(agent.ek_der, None, unsafe_skip_rsa_key_validation=True)
            devid = serialization.load_der_private_key(agent.devid_der, None)
            if not isinstance(ek, rsa.RSAPrivateKey) or not isinstance(devid, ec.EllipticCurvePrivateKey):
                return time.monotonic() - start, "bad cached keys"
            cred = Credential(tpm2.tpm2b(ch.credential), tpm2.tpm2b(ch.secret))
            answer = ChallengeResponse(
                signature=devid.sign(ch.nonce, ec.ECDSA(hashes.SHA256())),
                cert_info=activate_credential(ek, agent.ak_name, cred),
            )
            await stream.send_message(
                agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(answer)), end=True
            )
            result = await stream.recv_message()
            ok = result is not None and result.WhichOneof("step") == "result"
            return time.monotonic() - start, "ok" if ok else "no result"
    except GRPCError as exc:
        return time.monotonic() - start, f"{exc.status.name}: {exc.message}"
    except Exception as exc:  # every failure is counted and reported
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    finally:
        protocol = getattr(channel, "_protocol", None)
        transport = getattr(
            getattr(getattr(protocol, "processor", None), "connection", None), "_transport", None
        )
        if transport is not None:
            transport.abort()  # like an agent that exits after attesting (see bench/attest.py)
        channel.close()


def _client_devid(  # noqa: PLR0917 - a multiprocessing target takes positional arguments
    host: str, port: int, bundle: bytes, agents: list[DevidAgent], concurrency: int, queue: Any
) -> None:
    async def storm() -> list[tuple[float, str]]:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(a: DevidAgent) -> tuple[float, str]:
            async with sem:
                return await _one_devid(host, port, bundle, a)

        return await asyncio.gather(*(guarded(a) for a in agents))

    queue.put(asyncio.run(storm()))


def _client_tpm(  # noqa: PLR0917
    host: str, port: int, bundle: bytes, agents: list[Prepared], concurrency: int, queue: Any
) -> None:
    from bench.attest import _client

    _client(host, port, bundle, agents, concurrency, queue)


# -- process-tree accounting -----------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (SPIRE's plugin processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _rss_mib(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


@dataclass
class Figures:
    server: str
    attestor: str
    agents: int
    errors: int
    per_s: float
    p50: float
    p99: float
    cpu_ms: float
    rss_mib: float
    first_errors: list[str]


def _run(  # noqa: PLR0917 - one row of the table
    server: str,
    attestor: str,
    pid: int,
    port: int,
    bundle: bytes,
    agents: list[Any],
    args: argparse.Namespace,
) -> Figures:
    pids = _tree(pid)
    before = _cpu(pids)
    per_client = max(1, args.concurrency // args.clients)
    target = _client_devid if attestor == "tpm_devid" else _client_tpm

    def client_args(i: int, queue: Any) -> tuple[Any, ...]:
        return ("127.0.0.1", port, bundle, agents[i :: args.clients], per_client, queue)

    results, elapsed = fan_out(target, args.clients, client_args)
    pids = _tree(pid)  # plugins may have started meanwhile; a plugin that exited is not counted
    cpu = _cpu(pids) - before
    ok = sorted(lat for lat, status in results if status == "ok")
    errors = [status for _, status in results if status != "ok"]
    lat = ok or [0.0]
    return Figures(
        server=server,
        attestor=attestor,
        agents=len(results),
        errors=len(errors),
        per_s=len(ok) / elapsed,
        p50=statistics.median(lat),
        p99=lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        cpu_ms=cpu / max(1, len(ok)) * 1000,
        rss_mib=_rss_mib(pids),
        first_errors=sorted(set(errors))[:3],
    )


# -- the servers -----------------------------------------------------------------------------------------
def _nodeserver(work: Path, ek_ca: Path, devid_root: Path, store: str, transport: str | None = None) -> Any:
    from tests.support.serverproc import ServerProcess

    config: dict[str, Any] = {
        "trust_domain": TRUST_DOMAIN,
        "data_dir": str(work / "data"),
        "listen": "127.0.0.1:0",
        "metrics_listen": "off",
        "ek_trust": {"ca_dir": str(ek_ca)},
        "devid": {"trusted_ca_files": [str(devid_root)], "enrol": False},
        "attest_rate_per_ip": 0,
        "peer_max_inflight": 100_000,
    }
    if store:
        config["store"] = store
    if transport:
        config["transport"] = transport
    work.mkdir(parents=True, exist_ok=True)
    return ServerProcess(config, work / "config.yaml")


def _spire(work: Path, ek_ca_pem: Path, devid_root: Path, plugin: Path | None) -> Any:
    from tests.support.spire import SpireServer, devid_server_attestor, tpm_plugin_attestor

    attestors = devid_server_attestor(devid_root, ek_ca_pem)
    if plugin is not None:
        binary = plugin / "tpm_attestor_server"
        checksum = hashlib.sha256(binary.read_bytes()).hexdigest()
        attestors += tpm_plugin_attestor(binary, checksum, {"ca_path": str(ek_ca_pem.parent / "ek-ca")})
    return SpireServer(work, TRUST_DOMAIN, attestors, log_level="WARN").start()


def _table(rows: list[Figures]) -> None:
    head = ("server", "attestor", "att/s", "p50 s", "p99 s", "CPU ms/att", "peak RSS MiB", "errors")
    print("  {:<28} {:<10} {:>8} {:>7} {:>7} {:>11} {:>13} {:>7}".format(*head))
    for f in rows:
        print(
            f"  {f.server:<28} {f.attestor:<10} {f.per_s:8.1f} {f.p50:7.3f} {f.p99:7.3f} {f.cpu_ms:11.3f} "
            f"{f.rss_mib:13.1f} {f.errors:7d}"
        )


def _ratios(ours: Figures, theirs: Figures) -> dict[str, float]:
    def r(a: float, b: float) -> float:
        return round(a / b, 3) if b else 0.0

    return {
        "attestations_per_s": r(ours.per_s, theirs.per_s),
        "p50": r(ours.p50, theirs.p50),
        "p99": r(ours.p99, theirs.p99),
        "cpu_per_attestation": r(ours.cpu_ms, theirs.cpu_ms),
        "peak_rss": r(ours.rss_mib, theirs.rss_mib),
    }


def run_against_spire(args: argparse.Namespace) -> int:
    plugin_dir = args.tpm_plugin or os.environ.get("NODETRUST_SPIRE_TPM_PLUGIN") or ""
    plugin = Path(plugin_dir) if plugin_dir else None
    t0 = time.monotonic()
    ek_pem, devid_pem, devid_agents = prepare_devid(args.agents)
    tpm_agents: list[Prepared] = []
    tpm_ca = b""
    if plugin is not None:
        tpm_ca, tpm_agents = prepare(args.agents)
    print(f"bench/attest --against spire-server: agents ready in {time.monotonic() - t0:.1f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="nodetrust-bench-spire-"))
    (work / "ek-ca").mkdir()
    (work / "ek-ca" / "bench-ek-ca.pem").write_bytes(ek_pem)
    if tpm_ca and tpm_ca != ek_pem:
        (work / "ek-ca" / "bench-tpm-ek-ca.pem").write_bytes(tpm_ca)
    ek_bundle = work / "endorsement-ca.pem"
    ek_bundle.write_bytes(ek_pem + tpm_ca if tpm_ca != ek_pem else ek_pem)
    devid_root = work / "devid-root.pem"
    devid_root.write_bytes(devid_pem)
    plan = [("tpm_devid", devid_agents)] + ([("tpm", tpm_agents)] if plugin is not None else [])
    rows: list[Figures] = []
    for rnd in range(args.rounds):
        for attestor, agents in plan:
            # Alternate the order round by round: the machine's other load moves both servers' figures.
            first_spire = args.spire_first != (rnd % 2 == 1)
            for which in ("spire", "nodeserver") if first_spire else ("nodeserver", "spire"):
                tag = f"{attestor}-{rnd}"
                if which == "nodeserver":
                    ns = _nodeserver(
                        work / f"ns-{tag}", work / "ek-ca", devid_root, args.store, args.transport
                    )
                    try:
                        rows.append(
                            _run("nodeserver", attestor, ns.pid, ns.attest_port, ns.bundle, agents, args)
                        )
                    finally:
                        ns.stop()
                else:
                    sp = _spire(
                        work / f"spire-{tag}", ek_bundle, devid_root, plugin if attestor == "tpm" else None
                    )
                    try:
                        assert sp.proc is not None
                        label = SPIRE + (" + tpm plugin" if attestor == "tpm" else "")
                        rows.append(
                            _run(label, attestor, sp.proc.pid, sp.port, sp.bundle_pem(), agents, args)
                        )
                    finally:
                        sp.stop()
    print(
        f"bench/attest --against spire-server: {args.agents} agents, {args.concurrency} concurrent, "
        f"{args.clients} client processes"
    )
    _table(rows)
    out: dict[str, Any] = {
        "agents": args.agents,
        "concurrency": args.concurrency,
        "runs": [f.__dict__ for f in rows],
    }
    failed = False
    for attestor, _ in plan:
        ours = [f for f in rows if f.attestor == attestor and f.server == "nodeserver"]
        theirs = [f for f in rows if f.attestor == attestor and f.server != "nodeserver"]
        per_round = [_ratios(a, b) for a, b in zip(ours, theirs, strict=True)]
        for i, ratios in enumerate(per_round):
            print(
                f"  nodeserver / spire-server ({attestor}, round {i + 1}): "
                + ", ".join(f"{k} {v}x" for k, v in ratios.items())
            )
        mean = {k: round(statistics.mean(r[k] for r in per_round), 3) for k in per_round[0]}
        out[f"ratios_{attestor}"] = mean
        if len(per_round) > 1:
            print(
                f"  mean of {len(per_round)} rounds ({attestor}): "
                + ", ".join(f"{k} {v}x" for k, v in mean.items())
            )
        for f in (*ours, *theirs):
            if f.errors:
                failed = True
                print(f"  {f.server} errors: {'; '.join(f.first_errors)}")
    if plugin is None:
        print("  tpm plugin: not measured (give --tpm-plugin DIR or NODETRUST_SPIRE_TPM_PLUGIN)")
    if args.json:
        print(json.dumps(out))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0
