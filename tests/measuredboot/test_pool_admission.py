"""A nodeserver pool that checks measured boot, and agents on real swtpm TPMs joining it with the agent's own code.

Each machine is a swtpm whose PCRs were extended with a synthesised boot (tests.support.measuredboot:
OVMF-like firmware events, the boot loader in PCR 4, GRUB's commands in PCR 8 and the files it
read in PCR 9), the same boot's TCG event log as the firmware would hand the OS, and the AK the
agent kept from its attestation. The pool lists the boot-measurements.json of one release.
The admitted boot gets a token; every other case is refused with its own reason, one audit line,
and no token.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.attest_client import ServerTarget, attest
from agent.errors import RefusalError
from agent.join_client import JoinGrant, begin_join_async, request_join_async
from agent.svid import SvidStore
from agent.tpm.quote import QuoteEvidence, QuoteRequest, make_evidence
from tests.support.joinenv import CPU_POOL, JoinEnv, cpu_report, start_join_env
from tests.support.measuredboot import Boot, fixture_boot, grub_cmd, grub_file, pool_measured_boot
from tests.support.swtpm import LocalCa, Swtpm, manufacture, require_tools

pytestmark = pytest.mark.swtpm


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JoinEnv, LocalCa]]:
    """One server: pool ``mb`` admits the release of :func:`fixture_boot`; ``other`` admits another release only."""
    base = tmp_path_factory.mktemp("mb-server")
    ref = base / "rel-1" / "boot-measurements.json"
    ref.parent.mkdir()
    sha = fixture_boot().write_reference(ref, image="rel-1")
    other_ref = base / "rel-2" / "boot-measurements.json"
    other_ref.parent.mkdir()
    other_sha = fixture_boot(kernel=b"kernel-6.12").write_reference(other_ref, image="rel-2")
    env = start_join_env(
        base,
        pools={
            "mb": {"profile": CPU_POOL, "measured_boot": pool_measured_boot(("rel-1", ref, sha))},
            "other": {
                "profile": CPU_POOL,
                "measured_boot": pool_measured_boot(("rel-2", other_ref, other_sha)),
            },
        },
    )
    require_tools()
    ca = LocalCa(tmp_path_factory.mktemp("mb-ekca"))
    manufacture(tmp_path_factory.mktemp("mb-warm"), ca)
    ca.install_into(env.base / "ek-ca")
    env.srv.app.ek_trust.reload()  # type: ignore[union-attr]
    yield env, ca
    env.srv.stop()


@dataclass
class Machine:
    env: JoinEnv
    tpm: Swtpm
    state: Path
    log: Path
    name: str

    @property
    def svids(self) -> SvidStore:
        return SvidStore(self.state)

    def begin(self, pool: str = "mb") -> QuoteRequest:
        asked = asyncio.run(
            begin_join_async(self.env.join_address, trust_domain="example.org", bundle_pem=self.env.srv.bundle,
                             svid_cert=self.svids.cert_path, svid_key=self.svids.key_path, pool=pool)
        )  # fmt: skip
        assert asked is not None, "the pool checks measured boot: BeginJoin must name PCRs"
        return asked

    def evidence(self, asked: QuoteRequest) -> QuoteEvidence:
        return make_evidence(self.tpm.tcti, self.svids.load_ak(), asked, self.log)

    def join(self, evidence: QuoteEvidence | None, pool: str = "mb") -> JoinGrant:
        return asyncio.run(
            request_join_async(self.env.join_address, trust_domain="example.org", bundle_pem=self.env.srv.bundle,
                               svid_cert=self.svids.cert_path, svid_key=self.svids.key_path, pool=pool,
                               node_name=self.name, report=cpu_report(), evidence=evidence)
        )  # fmt: skip

    def refused(self, evidence: QuoteEvidence | None, pool: str = "mb") -> RefusalError:
        before = len(self.env.srv.audit_lines())
        with pytest.raises(RefusalError) as refused:
            self.join(evidence, pool)
        lines = self.env.srv.audit_lines()[before:]
        assert len(lines) == 1, lines
        assert lines[0]["result"] != "ok" and lines[0]["reason"] == refused.value.reason
        assert "token_id" not in lines[0], "a refused join is never granted a token"
        return refused.value


@pytest.fixture
def machines(site: tuple[JoinEnv, LocalCa], tmp_path: Path) -> Iterator[Callable[..., Machine]]:
    env, ca = site
    started: list[Swtpm] = []

    def make(boot: Boot | None = None, *, log: bytes | None = None, bank: str = "sha256") -> Machine:
        n = len(started)
        state_dir = tmp_path / f"tpm{n}"
        if bank == "sha256":
            manufacture(state_dir, ca)
        else:
            _manufacture_sha1(state_dir, ca)
        tpm = Swtpm(state_dir).start()
        started.append(tpm)
        boot = boot or fixture_boot()
        boot.extend_into(tpm.tcti, bank=bank)
        log_path = tmp_path / f"log{n}"
        log_path.write_bytes(log if log is not None else boot.log(bank=bank))
        state = tmp_path / f"state{n}"
        attest(
            ServerTarget.parse(env.srv.address, "example.org", env.srv.bundle),
            tcti=tpm.tcti,
            state_dir=state,
        )
        return Machine(env, tpm, state, log_path, f"mb-node-{os.urandom(4).hex()}")

    yield make
    for tpm in started:
        tpm.stop()


def _manufacture_sha1(state_dir: Path, ca: LocalCa) -> None:
    import subprocess

    state_dir.mkdir(parents=True)
    argv = ["swtpm_setup", "--tpm2", "--tpmstate", str(state_dir), "--createek", "--decryption", "--overwrite",
            "--pcr-banks", "sha1", "--create-ek-cert", "--lock-nvram", "--config", str(ca.setup_config)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _token_files(env: JoinEnv) -> set[str]:
    return {p.name for p in env.tokens_dir.glob("*")} if env.tokens_dir.exists() else set()


def test_the_release_the_pool_lists_is_admitted(machines: Callable[..., Machine]) -> None:
    m = machines()
    asked = m.begin()
    assert asked.bank == "sha256" and set(asked.pcrs) == {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}
    grant = m.join(m.evidence(asked))
    assert grant.token
    line = m.env.srv.audit_lines()[-1]
    assert line["result"] == "ok" and line["release"] == "rel-1"
    assert line["checked_pcrs"] == [4, 8, 9] and line["unchecked_pcrs"] == [0, 1, 2, 3, 5, 6, 7]


def test_an_edited_event_log_does_not_replay_to_the_quote(machines: Callable[..., Machine]) -> None:
    boot = fixture_boot()
    kernel = boot.find(9, "/vmlinuz")
    # The TPM measured another kernel; the log claims the release's.
    measured = boot.with_event(kernel, grub_file("/vmlinuz", b"a kernel the attacker built"))
    m = machines(measured, log=boot.log())
    tokens = _token_files(m.env)
    assert m.refused(m.evidence(m.begin())).reason == "eventlog_replay"
    assert _token_files(m.env) == tokens


def _cmdline(b: Boot) -> Boot:
    return b.with_event(
        b.find(8, "kernel_cmdline"), grub_cmd("kernel_cmdline: /vmlinuz root=UUID=1234 ro init=/bin/sh")
    )


def _initrd(b: Boot) -> Boot:
    return b.with_event(b.find(9, "/initrd.img"), grub_file("/initrd.img", b"an initrd with a backdoor"))


def _grub_cfg(b: Boot) -> Boot:
    return b.with_event(
        b.find(9, "boot/grub/grub.cfg"), grub_file("(hd0,gpt2)/boot/grub/grub.cfg", b"linux /x\n")
    )


@pytest.mark.parametrize(
    ("pcr", "change"),
    [(8, _cmdline), (9, _initrd), (9, _grub_cfg)],
    ids=["command-line", "initrd", "grub-config"],
)
def test_a_changed_boot_is_refused_naming_the_pcr(
    machines: Callable[..., Machine], pcr: int, change: Callable[[Boot], Boot]
) -> None:
    m = machines(change(fixture_boot()))  # an honest log of a boot that is not the release's
    refused = m.refused(m.evidence(m.begin()))
    assert refused.reason == "boot_not_accepted"
    assert f"PCR {pcr}:" in refused.message and "rel-1" in refused.message


def test_a_release_the_pool_does_not_list_is_refused(machines: Callable[..., Machine]) -> None:
    m = machines()
    refused = m.refused(m.evidence(m.begin("other")), pool="other")
    assert (
        refused.reason == "boot_not_accepted" and "rel-2" in refused.message and "PCR 9:" in refused.message
    )


def test_a_used_nonce_and_a_replayed_join_are_refused(machines: Callable[..., Machine]) -> None:
    m = machines()
    evidence = m.evidence(m.begin())
    assert m.join(evidence).token
    assert m.refused(evidence).reason == "quote_nonce"  # the same quote, nonce and log again


def test_another_agents_nonce_is_refused(machines: Callable[..., Machine]) -> None:
    a, b = machines(), machines()
    theirs = b.begin()
    assert a.refused(a.evidence(theirs)).reason == "quote_nonce"


def test_a_quote_by_another_tpms_ak_is_refused(machines: Callable[..., Machine]) -> None:
    a, b = machines(), machines()
    asked = a.begin()
    by_b = make_evidence(b.tpm.tcti, b.svids.load_ak(), asked, b.log)  # B's TPM and AK, over A's nonce
    assert a.refused(by_b).reason == "quote_signature"


def test_a_sha1_only_tpm_is_refused(machines: Callable[..., Machine]) -> None:
    m = machines(bank="sha1")
    assert m.refused(m.evidence(m.begin())).reason == "quote_bank"


def test_a_selection_smaller_than_the_pools_is_refused(machines: Callable[..., Machine]) -> None:
    m = machines()
    asked = m.begin()
    fewer = QuoteRequest(asked.nonce, asked.bank, tuple(p for p in asked.pcrs if p != 9))
    assert m.refused(m.evidence(fewer)).reason == "quote_selection"


def test_no_quote_at_all_is_refused(machines: Callable[..., Machine]) -> None:
    m = machines()
    m.begin()
    assert m.refused(None).reason == "quote_missing"
