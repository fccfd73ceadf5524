"""A server with pools and a file token backend, and simulated agents that attest and join over mTLS."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.join_client import JoinGrant, request_join_async
from agent.svid import make_csr, new_key
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol.tpm_payload import decode_challenge, encode_attestation_data, encode_challenge_response
from tests.support.rawclient import params, run_stream
from tests.support.server import ServerThread, server_config
from tests.support.simtpm import SimCa, SimulatedTpm

# A CPU pool whose node checks only warn, so a report made on this (non-Kubernetes) machine passes.
CPU_POOL = {"preset": "cpu", "checks": {"warn": ["node.*"]}}
GPU_POOL = {"preset": "nvke", "gpu": {"model": "NVIDIA H200", "count": 8}}


def cluster_ca(path: Path) -> str:
    """Write a stand-in cluster CA certificate; return its kubeadm pin."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


@dataclass
class JoinEnv:
    srv: ServerThread
    ek_ca: SimCa
    tokens_dir: Path
    ca_hash: str
    base: Path

    @property
    def join_address(self) -> str:
        return f"127.0.0.1:{self.srv.app.ports.join}"


def join_config(
    base: Path, ek_ca: SimCa, *, pools: dict[str, Any] | None = None, **overrides: Any
) -> tuple[dict[str, Any], str]:
    (base / "ek-ca").mkdir(parents=True, exist_ok=True)
    (base / "ek-ca" / "sim.pem").write_bytes(ek_ca.pem())
    ca_hash = cluster_ca(base / "cluster-ca.pem")
    doc: dict[str, Any] = {
        "trust_domain": "example.org",
        "data_dir": str(base / "data"),
        "listen": "127.0.0.1:0",
        "join_listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "ek_trust": {"ca_dir": str(base / "ek-ca")},
        "cluster": {
            "api_server_endpoint": "10.0.0.10:6443",
            "ca_cert": str(base / "cluster-ca.pem"),
            "kubernetes_version": "v1.36.3",
        },
        "join": {"token_ttl": "15m"},
        "token_backend": {"type": "file", "directory": str(base / "tokens")},
        "pools": pools or {"cpu": {"profile": CPU_POOL}, "gpu": {"profile": GPU_POOL}},
    }
    doc.update(overrides)
    return doc, ca_hash


def start_join_env(base: Path, **overrides: Any) -> JoinEnv:
    ek_ca = SimCa.create()
    doc, ca_hash = join_config(base, ek_ca, **overrides)
    cfg = server_config(Path(doc.pop("data_dir")), **{k: v for k, v in doc.items() if k != "trust_domain"})
    srv = ServerThread(cfg).start()
    return JoinEnv(srv, ek_ca, base / "tokens", ca_hash, base)


@dataclass
class SimAgent:
    sim: SimulatedTpm
    cert: Path
    key: Path
    spiffe_id: str

    @property
    def node_name(self) -> str:
        """This machine's own node name (a name belongs to the first EK granted a token for it)."""
        return f"node-{self.sim.ek_hash[:12]}"


def attest_sim(srv: ServerThread, sim: SimulatedTpm, out: Path) -> SimAgent:
    """Attest a simulated TPM and keep its SVID and key as files (like the agent's state dir)."""
    return attest_sim_at(srv.address, srv.bundle, sim, out)


def attest_sim_at(address: str, bundle: bytes, sim: SimulatedTpm, out: Path) -> SimAgent:
    key = new_key()

    async def script(stream: Any) -> Any:
        await stream.send_message(params(encode_attestation_data(sim.attestation_data()), make_csr(key)))
        challenge = await stream.recv_message()
        secret = sim.activate(decode_challenge(challenge.challenge))
        await stream.send_message(
            agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
        )
        return await stream.recv_message()

    result = run_stream(address, bundle, script)
    out.mkdir(parents=True, exist_ok=True)
    chain = b"".join(
        x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
        for der in result.result.svid.cert_chain
    )
    (out / "svid.pem").write_bytes(chain)
    (out / "svid.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (out / "svid.key").chmod(0o600)
    svid = result.result.svid
    return SimAgent(
        sim, out / "svid.pem", out / "svid.key", f"spiffe://{svid.id.trust_domain}{svid.id.path}"
    )


@functools.lru_cache(maxsize=1)
def cpu_report() -> bytes:
    """A real verification report of this machine under the CPU test pool (it passes)."""
    from agent.checks import run_checks
    from protocol.policy import policy_from_mapping
    from protocol.report import canonical_json

    report = run_checks(policy_from_mapping({"name": "cpu", **CPU_POOL}))
    assert report.verdict.passed, report.verdict
    return canonical_json(report)


def join(
    env: JoinEnv,
    agent: SimAgent,
    *,
    pool: str = "cpu",
    node_name: str | None = None,
    report: bytes | None = None,
) -> JoinGrant:
    return join_at(env.join_address, env.srv.bundle, agent, pool=pool, node_name=node_name, report=report)


def join_at(
    address: str,
    bundle: bytes,
    agent: SimAgent,
    *,
    pool: str = "cpu",
    node_name: str | None = None,
    report: bytes | None = None,
) -> JoinGrant:
    node_name = node_name or agent.node_name
    return asyncio.run(
        request_join_async(
            address,
            trust_domain="example.org",
            bundle_pem=bundle,
            svid_cert=agent.cert,
            svid_key=agent.key,
            pool=pool,
            node_name=node_name,
            report=report if report is not None else cpu_report(),
            timeout=30,
        )
    )
