"""Boot storm: N simulated agents attest to a real nodeserver on loopback, C at a time.

The simulated agents are test doubles of TPMs (tests/support/simtpm.py): each
holds its own EK (with its own EK certificate from a benchmark EK CA) and an
AK in software, and answers the credential challenge with the same maths as
TPM2_ActivateCredential, so the server does its full work: TLS handshake, EK
chain verification, AK checks, credential, CSR check, SVID issuance, store
write, audit line, metrics. Each agent opens its own TLS connection, like a
real node.

Prints: attestations/s, p50/p99 latency, server CPU per attestation, peak
server RSS, and the ratio of server CPU per attestation to the cryptographic
floor (the same RSA, ECDSA and X.509 operations timed alone in this run).

Key material is cached under .cache/bench/ so later runs start fast. Distinct
RSA EKs are made from a pool of generated primes (n = p_i * p_j): fine for
test doubles, never for real keys.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"
TRUST_DOMAIN = "bench.nodetrust.test"


# -- key material ---------------------------------------------------------------
def _prime_pool(count: int) -> list[int]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    path = CACHE / f"primes-{count}.json"
    if path.exists():
        cached: list[int] = json.loads(path.read_text())
        return cached
    primes: list[int] = []
    while len(primes) < count:
        nums = rsa.generate_private_key(65537, 2048).private_numbers()
        primes += [nums.p, nums.q]
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(primes[:count]))
    return primes[:count]


def _rsa_from_primes(p: int, q: int) -> Any:
    from cryptography.hazmat.primitives.asymmetric import rsa

    e = 65537
    phi = (p - 1) * (q - 1)
    d = pow(e, -1, phi)
    return rsa.RSAPrivateNumbers(
        p=p, q=q, d=d, dmp1=d % (p - 1), dmq1=d % (q - 1), iqmp=pow(q, -1, p),
        public_numbers=rsa.RSAPublicNumbers(e, p * q),
    ).private_key(unsafe_skip_rsa_key_validation=True)  # fmt: skip


def distinct_rsa_keys(n: int) -> Iterator[Any]:
    """``n`` distinct RSA-2048 keys from a small pool of primes."""
    pool = 2
    while pool * (pool - 1) // 2 < n:
        pool += 1
    primes = _prime_pool(pool)
    made = 0
    for i in range(pool):
        for j in range(i + 1, pool):
            if made == n:
                return
            if primes[i] == primes[j]:
                continue
            yield _rsa_from_primes(primes[i], primes[j])
            made += 1


@dataclass
class Prepared:
    payload: bytes  # AttestationData JSON
    csr: bytes
    ek_der: bytes  # EK private key (PKCS#8 DER), to answer the challenge
    ak_name: bytes
    svid_key_pem: bytes = b""  # the CSR's private key, for the mutual TLS of the join benchmark


def prepare(n: int) -> tuple[bytes, list[Prepared]]:
    """The EK CA PEM and ``n`` agents' prepared first messages (cached)."""
    from cryptography.hazmat.primitives import serialization

    from agent.svid import make_csr, new_key
    from protocol.tpm_payload import encode_attestation_data
    from tests.support.simtpm import SimCa, SimulatedTpm

    path = CACHE / f"agents-v2-{n}.pickle"
    if path.exists():
        with path.open("rb") as fh:
            ca_pem, rows = pickle.load(fh)  # noqa: S301 - our own cache file
            return ca_pem, [Prepared(*row) for row in rows]
    ca = SimCa.create("Benchmark EK CA")
    aks = [SimulatedTpm.create(None).ak for _ in range(50)]
    out = []
    for i, ek in enumerate(distinct_rsa_keys(n)):
        sim = SimulatedTpm.create(ca, ek_key=ek, ak_key=aks[i % len(aks)])
        der = ek.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        key = new_key()
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        out.append(
            Prepared(
                encode_attestation_data(sim.attestation_data()), make_csr(key), der, sim.ak_name(), key_pem
            )
        )
        if (i + 1) % 1000 == 0:
            print(f"  prepared {i + 1}/{n} agents", file=sys.stderr, flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        pickle.dump((ca.pem(), [(a.payload, a.csr, a.ek_der, a.ak_name, a.svid_key_pem) for a in out]), fh)
    return ca.pem(), out


# -- the storm (client processes) ----------------------------------------------------
async def _one(
    host: str,
    port: int,
    bundle: bytes,
    agent: Prepared,
    chain: list[bytes] | None = None,
    *,
    echo: bool = False,
) -> tuple[float, str]:
    """One simulated agent's attestation; ``echo`` answers a no-op server without the credential maths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    from agent.tls import SpiffeTLSContext
    from protocol._gen.spire.api.server.agent.v1 import agent_pb2
    from protocol.credential import activate_credential
    from protocol.spiffe import server_id
    from protocol.tpm_payload import decode_challenge, encode_challenge_response
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
            await stream.send_message(params(agent.payload, agent.csr))
            challenge = await stream.recv_message()
            if challenge is None:
                return time.monotonic() - start, "no challenge"
            if echo:  # the transport floor's no-op server: same message sizes, no maths
                await stream.send_message(
                    agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(b"\0" * 32)),
                    end=True,
                )
                return time.monotonic() - start, "ok" if await stream.recv_message() else "no result"
            ek = serialization.load_der_private_key(agent.ek_der, None, unsafe_skip_rsa_key_validation=True)
            if not isinstance(ek, rsa.RSAPrivateKey):
                return time.monotonic() - start, "bad cached EK"
            secret = activate_credential(ek, agent.ak_name, decode_challenge(challenge.challenge))
            await stream.send_message(
                agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
            )
            result = await stream.recv_message()
            ok = result is not None and result.WhichOneof("step") == "result"
            if ok and chain is not None and result is not None:
                chain.extend(result.result.svid.cert_chain)
            return time.monotonic() - start, "ok" if ok else "no result"
    except GRPCError as exc:
        return time.monotonic() - start, f"{exc.status.name}: {exc.message}"
    except Exception as exc:  # every failure is counted and reported
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    finally:
        # A real node's agent exits after attesting, which drops its connection at once; here the
        # process lives on, and asyncio would keep the socket for up to 30 s waiting for the TLS
        # close_notify exchange. Abort the transport to behave like the exiting agent.
        protocol = getattr(channel, "_protocol", None)
        transport = getattr(
            getattr(getattr(protocol, "processor", None), "connection", None), "_transport", None
        )
        if transport is not None:
            transport.abort()
        channel.close()


def _client(  # noqa: PLR0917 - a multiprocessing target takes positional arguments
    host: str,
    port: int,
    bundle: bytes,
    agents: list[Prepared],
    concurrency: int,
    queue: Any,
    echo: bool = False,
) -> None:
    async def storm() -> list[tuple[float, str]]:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(a: Prepared) -> tuple[float, str]:
            async with sem:
                return await _one(host, port, bundle, a, echo=echo)

        return await asyncio.gather(*(guarded(a) for a in agents))

    queue.put(asyncio.run(storm()))


# -- server process measurements ----------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the cryptographic floor --------------------------------------------------------------
def crypto_floor(ca_pem: bytes, agent: Prepared, server_dir: Path, rounds: int = 300) -> dict[str, float]:
    """Seconds per attestation of the server's cryptography, timed alone."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

    from protocol import tpm2
    from protocol.tpm_payload import decode_attestation_data
    from server.ca import CertificateAuthority

    data = decode_attestation_data(agent.payload)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ek_cert_der = data.ek.certificate_der or b""
    ak_pub = tpm2.public_key(tpm2.parse_public(data.ak.public))
    sig = tpm2.parse_signature(data.ak.create_signature).rsa_signature
    ek_pub = data.ek.public_key()
    ca = CertificateAuthority.load_or_create(server_dir, TRUST_DOMAIN, ca_ttl=dt.timedelta(days=30))
    server_key = ec.generate_private_key(ec.SECP256R1())
    from protocol.spiffe import tpm_agent_id

    agent_id = tpm_agent_id(TRUST_DOMAIN, data.ek.pub_hash)
    ca_key = ca_cert.public_key()
    if not isinstance(ca_key, rsa.RSAPublicKey) or not isinstance(ak_pub, rsa.RSAPublicKey):
        raise SystemExit("the benchmark expects an RSA EK CA and RSA AKs")
    if not isinstance(ek_pub, rsa.RSAPublicKey):
        raise SystemExit("the benchmark expects RSA EKs")
    oaep = padding.OAEP(padding.MGF1(hashes.SHA256()), hashes.SHA256(), b"IDENTITY\x00")

    def ek_chain() -> None:
        cert = x509.load_der_x509_certificate(ek_cert_der)
        ca_key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), hashes.SHA256())

    def ak_signature() -> None:
        ak_pub.verify(sig, data.ak.create_attestation, padding.PKCS1v15(), hashes.SHA256())

    def credential() -> None:
        ek_pub.encrypt(os.urandom(16), oaep)

    def csr() -> None:
        CertificateAuthority.verify_csr(agent.csr)

    def svid() -> None:
        ca.sign_agent_csr(agent.csr, agent_id, dt.timedelta(hours=1))

    def handshake() -> None:
        server_key.sign(b"x" * 64, ec.ECDSA(hashes.SHA256()))
        ec.generate_private_key(ec.SECP256R1()).exchange(ec.ECDH(), server_key.public_key())

    ops = {
        "EK certificate parse + RSA chain signature verify": ek_chain,
        "AK CreateSignature RSA verify": ak_signature,
        "credential RSA-OAEP encrypt": credential,
        "CSR parse + ECDSA verify": csr,
        "SVID X.509 build + ECDSA sign": svid,
        "TLS handshake ECDSA sign + ECDH": handshake,
    }
    out = {}
    for name, fn in ops.items():
        fn()
        start = time.process_time()
        for _ in range(rounds):
            fn()
        out[name] = (time.process_time() - start) / rounds
    return out


def _storm(
    pid: int,
    port: int,
    bundle: bytes,
    agents: list[Prepared],
    args: argparse.Namespace,
    *,
    echo: bool = False,
) -> tuple[list[tuple[float, str]], float, float]:
    """Drive ``agents`` against the server at ``port`` (process ``pid``): results, wall seconds, server CPU s."""
    cpu_before = _cpu_seconds(pid)
    per_client = max(1, args.concurrency // args.clients)

    def client_args(i: int, queue: Any) -> tuple[Any, ...]:
        return ("127.0.0.1", port, bundle, agents[i :: args.clients], per_client, queue, echo)

    results, elapsed = fan_out(_client, args.clients, client_args)
    return results, elapsed, _cpu_seconds(pid) - cpu_before


def fan_out(
    target: Callable[..., None], processes: int, args_for: Callable[[int, Any], tuple[Any, ...]]
) -> tuple[list[tuple[float, str]], float]:
    """Run ``target(*args_for(i, queue))`` in ``processes`` processes; each puts its result list on
    the queue. Returns every result and the wall seconds from the first start to the last result."""
    queue: Any = mp.Queue()
    procs = [mp.Process(target=target, args=args_for(i, queue)) for i in range(processes)]
    start = time.monotonic()
    for p in procs:
        p.start()
    results: list[tuple[float, str]] = []
    for _ in procs:
        results += queue.get()
    elapsed = time.monotonic() - start
    for p in procs:
        p.join()
    return results, elapsed


def transport_floor(agents: list[Prepared], args: argparse.Namespace, data_dir: Path) -> float:
    """Server CPU seconds per exchange of the same gRPC/TLS stack with a no-op handler (bench/transport.py)."""
    from cryptography.hazmat.primitives import serialization

    from bench.transport import serve_noop
    from protocol.credential import make_credential
    from protocol.tpm_payload import decode_attestation_data, encode_challenge

    sample = agents[0]
    ek = serialization.load_der_private_key(sample.ek_der, None, unsafe_skip_rsa_key_validation=True)
    challenge = encode_challenge(make_credential(ek.public_key(), sample.ak_name, os.urandom(32)))  # type: ignore[arg-type]
    decode_attestation_data(sample.payload)  # the cached agents are well-formed
    data_dir.mkdir(parents=True, exist_ok=True)
    queue: Any = mp.Queue()
    proc = mp.Process(
        target=serve_noop,
        args=(str(data_dir), TRUST_DOMAIN, challenge, sample.csr, queue, args.transport or "wire"),
    )
    proc.start()
    try:
        port, bundle = queue.get(timeout=60)
        if proc.pid is None:
            raise RuntimeError("the no-op server did not start")
        results, _, cpu = _storm(proc.pid, port, bundle, agents, args, echo=True)
    finally:
        proc.kill()
        proc.join()
    failed = [status for _, status in results if status != "ok"]
    if failed:
        raise SystemExit(f"bench/attest: the transport floor run failed: {sorted(set(failed))[:3]}")
    return cpu / len(results)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--agents", type=int, default=10_000, help="simulated agents (default 10000)")
    parser.add_argument(
        "-c", "--concurrency", type=int, default=500, help="concurrent streams (default 500)"
    )
    parser.add_argument(
        "--clients", type=int, default=2, help="client processes sharing the concurrency (default 2)"
    )
    parser.add_argument("--store", default="", help="store DSN (default: SQLite in the server's data_dir)")
    parser.add_argument(
        "--transport",
        choices=("wire", "grpc"),
        help="nodeserver's attestation transport, here and with --against (default: the server's default, "
        "wire); the transport floor runs on the same stack",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    parser.add_argument(
        "--transport-agents",
        type=int,
        default=None,
        help="agents driven against a no-op server on the same gRPC/TLS stack to measure the transport "
        "floor (default: as many as --agents; 0 skips it)",
    )
    parser.add_argument(
        "--against",
        choices=("spire-server",),
        help="run the same storm against nodeserver and a real spire-server v1.13.3 (make peers) and print "
        "both and the ratios: tpm_devid, and the tpm plugin with --tpm-plugin (bench/attest_spire.py)",
    )
    parser.add_argument(
        "--tpm-plugin", metavar="DIR", help="spire-tpm-plugin binaries (default $NODETRUST_SPIRE_TPM_PLUGIN)"
    )
    parser.add_argument("--spire-first", action="store_true", help="with --against: run spire-server first")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --against: rounds, alternating which server goes first (2)",
    )
    args = parser.parse_args()
    if args.transport_agents is None:
        args.transport_agents = args.agents
    sys.path.insert(0, str(ROOT))
    if args.against:
        from bench.attest_spire import run_against_spire

        return run_against_spire(args)

    t0 = time.monotonic()
    ca_pem, agents = prepare(args.agents)
    print(
        f"bench/attest: {len(agents)} agents ready in {time.monotonic() - t0:.1f} s (cached in {CACHE})",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="nodetrust-bench-"))
    (work / "ek-ca").mkdir()
    (work / "ek-ca" / "bench-ca.pem").write_bytes(ca_pem)
    config = {
        "trust_domain": TRUST_DOMAIN,
        "data_dir": str(work / "data"),
        "listen": "127.0.0.1:0",
        "metrics_listen": "off",
        "ek_trust": {"ca_dir": str(work / "ek-ca")},
        # Every simulated node comes from 127.0.0.1: lift the per-address limits a real fleet,
        # spread over many addresses, never meets.
        "attest_rate_per_ip": 0,
        "peer_max_inflight": 100_000,
    }
    if args.store:
        config["store"] = args.store
    if args.transport:
        config["transport"] = args.transport
    (work / "config.yaml").write_text(json.dumps(config))
    from tests.support.serverproc import ServerProcess

    server = ServerProcess(None, work / "config.yaml")
    try:
        results, elapsed, cpu = _storm(server.pid, server.attest_port, server.bundle, agents, args)
        rss = _peak_rss_mib(server.pid)
    finally:
        server.stop()
    floor = crypto_floor(ca_pem, agents[0], work / "floor")
    floor_total = sum(floor.values())
    transport_ms = 0.0
    if args.transport_agents:
        transport_ms = transport_floor(agents[: args.transport_agents], args, work / "noop") * 1000
    ok = [lat for lat, status in results if status == "ok"]
    errors = [status for _, status in results if status != "ok"]
    lat = sorted(ok) or [0.0]
    figures = {
        "agents": len(results),
        "concurrency": args.concurrency,
        "errors": len(errors),
        "attestations_per_s": round(len(ok) / elapsed, 1),
        "p50_s": round(statistics.median(lat), 3),
        "p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
        "server_cpu_ms_per_attestation": round(cpu / max(1, len(ok)) * 1000, 3),
        "crypto_floor_ms": round(floor_total * 1000, 3),
        "cpu_to_floor_ratio": round((cpu / max(1, len(ok))) / floor_total, 2),
        "server_peak_rss_mib": round(rss, 1),
        "transport_floor_ms": round(transport_ms, 3),
        "transport_to_floor_ratio": round(transport_ms / 1000 / floor_total, 2),
        "wall_s": round(elapsed, 1),
    }
    print(
        f"bench/attest: {figures['agents']} agents, {args.concurrency} concurrent streams, {figures['errors']} errors"
    )
    print(f"  throughput          {figures['attestations_per_s']} attestations/s   (target >= 300)")
    print(f"  latency             p50 {figures['p50_s']} s, p99 {figures['p99_s']} s   (target p99 <= 2 s)")
    print(f"  server CPU          {figures['server_cpu_ms_per_attestation']} ms per attestation")
    print(f"  crypto floor        {figures['crypto_floor_ms']} ms per attestation:")
    for name, seconds in floor.items():
        print(f"                        {seconds * 1000:7.3f} ms  {name}")
    print(f"  CPU / floor         {figures['cpu_to_floor_ratio']}x   (target <= 3x)")
    if transport_ms:
        print(
            f"  transport floor     {transport_ms:.3f} ms per exchange with a no-op handler "
            f"({args.transport or 'wire'} transport + TLS alone) = {figures['transport_to_floor_ratio']}x the crypto floor"
        )
        print(
            f"  attestation logic   {figures['server_cpu_ms_per_attestation'] - transport_ms:.3f} ms "
            "per attestation above the transport floor"
        )
    print(f"  server peak RSS     {figures['server_peak_rss_mib']} MiB   (target <= 400 MiB)")
    if errors:
        print("  first errors: " + "; ".join(sorted(set(errors))[:5]))
    if args.json:
        print(json.dumps(figures))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
