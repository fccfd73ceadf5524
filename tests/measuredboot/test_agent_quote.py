"""The agent's quote, made with its own code against real swtpm TPMs, checked by protocol.quote and tpm2_checkquote.

The AK is the one the server credential-activated: the agent keeps its blobs (0600) when the
attestation succeeds, a re-attestation replaces them, and every quote loads it under the SRK
and leaves no object in a TPM that has no resource manager.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.attest_client import ServerTarget, attest
from agent.errors import Action, AkUnusableError, EventLogUnavailableError, RefusedForNowError
from agent.svid import SvidStore
from agent.tpm.akblob import AkBlob
from agent.tpm.quote import QuoteRequest, make_evidence
from protocol.quote import QuoteError, verify_quote
from tests.support.measuredboot import fixture_boot
from tests.support.server import ServerThread
from tests.support.swtpm import Swtpm, transient_and_session_counts

pytestmark = [pytest.mark.swtpm, pytest.mark.subprocess]
PCRS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
TPM2_TOOLS = ("tpm2_pcrread", "tpm2_checkquote")


def _tools() -> None:
    missing = [t for t in TPM2_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: apt-get install tpm2-tools (scripts/ensure-deps.sh installs it)"
        )


def _attested(tpm: Swtpm, srv: ServerThread, state: Path) -> str:
    svid = attest(ServerTarget.parse(srv.address, "example.org", srv.bundle), tcti=tpm.tcti, state_dir=state)
    return svid.spiffe_id


def _pcrread(tcti: str, pcrs: tuple[int, ...], out: Path, fmt: str = "values") -> dict[int, bytes]:
    """The PCR values read by tpm2-tools (not the agent's code), and their file for tpm2_checkquote.

    tpm2_checkquote (5.4) reads more than 8 PCRs only from the ``serialized`` format."""
    sel = "sha256:" + ",".join(str(p) for p in pcrs)
    env = {**os.environ, "TPM2TOOLS_TCTI": tcti}
    subprocess.run(
        ["tpm2_pcrread", "-F", fmt, "-o", str(out), sel],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    if fmt != "values":
        return {}
    raw = out.read_bytes()
    assert len(raw) == 32 * len(pcrs)
    return {p: raw[32 * i : 32 * (i + 1)] for i, p in enumerate(pcrs)}


def _checkquote(ak: AkBlob, quote: bytes, signature: bytes, nonce: bytes, pcrs_file: Path) -> int:
    d = pcrs_file.parent
    (d / "ak.pub").write_bytes(ak.public)
    (d / "quote.msg").write_bytes(quote)
    (d / "quote.sig").write_bytes(signature)
    argv = ["tpm2_checkquote", "-u", str(d / "ak.pub"), "-m", str(d / "quote.msg"), "-s", str(d / "quote.sig"),
            "-q", nonce.hex(), "-g", "sha256", "-f", str(pcrs_file)]  # fmt: skip
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode


def test_the_attested_ak_is_kept_private_and_is_the_one_the_server_recorded(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    state = tmp_path / "state"
    agent_id = _attested(tpm, srv, state)
    store = SvidStore(state)
    ak = store.load_ak()
    assert ak is not None
    assert stat.S_IMODE(store.ak_path.stat().st_mode) == 0o600
    assert ak.private.hex() not in repr(ak)
    assert srv.app.store is not None
    record = srv.app.store.get_agent(agent_id)
    assert record is not None and record.ak_public == ak.tpmt_public.hex()

    # A re-attestation makes a new AK, records it, and replaces the kept one; the old one signs for nobody.
    _attested(tpm, srv, state)
    again = store.load_ak()
    record = srv.app.store.get_agent(agent_id)
    assert again is not None and again.public != ak.public
    assert record is not None and record.ak_public == again.tpmt_public.hex()
    assert not list(state.glob("*.new")), "no pending files are left behind"
    log = tmp_path / "log"
    log.write_bytes(fixture_boot().log())
    nonce = os.urandom(32)
    old = make_evidence(tpm.tcti, ak, QuoteRequest(nonce, "sha256", PCRS), log)
    values = _pcrread(tpm.tcti, PCRS, tmp_path / "pcrs")
    with pytest.raises(QuoteError) as refused:
        verify_quote(ak_public=bytes.fromhex(record.ak_public), quote=old.quote, signature=old.signature,
                     nonce=nonce, pcr_values=values, bank="sha256")  # fmt: skip
    assert refused.value.reason == "quote_signature"


def test_a_quote_by_the_agent_verifies_with_protocol_quote_and_tpm2_checkquote(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    _tools()
    tpm = tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    state = tmp_path / "state"
    _attested(tpm, srv, state)
    boot = fixture_boot()
    boot.extend_into(tpm.tcti)
    log = tmp_path / "binary_bios_measurements"
    log.write_bytes(boot.log())
    ak = SvidStore(state).load_ak()
    assert ak is not None
    nonce = os.urandom(32)
    evidence = make_evidence(tpm.tcti, ak, QuoteRequest(nonce, "sha256", PCRS), log)
    assert evidence.event_log == log.read_bytes() and evidence.nonce == nonce
    assert transient_and_session_counts(tpm.tcti) == (0, 0), "the quote left objects or sessions in the TPM"

    values = _pcrread(tpm.tcti, PCRS, tmp_path / "pcrs.bin")
    verified = verify_quote(ak_public=ak.tpmt_public, quote=evidence.quote, signature=evidence.signature,
                            nonce=nonce, pcr_values=values, bank="sha256")  # fmt: skip
    assert verified.pcrs == values
    _pcrread(tpm.tcti, PCRS, tmp_path / "pcrs.serialized", fmt="serialized")
    assert _checkquote(ak, evidence.quote, evidence.signature, nonce, tmp_path / "pcrs.serialized") == 0
    # The oracle is live: another nonce, or other PCR values (PCR 4 extended once more), and it refuses.
    assert (
        _checkquote(ak, evidence.quote, evidence.signature, os.urandom(32), tmp_path / "pcrs.serialized")
        != 0
    )
    fixture_boot().with_event(0, fixture_boot().events[0]).extend_into(tpm.tcti)  # every PCR moves on
    (tmp_path / "later").mkdir()
    _pcrread(tpm.tcti, PCRS, tmp_path / "later" / "pcrs.serialized", fmt="serialized")
    assert (
        _checkquote(ak, evidence.quote, evidence.signature, nonce, tmp_path / "later" / "pcrs.serialized")
        != 0
    )


def test_the_kept_ak_does_not_load_into_another_tpm(
    tpms: Callable[..., Swtpm], servers: Callable[..., ServerThread], ek_ca_dir: Path, tmp_path: Path
) -> None:
    one, other = tpms(), tpms()
    srv = servers(ek_trust={"ca_dir": str(ek_ca_dir)})
    _attested(one, srv, tmp_path / "state")
    ak = SvidStore(tmp_path / "state").load_ak()
    log = tmp_path / "log"
    log.write_bytes(fixture_boot().log())
    with pytest.raises(AkUnusableError) as refused:
        make_evidence(other.tcti, ak, QuoteRequest(os.urandom(32), "sha256", PCRS), log)
    assert refused.value.action is Action.ATTEST_AGAIN
    assert transient_and_session_counts(other.tcti) == (0, 0)


def test_requests_and_logs_the_agent_will_not_quote(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(fixture_boot().log())
    blob = AkBlob(public=b"\x00\x00", private=b"\x00\x00")  # never reaches a TPM
    for request in (
        QuoteRequest(os.urandom(32), "sha1", PCRS),  # SHA-1 proves nothing
        QuoteRequest(os.urandom(32), "sha256", ()),
        QuoteRequest(os.urandom(32), "sha256", (4, 4)),
        QuoteRequest(os.urandom(32), "sha256", (24,)),
        QuoteRequest(b"short", "sha256", PCRS),
        QuoteRequest(os.urandom(65), "sha256", PCRS),
    ):
        with pytest.raises(RefusedForNowError):
            make_evidence("swtpm:host=127.0.0.1,port=1", blob, request, log)
    with pytest.raises(AkUnusableError):
        make_evidence("swtpm:host=127.0.0.1,port=1", None, QuoteRequest(os.urandom(32), "sha256", PCRS), log)
    for bad in (tmp_path / "absent", tmp_path):
        with pytest.raises(EventLogUnavailableError) as no_log:
            make_evidence(
                "swtpm:host=127.0.0.1,port=1", blob, QuoteRequest(os.urandom(32), "sha256", PCRS), bad
            )
        assert no_log.value.permanent and no_log.value.hint
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(EventLogUnavailableError):
        make_evidence("swtpm:host=127.0.0.1,port=1", blob, QuoteRequest(os.urandom(32), "sha256", PCRS),
                      tmp_path / "empty")  # fmt: skip


def test_the_quotes_signer_is_the_aks_qualified_name_as_its_creation_certification_says(
    tpms: Callable[..., Swtpm], tmp_path: Path
) -> None:
    """A real TPM names the signer by its qualified name (nameAlg || H(QN(SRK) || Name)), not by its Name.

    protocol.quote compared it with the Name, so every real quote was refused; the AK's own
    TPM2_CertifyCreation (sent at attestation, signed by the AK) carries the same qualified name.
    """
    from agent.tpm.attestor import TpmAttestor
    from protocol import tpm2

    tpm = tpms(cert=False)
    with TpmAttestor(tpm.tcti) as t:
        t.read_ek()
        params = t.make_ak()
        assert t.ak_blob is not None
        ak = t.ak_blob
    log = tmp_path / "log"
    log.write_bytes(fixture_boot().log())
    nonce = os.urandom(32)
    evidence = make_evidence(tpm.tcti, ak, QuoteRequest(nonce, "sha256", (0, 4)), log)
    values = _pcrread(tpm.tcti, (0, 4), tmp_path / "pcrs")
    signer = tpm2.parse_attest(evidence.quote).qualified_signer
    assert signer != ak.name()
    qualified = tpm2.parse_attest(params.create_attestation).qualified_signer
    assert signer == qualified
    common = {"ak_public": ak.tpmt_public, "quote": evidence.quote, "signature": evidence.signature, "nonce": nonce,
              "pcr_values": values, "bank": "sha256"}  # fmt: skip
    verify_quote(**common)  # type: ignore[arg-type]
    verify_quote(**common, ak_qualified_name=qualified)  # type: ignore[arg-type]
    with pytest.raises(QuoteError) as refused:
        verify_quote(**common, ak_qualified_name=ak.name())  # type: ignore[arg-type]
    assert refused.value.reason == "quote_signature"
