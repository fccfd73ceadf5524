"""Tier 2: real swtpm TPMs attest to a real server over TLS on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.attest_client import ServerTarget, attest, attest_async
from agent.errors import (
    AttestationRefusedError,
    ServerNotTrustedError,
    ServerUnavailableError,
    TpmUnavailableError,
)
from agent.svid import SvidStore
from agent.tpm.attestor import TpmAttestor
from tests.support.server import ServerThread
from tests.support.simtpm import SimCa
from tests.support.swtpm import Swtpm, provision_ecc_ek_cert, transient_and_session_counts

pytestmark = pytest.mark.swtpm
ROOT = Path(__file__).resolve().parents[2]


def _ek_hash_from_nv(tcti: str) -> str:
    """The EK hash computed independently of the agent: SHA-256 of the NV certificate's SubjectPublicKeyInfo."""
    from tpm2_pytss import ESAPI
    from tpm2_pytss.utils import NVReadEK

    os.environ.setdefault("TSS2_LOG", "all+NONE")
    ctx = ESAPI(tcti)
    try:
        raw = NVReadEK(ctx)(0x01C00002)
    finally:
        ctx.close()
    cert = x509.load_der_x509_certificate(raw[: 4 + int.from_bytes(raw[2:4], "big")])
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).hexdigest()


def _target(
    srv: ServerThread, trust_domain: str = "example.org", bundle: bytes | None = None
) -> ServerTarget:
    return ServerTarget.parse(srv.address, trust_domain, bundle if bundle is not None else srv.bundle)


def test_ca_mode_rsa_ek(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    state = tmp_path / "agent"
    svid = attest(_target(srv), tcti=tpm.tcti, state_dir=state)

    expected = _ek_hash_from_nv(tpm.tcti)
    assert svid.spiffe_id == f"spiffe://example.org/spire/agent/tpm/{expected}"
    assert svid.reattestable is True
    # The SVID chains to the bundle, names the agent, and its key is the one kept 0600 on disk.
    cert = x509.load_pem_x509_certificate((state / "svid.pem").read_bytes())
    ca = x509.load_pem_x509_certificate(srv.bundle)
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [svid.spiffe_id]
    assert stat.S_IMODE((state / "svid.key").stat().st_mode) == 0o600
    key = serialization.load_pem_private_key((state / "svid.key").read_bytes(), None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    # Stored, audited, selector as SPIRE names it.
    assert srv.app.store is not None
    rec = srv.app.store.get_agent(svid.spiffe_id)
    assert rec is not None and rec.ek_hash == expected and rec.selectors == (f"tpm:pub_hash:{expected}",)
    assert rec.svid_serial == str(cert.serial_number)
    lines = srv.audit_lines()
    assert (
        lines[-1]["result"] == "ok"
        and lines[-1]["spiffe_id"] == svid.spiffe_id
        and lines[-1]["ek_trust"] == "ca"
    )


def test_hash_mode_accepts_listed_and_refuses_unlisted(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tpm = tpms(cert=False)
    hashes = tmp_path / "hashes"
    hashes.mkdir()
    srv = servers(ek_trust={"hash_dir": str(hashes)})
    with pytest.raises(AttestationRefusedError) as refused:
        attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "a1")
    assert refused.value.code == "PERMISSION_DENIED"
    assert "hash" in refused.value.message.lower() or "trust" in refused.value.message.lower()
    assert not (tmp_path / "a1" / "svid.pem").exists()
    assert srv.app.store is not None and srv.app.store.count_agents() == 0

    with TpmAttestor(tpm.tcti) as t:
        ek_hash = hashlib.sha256(t.read_ek().spki_der).hexdigest()
    (hashes / ek_hash).touch()
    svid = attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "a2")
    assert svid.spiffe_id.endswith(ek_hash)
    assert srv.audit_lines()[-1]["ek_trust"] == "hash"


def test_ecc_p256_ek(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tpm = tpms()
    ca = SimCa.create("Test ECC EK CA")
    from cryptography.hazmat.primitives.serialization import load_der_public_key

    spki = provision_ecc_ek_cert(tpm.tcti, lambda der: ca.issue_ek_cert(load_der_public_key(der)))  # type: ignore[arg-type]
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    (ca_dir / "ecc-ca.pem").write_bytes(ca.pem())
    srv = servers(ek_trust={"ca_dir": str(ca_dir)})
    svid = attest(
        _target(srv), tcti=tpm.tcti, state_dir=tmp_path / "agent", ek_alg="ecc", require_ek_cert=True
    )
    assert svid.spiffe_id.endswith(hashlib.sha256(spki).hexdigest())


def test_two_tpms_two_ids_and_restart_keeps_id(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    a, b = tpms(), tpms()
    id_a = attest(_target(srv), tcti=a.tcti, state_dir=tmp_path / "a").spiffe_id
    id_b = attest(_target(srv), tcti=b.tcti, state_dir=tmp_path / "b").spiffe_id
    assert id_a != id_b
    a.stop()
    again = tpms(state=a.state_dir)  # same TPM state, new process and port
    assert attest(_target(srv), tcti=again.tcti, state_dir=tmp_path / "a").spiffe_id == id_a
    assert srv.app.store is not None
    rec = srv.app.store.get_agent(id_a)
    assert rec is not None and rec.last_attested_at >= rec.first_attested_at


def test_twenty_agents_at_once(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    machines = [tpms() for _ in range(20)]
    barrier = threading.Barrier(len(machines))
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int, tpm: Swtpm) -> None:
        try:
            barrier.wait()
            results[i] = attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / f"agent{i}").spiffe_id
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(machines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(set(results.values())) == 20
    assert srv.app.store is not None and srv.app.store.count_agents() == 20


def test_fifty_attestations_leave_nothing_in_the_tpm(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    target = _target(srv)
    store = SvidStore(tmp_path / "agent")

    async def many() -> set[str]:
        ids = set()
        for _ in range(50):  # past swtpm's 3 transient slots many times over; a leak shows in the counts
            with TpmAttestor(tpm.tcti) as t:
                ids.add((await attest_async(target, t, store)).spiffe_id)
        return ids

    assert len(asyncio.run(many())) == 1
    # swtpm has no resource manager: anything not flushed would still be there.
    assert transient_and_session_counts(tpm.tcti) == (0, 0)
    assert sum(1 for line in srv.audit_lines() if line["result"] == "ok") == 50


def test_tpm_errors_are_explained(tmp_path: Path) -> None:
    with pytest.raises(TpmUnavailableError) as err, TpmAttestor("swtpm:host=127.0.0.1,port=1"):
        pass
    assert "cannot open the TPM" in err.value.message and "--tcti" in err.value.hint


def test_untrusted_server_and_wrong_trust_domain(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    other = servers(ek_trust={"ca_dir": str(ek_ca_dir)})  # another trust domain's CA (same name, other key)
    with pytest.raises(ServerNotTrustedError, match="not trusted"):
        attest(_target(srv, bundle=other.bundle), tcti=tpm.tcti, state_dir=tmp_path / "x")
    with pytest.raises(ServerNotTrustedError, match=r"expected spiffe://other\.test/spire/server"):
        attest(_target(srv, trust_domain="other.test"), tcti=tpm.tcti, state_dir=tmp_path / "y")
    assert not (tmp_path / "x" / "svid.key").exists() and not (tmp_path / "x" / "svid.key.new").exists()
    # Nothing reached the attestation service.
    assert srv.audit_lines() == []


def test_server_down(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    target = _target(srv)
    srv.stop()
    with pytest.raises(ServerUnavailableError, match="cannot reach the server"):
        attest(target, tcti=tpm.tcti, state_dir=tmp_path / "z")


def test_cli_attest_prints_id_and_expiry(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(srv.bundle)
    base = [
        sys.executable,
        "-m",
        "agent.cli",
        "attest",
        "--server",
        srv.address,
        "--trust-domain",
        "example.org",
        "--bundle",
        str(bundle),
        "--tcti",
        tpm.tcti,
        "--state-dir",
        str(tmp_path / "st"),
    ]
    ok = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    assert f"SPIFFE ID: spiffe://example.org/spire/agent/tpm/{_ek_hash_from_nv(tpm.tcti)}" in ok.stdout
    assert "SVID expires: " in ok.stdout

    no_tpm = subprocess.run(
        [*base[:-4], "--tcti", "swtpm:host=127.0.0.1,port=1", "--state-dir", str(tmp_path / "st2")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert no_tpm.returncode == 3 and "cannot open the TPM" in no_tpm.stderr and "hint:" in no_tpm.stderr

    refused_hash = subprocess.run(
        [*base[:-2], "--state-dir", str(tmp_path / "st3"), "--print-ek-hash"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert refused_hash.returncode == 0 and refused_hash.stdout.strip() == _ek_hash_from_nv(tpm.tcti)


def test_health_and_metrics(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    import urllib.request

    from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    from agent.tls import SpiffeTLSContext
    from protocol.spiffe import server_id

    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    attest(_target(srv), tcti=tpms().tcti, state_dir=tmp_path / "a")

    async def check() -> int:
        ch = Channel(
            "127.0.0.1", srv.app.ports.attest, ssl=SpiffeTLSContext(srv.bundle, [server_id("example.org")])
        )
        try:
            async with ch.request(
                "/grpc.health.v1.Health/Check",
                Cardinality.UNARY_UNARY,
                HealthCheckRequest,
                HealthCheckResponse,
            ) as stream:
                await stream.send_message(
                    HealthCheckRequest(service="spire.api.server.agent.v1.Agent"), end=True
                )
                reply = await stream.recv_message()
            assert reply is not None
            return int(reply.status)
        finally:
            ch.close()

    assert asyncio.run(check()) == HealthCheckResponse.SERVING
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{srv.app.ports.metrics}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert 'nodeserver_attestations_total{reason="attested",result="ok"} 1.0' in body
    assert "nodeserver_attestation_duration_seconds_bucket" in body
    assert "nodeserver_agents_known" in body


def test_get_bundle_like_a_spire_agent(servers: Callable[..., ServerThread], tmp_path: Path) -> None:
    """After AttestAgent a SPIRE agent fetches the bundle on the same connection."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    from agent.tls import SpiffeTLSContext
    from protocol._gen.spire.api.server.bundle.v1 import bundle_pb2
    from protocol._gen.spire.api.types import bundle_pb2 as types_bundle_pb2
    from protocol.spiffe import server_id

    hashes = tmp_path / "h"
    hashes.mkdir()
    srv = servers(ek_trust={"hash_dir": str(hashes)})

    async def fetch() -> types_bundle_pb2.Bundle:
        ch = Channel(
            "127.0.0.1", srv.app.ports.attest, ssl=SpiffeTLSContext(srv.bundle, [server_id("example.org")])
        )
        try:
            async with ch.request(
                "/spire.api.server.bundle.v1.Bundle/GetBundle",
                Cardinality.UNARY_UNARY,
                bundle_pb2.GetBundleRequest,
                types_bundle_pb2.Bundle,
            ) as stream:
                await stream.send_message(bundle_pb2.GetBundleRequest(), end=True)
                reply = await stream.recv_message()
                assert reply is not None
                return reply
        finally:
            ch.close()

    bundle = asyncio.run(fetch())
    assert bundle.trust_domain == "example.org"
    assert [x509.load_der_x509_certificate(a.asn1) for a in bundle.x509_authorities] == [
        x509.load_pem_x509_certificate(srv.bundle)
    ]
