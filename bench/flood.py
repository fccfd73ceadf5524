"""Floods: what the attestation port holds while a stranger attacks it (issue 11).

One real ``nodeserver run`` (started, like many distributions start services, with a soft
open-file limit of 1,024) and, in one run:

* a baseline: honest attestations one after another (a software TPM double each), their rate;
* a stream flood: one TLS connection opening 4,200 header-only streams;
* a connection flood: silent TCP connections that never start TLS (1,050 and 5,000);
* a PEM flood: payloads of repeated ``-----BEGIN A-----`` lines (62 KB), against the server's CPU;
* a logging flood: requests carrying a 900 KB attestor name, against the audit log's size.

For each it prints what the server held (its announced stream limit, the streams it refused, its
open files) and the honest rate during the flood as a ratio of the baseline, measured in this
run. The honest agents and the attacker share 127.0.0.1 here, so the per-address attestation rate
limit is lifted (a real attacker and real nodes have different addresses); the per-address
in-flight cap stays on.

    .venv/bin/python -m bench.flood [--honest 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ATTEST = "/spire.api.server.agent.v1.Agent/AttestAgent"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _honest_rate(address: str, bundle: bytes, sims: list[Any]) -> tuple[float, int]:
    """Sequential honest attestations: (attestations per second, failures)."""
    from tests.attest.test_hostile import _honest
    from tests.support.rawclient import RpcFailed

    failures = 0
    t0 = time.monotonic()
    for sim in sims:
        try:
            _honest(address, bundle, sim)
        except (RpcFailed, OSError, TimeoutError):
            failures += 1
    return len(sims) / (time.monotonic() - t0), failures


def _payload_flood(address: str, bundle: bytes, payload: bytes, count: int) -> list[str]:
    from agent.svid import make_csr, new_key
    from tests.support.rawclient import RpcFailed, params, run_stream

    csr = make_csr(new_key())
    reasons = []

    async def script(stream: Any) -> Any:
        await stream.send_message(params(payload, csr), end=True)
        return await stream.recv_message()

    for _ in range(count):
        try:
            run_stream(address, bundle, script)
            reasons.append("ok")
        except RpcFailed as failed:
            reasons.append(failed.reason or failed.status)
    return reasons


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int, default=40, help="honest attestations per phase")
    args = ap.parse_args()

    from tests.support.h2flood import StreamFlood, silent_connections
    from tests.support.serverproc import ServerProcess
    from tests.support.simtpm import SimCa, SimulatedTpm

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = Path(tempfile.mkdtemp(prefix="nodetrust-flood-"))
    ca = SimCa.create()
    (work / "ca").mkdir()
    (work / "ca" / "sim.pem").write_bytes(ca.pem())
    config = {
        "trust_domain": "example.org",
        "data_dir": str(work / "data"),
        "listen": "127.0.0.1:0",
        "metrics_listen": "off",
        "attest_rate_per_ip": 0,
        "ek_trust": {"ca_dir": str(work / "ca")},
    }
    server = ServerProcess(config, work / "server.json", nofile=1024, log=work / "server.log")
    address, bundle, pid = server.attest, server.bundle, server.pid
    sims = [SimulatedTpm.create(ca) for _ in range(args.honest)]
    figures: dict[str, Any] = {"open_file_limit_at_start": 1024}
    try:
        _honest_rate(address, bundle, sims[:10])  # warm up: the first attestations load code and caches
        base, fail = _honest_rate(address, bundle, sims)
        figures["baseline_att_per_s"] = round(base, 1)
        print(f"bench/flood: baseline {base:.1f} honest attestations/s ({fail} failed)")

        flood = StreamFlood("127.0.0.1", server.attest_port)
        flood.open_streams(4200, ATTEST)
        held = flood.read_for(1.0)
        rate, fail = _honest_rate(address, bundle, sims)
        flood.close()
        figures.update(
            stream_flood_limit=held.max_concurrent_streams,
            stream_flood_refused=len(held.refused) + len(held.reset),
            stream_flood_ratio=round(rate / base, 2),
            stream_flood_failures=fail,
        )
        print(
            f"  stream flood: 4,200 header-only streams on one connection; the server announced "
            f"{held.max_concurrent_streams} streams per connection and refused or reset "
            f"{len(held.refused) + len(held.reset)}; honest rate {rate:.1f}/s = {rate / base:.2f}x baseline, "
            f"{fail} failed"
        )

        for count in (1050, 5000):
            socks = silent_connections("127.0.0.1", server.attest_port, count)
            time.sleep(0.5)
            files = _open_files(pid)
            rate, fail = _honest_rate(address, bundle, sims)
            for s in socks:
                s.close()
            figures[f"silent_{count}_open_files"] = files
            figures[f"silent_{count}_ratio"] = round(rate / base, 2)
            figures[f"silent_{count}_failures"] = fail
            print(
                f"  connection flood: {len(socks)} silent TCP connections; server holds {files} open files; "
                f"honest rate {rate:.1f}/s = {rate / base:.2f}x baseline, {fail} failed"
            )

        time.sleep(1.0)
        import base64

        pem_flood = json.dumps(
            {"EK": base64.b64encode(b"-----BEGIN A-----\n" * 2500).decode(), "AK": {}}
        ).encode()  # a 62 KB payload, under the 64 KiB payload limit
        cpu0 = _cpu_s(pid)
        reasons = _payload_flood(address, bundle, pem_flood, 20)
        per_flood = (_cpu_s(pid) - cpu0) / 20
        cpu0 = _cpu_s(pid)
        _honest_rate(address, bundle, sims[:20])
        per_honest = (_cpu_s(pid) - cpu0) / 20
        figures.update(
            pem_flood_cpu_ms=round(per_flood * 1000, 2),
            honest_cpu_ms=round(per_honest * 1000, 2),
            pem_flood_reason=sorted(set(reasons)),
        )
        print(
            f"  PEM flood: a {len(pem_flood) / 1000:.0f} KB payload of repeated BEGIN lines costs "
            f"{per_flood * 1000:.2f} ms of server CPU "
            f"({sorted(set(reasons))}) = {per_flood / per_honest:.2f}x an honest attestation "
            f"({per_honest * 1000:.2f} ms)"
        )

        audit = work / "data" / "audit.jsonl"
        size0 = audit.stat().st_size
        huge_type = "x" * 900_000
        from agent.svid import make_csr, new_key
        from protocol.tpm_payload import encode_attestation_data
        from tests.support.rawclient import RpcFailed, params, run_stream

        payload = encode_attestation_data(sims[0].attestation_data())
        csr = make_csr(new_key())

        async def script(stream: Any) -> Any:
            await stream.send_message(params(payload, csr, attestor=huge_type), end=True)
            return await stream.recv_message()

        for _ in range(10):
            with contextlib.suppress(RpcFailed):
                run_stream(address, bundle, script)
        per_request = (audit.stat().st_size - size0) / 10
        figures["audit_bytes_per_900kb_request"] = round(per_request)
        print(f"  logging flood: a 900 KB attestor name writes {per_request:.0f} bytes of audit per request")
    finally:
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("bench/flood json: " + json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
