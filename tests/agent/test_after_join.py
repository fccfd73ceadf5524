"""agent.after_join's parts: when DevID files are fit for spire-agent, and how systemctl's answers are read.

The whole stage (a real swtpm, a real nodeserver, the agent as a process) is in
tests/lifecycle/test_after_join.py; here the DevID files are made by the software DevID stand-in
(tests/support/simdevid.py) and systemctl is the double (tests/support/systemctl_double.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.after_join import start_unit
from agent.config import AgentConfig
from agent.devid_client import DevidFiles, DevidProblem, inspect
from agent.errors import ConfigError, UnitMissingError, UnitStartError
from tests.support.simdevid import DevidPki, SimDevidTpm
from tests.support.simtpm import SimCa
from tests.support.systemctl_double import calls, fail_while, install_systemctl_double

DAY = 86400.0


@pytest.fixture(scope="module")
def pki() -> DevidPki:
    return DevidPki.create()


@pytest.fixture(scope="module")
def sim(pki: DevidPki) -> SimDevidTpm:
    return SimDevidTpm.create(SimCa.create(), pki, alg="ecc")


def _files(tmp_path: Path, sim: SimDevidTpm, chain: tuple[bytes, ...] | None = None) -> DevidFiles:
    files = DevidFiles(tmp_path / "devid")
    files.directory.mkdir()
    files.pub_path.write_bytes(sim.devid_public())
    files.priv_path.write_bytes(b"\x00\x20" + bytes(32))  # spire-agent's problem, not inspect's
    pem = b"".join(
        x509.load_der_x509_certificate(d).public_bytes(serialization.Encoding.PEM)
        for d in (chain or sim.chain)
    )
    files.cert_path.write_bytes(pem)
    return files


def _expiry(sim: SimDevidTpm) -> float:
    return x509.load_der_x509_certificate(sim.chain[0]).not_valid_after_utc.timestamp()


def test_a_fit_devid_is_valid_and_named_as_spire_names_it(tmp_path: Path, sim: SimDevidTpm) -> None:
    files = _files(tmp_path, sim)
    now = _expiry(sim) - 100 * DAY
    check = inspect(files, trust_domain="example.org", now=now, renew_before_s=30 * DAY)
    assert check.valid and check.problem is None
    sha1 = hashlib.sha1(sim.chain[0], usedforsecurity=False).hexdigest()
    assert check.agent_id == f"spiffe://example.org/spire/agent/tpm_devid/{sha1}"
    assert check.expires_at == int(_expiry(sim))


@pytest.mark.parametrize(("left_days", "valid"), [(31, True), (30, False), (1, False), (-5, False)])
def test_expiring_within_the_margin_is_not_fit(
    tmp_path: Path, sim: SimDevidTpm, left_days: float, valid: bool
) -> None:
    files = _files(tmp_path, sim)
    check = inspect(
        files, trust_domain="example.org", now=_expiry(sim) - left_days * DAY, renew_before_s=30 * DAY
    )
    assert check.valid is valid
    if not valid:
        assert check.problem is DevidProblem.EXPIRING and check.agent_id  # still named, for the log
        assert ("has expired" in check.detail) == (left_days < 0)


@pytest.mark.parametrize("missing", ["devid.crt.pem", "devid.priv.blob", "devid.pub.blob"])
def test_a_missing_file_is_not_fit(tmp_path: Path, sim: SimDevidTpm, missing: str) -> None:
    files = _files(tmp_path, sim)
    (files.directory / missing).unlink()
    check = inspect(files, trust_domain="example.org", now=0, renew_before_s=0)
    assert check.problem is DevidProblem.MISSING and missing in check.detail
    assert inspect(DevidFiles(tmp_path / "nowhere"), trust_domain="", now=0, renew_before_s=0).problem is (
        DevidProblem.MISSING
    )


@pytest.mark.parametrize(
    ("name", "data"),
    [("devid.crt.pem", b"not a certificate\n"), ("devid.pub.blob", b"\x00\x23\x00"),
     ("devid.crt.pem", b"x" * (65 * 1024))],
    ids=["no-pem", "bad-public-area", "too-large"],
)  # fmt: skip
def test_an_unreadable_file_is_not_fit(tmp_path: Path, sim: SimDevidTpm, name: str, data: bytes) -> None:
    files = _files(tmp_path, sim)
    (files.directory / name).write_bytes(data)
    check = inspect(files, trust_domain="example.org", now=0, renew_before_s=0)
    assert check.problem is DevidProblem.UNREADABLE, check


def test_a_certificate_for_another_key_is_not_fit(tmp_path: Path, sim: SimDevidTpm, pki: DevidPki) -> None:
    other = SimDevidTpm.create(SimCa.create(), pki, alg="ecc")
    files = _files(tmp_path, sim, chain=other.chain)
    check = inspect(files, trust_domain="example.org", now=0, renew_before_s=0)
    assert check.problem is DevidProblem.KEY_MISMATCH


def test_devid_dir_defaults_under_the_state_folder() -> None:
    assert AgentConfig(state_dir="/var/lib/x").devid_path == Path("/var/lib/x/devid")
    assert AgentConfig(devid_dir="/srv/devid").devid_path == Path("/srv/devid")
    assert not AgentConfig().after_join_wanted
    assert AgentConfig(devid_enrol=True).after_join_wanted
    assert AgentConfig(spire_agent_unit="spire-agent.service").after_join_wanted


# -- systemctl, through agent.proc.run ------------------------------------------------------------------


@pytest.fixture
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    record = tmp_path / "calls.jsonl"
    bin_dir = install_systemctl_double(tmp_path / "bin", record, ("spire-agent.service",))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return record


@pytest.mark.subprocess
def test_start_and_restart_never_block(systemctl: Path) -> None:
    start_unit("spire-agent.service")
    start_unit("spire-agent.service", restart=True)
    assert calls(systemctl) == [
        ["start", "--no-block", "spire-agent.service"],
        ["restart", "--no-block", "spire-agent.service"],
    ]


@pytest.mark.subprocess
def test_a_unit_systemd_does_not_have_is_a_configuration_error(systemctl: Path) -> None:
    with pytest.raises(UnitMissingError) as info:
        start_unit("nope.service")
    assert isinstance(info.value, ConfigError) and info.value.permanent and info.value.exit_code == 2
    assert "spire_agent_unit" in info.value.hint


@pytest.mark.subprocess
def test_systemd_unreachable_is_transient(systemctl: Path) -> None:
    fail_while(systemctl, True)
    with pytest.raises(UnitStartError) as info:
        start_unit("spire-agent.service")
    assert (
        not info.value.permanent and info.value.exit_code == 16 and info.value.reason == "unit_start_failed"
    )


@pytest.mark.subprocess
def test_no_systemctl_at_all_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UnitMissingError, match="not installed or not on PATH"):
        start_unit("spire-agent.service")


def test_the_unit_setting_refuses_what_is_not_a_service_name(tmp_path: Path) -> None:
    from agent.config import load_config

    for bad in ("-H host.service", "spire-agent", "a b.service", "../x.service"):
        with pytest.raises(ConfigError, match="spire_agent_unit"):
            load_config(config_dir=tmp_path, cmdline_path=None, env={"NODEAGENT_SPIRE_AGENT_UNIT": bad})
    config, _ = load_config(config_dir=tmp_path, cmdline_path=None, env={"NODEAGENT_SPIRE_AGENT_UNIT": ""})
    assert config.spire_agent_unit == ""


def test_status_shows_the_devid_of_a_joined_node(tmp_path: Path) -> None:
    from agent.state import AfterJoin, AfterJoinStep, State, StateStore, Step
    from agent.status import status_doc, status_lines

    store = StateStore(tmp_path)
    expires = int(dt.datetime(2031, 1, 2, tzinfo=dt.UTC).timestamp())
    state = State(step=Step.JOINED)
    state.after_join = AfterJoin(AfterJoinStep.DONE, devid_id="spiffe://example.org/spire/agent/tpm_devid/ab",
                                 devid_expires_at=expires, spire_agent_unit="spire-agent.service",
                                 spire_agent_started_at=1_900_000_000.0, done_at=1_900_000_001.0)  # fmt: skip
    store.save(state)
    store.mark_joined()
    doc = status_doc(tmp_path, now=1_900_000_000)
    assert doc["devid"] == {
        "spiffe_id": "spiffe://example.org/spire/agent/tpm_devid/ab",
        "expires_at": expires,
        "expires": "2031-01-02T00:00:00Z",
        "expired": False,
        "enrolled": None,
    }
    assert (
        doc["after_join"]["done"] is True and doc["after_join"]["spire_agent_unit"] == "spire-agent.service"
    )
    lines = status_lines(tmp_path)
    assert "DevID (SPIRE tpm_devid): spiffe://example.org/spire/agent/tpm_devid/ab" in lines
    assert any(line.startswith("DevID expires: 2031-01-02 00:00:00Z") for line in lines)
    assert "after the join: done" in lines
