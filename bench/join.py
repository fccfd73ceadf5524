"""Boot storm with joins: N simulated nodes attest and then ask for join credentials, C at a time.

Against a real ``nodeserver run`` on loopback with a CPU pool and the file token
backend, on SQLite (default) or PostgreSQL (``--store postgresql://...``). Each
node attests over TLS exactly as in bench/attest.py, then requests its join over
mutual TLS with the SVID it got, carrying a real verification report of this
machine (the server recomputes its verdict). Prints joins/s, p50/p99 of the whole
attest-and-join, and the ratio to an attest-only storm measured in the same run.

Target on the 2-core development machine: 2,000 nodes attest and join in under
60 s with SQLite.

Then, in the same run, the token backends on their own: ``--tokens`` bootstrap tokens minted and
revoked (``create`` then ``delete``), ``--token-concurrency`` at a time, through the ``file`` backend
and through the ``kubernetes`` backend against a real kube-apiserver v1.36.3 (the control plane of
tests/support/control_plane.py, built by ``make peers``; the identity and RBAC of
docs/join-backends.md). Prints tokens/s and p50/p99 of each call, and the ratio. ``--tokens 0`` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.attest import TRUST_DOMAIN, Prepared, _one, fan_out, prepare  # noqa: E402


async def _attest_and_join(  # noqa: PLR0917
    host: str, attest_port: int, join_port: int, bundle: bytes, agent: Prepared, report: bytes, work: Path
) -> tuple[float, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from agent.join_client import request_join_async

    start = time.monotonic()
    chain: list[bytes] = []
    _, status = await _one(host, attest_port, bundle, agent, chain)
    if status != "ok":
        return time.monotonic() - start, f"attest: {status}"
    d = Path(tempfile.mkdtemp(dir=work))
    (d / "svid.pem").write_bytes(
        b"".join(x509.load_der_x509_certificate(c).public_bytes(serialization.Encoding.PEM) for c in chain)
    )
    (d / "svid.key").write_bytes(agent.svid_key_pem)
    try:
        await request_join_async(
            f"{host}:{join_port}",
            trust_domain=TRUST_DOMAIN,
            bundle_pem=bundle,
            svid_cert=d / "svid.pem",
            svid_key=d / "svid.key",
            pool="cpu",
            node_name="node-" + d.name.lower().replace("_", "-").strip("-")[-20:],
            report=report,
        )
    except Exception as exc:  # every failure is counted and reported
        return time.monotonic() - start, f"join: {type(exc).__name__}: {exc}"
    return time.monotonic() - start, "ok"


def _client(args: tuple[str, int, int, bytes, list[Prepared], int, bytes, str, bool], queue: Any) -> None:
    host, attest_port, join_port, bundle, agents, concurrency, report, work, attest_only = args

    async def storm() -> list[tuple[float, str]]:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(a: Prepared) -> tuple[float, str]:
            async with sem:
                if attest_only:
                    return await _one(host, attest_port, bundle, a)
                return await _attest_and_join(host, attest_port, join_port, bundle, a, report, Path(work))

        return await asyncio.gather(*(guarded(a) for a in agents))

    queue.put(asyncio.run(storm()))


def _storm(  # noqa: PLR0917
    config: dict[str, Any],
    work: Path,
    agents: list[Prepared],
    concurrency: int,
    clients: int,
    report: bytes,
    *,
    attest_only: bool,
) -> tuple[float, list[tuple[float, str]]]:
    from tests.support.serverproc import ServerProcess

    server = ServerProcess(config, work / "config.yaml")
    try:
        attest_port, join_port, bundle = server.attest_port, server.join_port, server.bundle

        def client_args(i: int, queue: Any) -> tuple[Any, ...]:
            settings = ("127.0.0.1", attest_port, join_port, bundle, agents[i::clients],
                        max(1, concurrency // clients), report, str(work), attest_only)  # fmt: skip
            return (settings, queue)

        results, elapsed = fan_out(_client, clients, client_args)
        return elapsed, results
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--nodes", type=int, default=2000, help="simulated nodes (default 2000)")
    parser.add_argument("-c", "--concurrency", type=int, default=200, help="nodes in flight (default 200)")
    parser.add_argument("--clients", type=int, default=1, help="client processes (default 1)")
    parser.add_argument(
        "--store", default="", help="store DSN (default: SQLite); postgresql://... for PostgreSQL"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=500,
        help="tokens minted and revoked per backend (default 500; 0: skip)",
    )
    parser.add_argument(
        "--token-concurrency", type=int, default=8, help="backend calls in flight (default 8)"
    )
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="start a throw-away PostgreSQL (Debian packages) and use it as the store",
    )
    args = parser.parse_args()
    if args.postgres:
        from tests.store.helpers import make_cluster

        cluster = make_cluster("nodetrust-bench-pg")
        cluster.start()
        try:
            args.store = cluster.dsn(cluster.create_database())
            return _run(args)
        finally:
            cluster.destroy()
    return _run(args)


def _run(args: argparse.Namespace) -> int:

    from agent.checks import run_checks
    from protocol.policy import policy_from_mapping
    from protocol.report import canonical_json
    from tests.support.joinenv import CPU_POOL, cluster_ca

    ca_pem, agents = prepare(args.nodes)
    report = canonical_json(run_checks(policy_from_mapping({"name": "cpu", **CPU_POOL})))
    figures: dict[str, Any] = {}
    for attest_only in (True, False):
        work = Path(tempfile.mkdtemp(prefix="nodetrust-bench-join-"))
        (work / "ek-ca").mkdir()
        (work / "ek-ca" / "bench-ca.pem").write_bytes(ca_pem)
        config: dict[str, Any] = {
            "trust_domain": TRUST_DOMAIN,
            "data_dir": str(work / "data"),
            "listen": "127.0.0.1:0",
            "join_listen": "127.0.0.1:0",
            "metrics_listen": "off",
            "ek_trust": {"ca_dir": str(work / "ek-ca")},
            # Every simulated node comes from 127.0.0.1: lift the per-address limits.
            "attest_rate_per_ip": 0,
            "peer_max_inflight": 100_000,
            "cluster": {
                "api_server_endpoint": "10.0.0.10:6443",
                "ca_cert": str(work / "cluster-ca.pem"),
                "kubernetes_version": "v1.36.3",
            },
            "token_backend": {"type": "file", "directory": str(work / "tokens")},
            "pools": {"cpu": {"profile": CPU_POOL}},
        }
        cluster_ca(work / "cluster-ca.pem")
        if args.store:
            config["store"] = args.store
        elapsed, results = _storm(
            config, work, agents, args.concurrency, args.clients, report, attest_only=attest_only
        )
        ok = sorted(lat for lat, status in results if status == "ok")
        errors = [status for _, status in results if status != "ok"]
        key = "attest_only" if attest_only else "attest_and_join"
        figures[key] = {
            "per_s": round(len(ok) / elapsed, 1),
            "wall_s": round(elapsed, 1),
            "p50_s": round(statistics.median(ok), 3) if ok else None,
            "p99_s": round(ok[min(len(ok) - 1, int(len(ok) * 0.99))], 3) if ok else None,
            "errors": len(errors),
            "first_errors": sorted(set(errors))[:3],
        }
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    a, j = figures["attest_only"], figures["attest_and_join"]
    store = "PostgreSQL" if args.store.startswith("postgres") else "SQLite"
    print(f"bench/join: {args.nodes} nodes, {args.concurrency} in flight, store {store}")
    for label, f in (("attest only  ", a), ("attest + join", j)):
        print(
            f"  {label}     {f['per_s']}/s, all done in {f['wall_s']} s, "
            f"p50 {f['p50_s']} s, p99 {f['p99_s']} s, errors {f['errors']}"
        )
    ratio = round(j["per_s"] / a["per_s"], 2) if a["per_s"] else "n/a"
    print(f"  join / attest     {ratio} (throughput ratio)")
    met = "met" if j["wall_s"] < 60 and not j["errors"] else "NOT met"
    print(f"  target            {args.nodes} nodes attest and join in under 60 s: {met}")
    for key in ("attest_only", "attest_and_join"):
        if figures[key]["errors"]:
            print(f"  {key} errors: {figures[key]['first_errors']}")
    failed = bool(a["errors"] or j["errors"])
    if args.tokens > 0:
        failed = _token_backends(args.tokens, args.token_concurrency) or failed
    return 1 if failed else 0


def _mint_and_revoke(backend: Any, n: int, concurrency: int) -> dict[str, Any]:
    """``n`` tokens through ``backend.create`` then ``backend.delete``, ``concurrency`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from server.tokens.token import new_token

    tokens = [
        new_token(ttl_s=900, now=int(time.time()), extra_groups=("system:bootstrappers:nodetrust:bench",))
        for _ in range(n)
    ]

    def one(token: Any) -> tuple[float, float, str]:
        t0 = time.monotonic()
        try:
            backend.create(token)
            t1 = time.monotonic()
            backend.delete(token.token_id, "")
        except Exception as exc:  # every failure is counted and reported
            return 0.0, 0.0, f"{type(exc).__name__}: {exc}"
        return t1 - t0, time.monotonic() - t1, "ok"

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, tokens))
    elapsed = time.monotonic() - start
    ok = [(c, d) for c, d, status in results if status == "ok"]
    creates, deletes = sorted(c for c, _ in ok), sorted(d for _, d in ok)

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(len(values) * q))], 4) if values else None

    return {
        "per_s": round(len(ok) / elapsed, 1),
        "wall_s": round(elapsed, 1),
        "create_p50_s": pct(creates, 0.5),
        "create_p99_s": pct(creates, 0.99),
        "delete_p50_s": pct(deletes, 0.5),
        "delete_p99_s": pct(deletes, 0.99),
        "errors": sorted({status for _, _, status in results if status != "ok"})[:3],
        "error_count": sum(1 for _, _, status in results if status != "ok"),
    }


def _token_backends(n: int, concurrency: int) -> bool:
    """File and kubernetes backends, one after the other in this run; True if any call failed."""
    import shutil

    from server.tokens.filebackend import FileBackend
    from server.tokens.kubernetes import KubernetesBackend
    from tests.support.control_plane import ControlPlane
    from tests.support.kube_identities import service_account

    work = Path(tempfile.mkdtemp(prefix="nodetrust-bench-tokens-"))
    figures: dict[str, dict[str, Any]] = {}
    try:
        files = FileBackend(work / "tokens")
        files.check()  # creates the 0700 folder, as nodeserver run does at start
        figures["file"] = _mint_and_revoke(files, n, concurrency)
        with ControlPlane.start(work / "control-plane") as cp:
            print(
                f"bench/join: real control plane (kube-apiserver {cp.endpoint}) up in {cp.started_in_s:.1f} s"
            )
            who = service_account(cp, "nodeserver", work)
            backend = KubernetesBackend.from_kubeconfig(who.kubeconfig, timeout=30)
            backend.check()
            figures["kubernetes"] = _mint_and_revoke(backend, n, concurrency)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"bench/join: {n} tokens minted and revoked per backend, {concurrency} calls in flight")
    for name, f in figures.items():
        print(
            f"  {name:<10}  {f['per_s']} tokens/s (create+delete), all done in {f['wall_s']} s; "
            f"create p50 {f['create_p50_s']} s, p99 {f['create_p99_s']} s; "
            f"delete p50 {f['delete_p50_s']} s, p99 {f['delete_p99_s']} s; errors {f['error_count']}"
        )
        if f["errors"]:
            print(f"    first errors: {f['errors']}")
    file_rate, kube_rate = figures["file"]["per_s"], figures["kubernetes"]["per_s"]
    print(
        f"  kubernetes / file  {round(kube_rate / file_rate, 3) if file_rate else 'n/a'} (throughput ratio)"
    )
    return any(f["error_count"] for f in figures.values())


if __name__ == "__main__":
    sys.exit(main())
