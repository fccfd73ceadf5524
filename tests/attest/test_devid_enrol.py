"""DevID enrolment against a real swtpm (UNIX socket) and nodeserver: what is issued, when, and what not.

nodeagent attests with its EK, then ``nodeagent devid enrol`` makes a DevID key under SPIRE's storage
key template and nodeserver's DevID CA certifies it; the files are what spire-agent's tpm_devid reads
(blobs without size prefixes), and the DevID then attests with ``tpm_devid`` (to nodeserver here; to a
stock spire-server in tests/peers/test_spire_devid.py). Refusals: no EK attestation first, a banned
machine, enrolment switched off.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.attest_client import ServerTarget, attest
from agent.devid_client import DevidFiles, attest_devid, enrol
from agent.errors import AttestationRefusedError, BannedError, RefusalError
from protocol import tpm2
from server.cli import main as nodeserver
from tests.support.server import ServerThread
from tests.support.swtpm import LocalCa, Swtpm, manufacture, transient_and_session_counts


@pytest.fixture
def unix_tpm(local_ca: LocalCa, tmp_path: Path) -> Iterator[Callable[[], Swtpm]]:
    started: list[Swtpm] = []

    def make() -> Swtpm:
        state = tmp_path / f"tpm{len(started)}"
        manufacture(state, local_ca)
        tpm = Swtpm(state, unix=True).start()
        started.append(tpm)
        return tpm

    yield make
    for t in started:
        t.stop()


def _target(srv: ServerThread) -> ServerTarget:
    return ServerTarget.parse(srv.address, "example.org", srv.bundle)


@pytest.mark.parametrize("alg", ["rsa", "ecc"])
def test_enrol_after_ek_attestation_then_attest_with_tpm_devid(
    servers: Callable[..., ServerThread],
    ek_ca_dir: Path,
    unix_tpm: Callable[[], Swtpm],
    tmp_path: Path,
    alg: str,
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    tpm = unix_tpm()
    tpm_svid = attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "state")
    srv.admit(tpm_svid.spiffe_id)  # DevIDs are issued to machines the broker admitted (devid.require_join)
    files = DevidFiles(tmp_path / "devid")
    done = enrol(_target(srv), tcti=tpm.tcti, files=files, alg=alg)

    # The files spire-agent's tpm_devid reads: TPMT_PUBLIC and TPM2B_PRIVATE contents, no size prefixes.
    pub = tpm2.parse_public(files.pub_path.read_bytes())
    assert pub.type == (tpm2.Alg.RSA if alg == "rsa" else tpm2.Alg.ECC)
    assert int(pub.attributes) == 0x00040072
    priv = files.priv_path.read_bytes()
    assert int.from_bytes(priv[:2], "big") == 32  # the integrity HMAC's size: the blob starts inside
    assert stat.S_IMODE(files.priv_path.stat().st_mode) == 0o600
    leaf, *rest = x509.load_pem_x509_certificates(files.cert_path.read_bytes())
    assert rest == []
    ca = x509.load_pem_x509_certificate(files.ca_path.read_bytes())
    leaf.verify_directly_issued_by(ca)
    spki = leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert spki == tpm2.spki_der(pub)
    ek_hash = tpm_svid.spiffe_id.rsplit("/", 1)[1]
    assert leaf.subject.rfc4514_string() == f"CN={ek_hash},OU=ldevid,O=nodetrust"
    bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    # One audit line for the certificate, naming the machine and the identity tpm_devid will give.
    issued = [line for line in srv.audit_lines() if line["event"] == "devid"]
    assert len(issued) == 1 and issued[0]["result"] == "ok"
    assert issued[0]["devid_serial"] == str(leaf.serial_number)
    assert issued[0]["devid_agent_id"] == done.agent_id
    assert issued[0]["spiffe_id"] == tpm_svid.spiffe_id
    # The DevID CA key is private; nodeserver devid-ca prints the certificate.
    data_dir = srv.config.data_dir
    assert stat.S_IMODE((data_dir / "devid-ca.key").stat().st_mode) == 0o600

    svid = attest_devid(_target(srv), tcti=tpm.tcti, files=files, state_dir=tmp_path / "devid-svid")
    assert svid.spiffe_id == done.agent_id and svid.reattestable
    assert transient_and_session_counts(tpm.tcti) == (0, 0)  # the agent left nothing in the TPM


def test_devid_ca_command_prints_the_certificate(
    servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "trust_domain": "example.org",
                "data_dir": str(srv.config.data_dir),
                "ek_trust": {"ca_dir": str(ek_ca_dir)},
            }
        )
    )
    assert nodeserver(["devid-ca", "-c", str(config)]) == 0
    assert capsys.readouterr().out.encode() == (srv.config.data_dir / "devid-ca.pem").read_bytes()
    empty = tmp_path / "empty.yaml"
    empty.write_text(json.dumps({"trust_domain": "example.org", "data_dir": str(tmp_path / "nothing")}))
    assert nodeserver(["devid-ca", "-c", str(empty)]) == 1
    assert "no DevID CA" in capsys.readouterr().err


def test_enrol_without_ek_attestation_is_refused(
    servers: Callable[..., ServerThread], ek_ca_dir: Path, unix_tpm: Callable[[], Swtpm], tmp_path: Path
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    tpm = unix_tpm()
    with pytest.raises(RefusalError) as info:
        enrol(_target(srv), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid"))
    assert "has not attested" in str(info.value)
    lines = [line for line in srv.audit_lines() if line["event"] == "devid"]
    assert [(line["status"], line["reason"]) for line in lines] == [("PERMISSION_DENIED", "not_attested")]
    assert not (tmp_path / "devid").exists()


def test_enrol_of_a_machine_never_admitted_by_a_join_is_refused(
    servers: Callable[..., ServerThread], ek_ca_dir: Path, unix_tpm: Callable[[], Swtpm], tmp_path: Path
) -> None:
    """An EK-attested machine whose join was never granted (its checks or its boot refused) gets no DevID: it
    would otherwise take a workload identity from a stock SPIRE server that trusts the DevID CA."""
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    tpm = unix_tpm()
    svid = attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "state")
    with pytest.raises(AttestationRefusedError) as info:
        enrol(_target(srv), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid"))
    assert info.value.reason == "not_joined" and "join first" in info.value.hint
    lines = [line for line in srv.audit_lines() if line["event"] == "devid"]
    assert [(line["status"], line["reason"]) for line in lines] == [("PERMISSION_DENIED", "not_joined")]
    assert not (tmp_path / "devid").exists()
    # once the broker has granted it a join, the same machine is enrolled
    srv.admit(svid.spiffe_id)
    enrol(_target(srv), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid"))
    assert [line["reason"] for line in srv.audit_lines() if line["event"] == "devid"][-1] == "devid_issued"
    # a server told not to ask (devid.require_join: false) enrols any EK-attested machine
    lenient = servers(ek_trust={"ca_dir": str(ek_ca_dir)}, devid={"require_join": False})
    attest(_target(lenient), tcti=tpm.tcti, state_dir=tmp_path / "state2")
    enrol(_target(lenient), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid2"))


def test_enrol_of_a_banned_machine_is_refused(
    servers: Callable[..., ServerThread], ek_ca_dir: Path, unix_tpm: Callable[[], Swtpm], tmp_path: Path
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    tpm = unix_tpm()
    svid = attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "state")
    assert srv.app.store is not None
    srv.app.store.ban_agent(svid.spiffe_id)
    with pytest.raises(BannedError):
        enrol(_target(srv), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid"))
    assert [line["reason"] for line in srv.audit_lines() if line["event"] == "devid"] == ["banned"]


def test_enrolment_switched_off(
    servers: Callable[..., ServerThread], ek_ca_dir: Path, unix_tpm: Callable[[], Swtpm], tmp_path: Path
) -> None:
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)}, devid={"enrol": False})
    tpm = unix_tpm()
    attest(_target(srv), tcti=tpm.tcti, state_dir=tmp_path / "state")
    with pytest.raises((AttestationRefusedError, RefusalError)) as info:
        enrol(_target(srv), tcti=tpm.tcti, files=DevidFiles(tmp_path / "devid"))
    assert "not served" in str(info.value)
