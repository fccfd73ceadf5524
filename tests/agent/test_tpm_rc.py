"""agent.tpm.rc: TSS return codes named by the TSS's own decoder, with advice that fits the code.

The TSS (Tss2_RC_Decode through tpm2-pytss) is the oracle for what a code is; a real swtpm that
was never sent TPM2_Startup is the peer that answers TPM_RC_INITIALIZE.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tpm2_pytss import TSS2_Exception

from agent.errors import TpmError, TpmUnusableError
from agent.tpm import rc
from agent.tpm.attestor import TpmAttestor
from tests.support.swtpm import missing_tools


def test_initialize_advises_startup() -> None:
    advice = rc.advise(0x100)
    assert advice.name == "TPM_RC_INITIALIZE" and "tpm2_startup" in advice.fix and advice.permanent
    assert str(TSS2_Exception(0x100)) in advice.cause  # the TSS's own words


def test_failure_is_failure_mode_not_initialize() -> None:
    """libtpms answers 0x101 (TPM_RC_FAILURE) in failure mode; it used to be named TPM_RC_INITIALIZE."""
    advice = rc.advise(0x101)
    assert advice.name == "TPM_RC_FAILURE" and "failure mode" in advice.cause
    assert "INITIALIZE" not in advice.cause and "tpm2_startup" not in advice.fix
    assert "reboot" in advice.fix and advice.permanent
    assert str(TSS2_Exception(0x101)) in advice.cause


@pytest.mark.parametrize(
    ("code", "name", "number"),
    [
        (0x98E, "TPM_RC_AUTH_FAIL", 0x08E),  # session 1
        (0x1D5, "TPM_RC_SIZE", 0x095),  # parameter 1
        (0x18B, "TPM_RC_HANDLE", 0x08B),  # handle 1
        (0x28B, "TPM_RC_HANDLE", 0x08B),  # handle 2
        (0x9A2, "TPM_RC_BAD_AUTH", 0x0A2),  # session 1
        (0x085, "TPM_RC_HIERARCHY", 0x085),
    ],
)
def test_format_one_codes_mask_the_handle_parameter_and_session(code: int, name: str, number: int) -> None:
    advice = rc.advise(code)
    assert advice.name == name and advice.error == number
    assert str(TSS2_Exception(code)) in advice.cause
    exc = TSS2_Exception(code)
    assert exc.fmt1 and exc.error == number  # the TSS's own split agrees with ours


def test_warnings_are_worth_a_retry_and_lockout_says_wait() -> None:
    lockout = rc.advise(0x921)
    assert lockout.name == "TPM_RC_LOCKOUT" and "wait" in lockout.fix and not lockout.permanent
    for code in (0x908, 0x90A, 0x922, 0x902):
        assert not rc.advise(code).permanent, hex(code)


def test_tcti_layer_codes() -> None:
    advice = rc.advise(0xA000A)  # TSS2_TCTI_RC_IO_ERROR
    assert advice.name == "TCTI" and "--tcti" in advice.fix and not advice.permanent
    assert str(TSS2_Exception(0xA000A)) in advice.cause


def test_every_named_code_is_the_tss_code_of_that_name() -> None:
    """Our names come from the same numbers as tpm2-pytss's TPM2_RC constants."""
    from tpm2_pytss.constants import TPM2_RC

    for table in (rc._FMT0, rc._FMT1):
        for number, advice in table.items():
            assert getattr(TPM2_RC, advice.name.removeprefix("TPM_RC_")) == number, advice.name


# -- a real TPM that was never started ------------------------------------------------------


@pytest.fixture
def unstarted_swtpm(tmp_path: Path) -> Iterator[str]:
    missing = missing_tools()
    if missing:
        pytest.fail(f"swtpm tools missing: {', '.join(missing)}; install swtpm and swtpm-tools")
    for _ in range(20):
        port = random.randrange(20000, 60000, 2)
        proc = subprocess.Popen(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={tmp_path}",
             "--server", f"type=tcp,port={port},bindaddr=127.0.0.1",
             "--ctrl", f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
             "--flags", "not-need-init"],  # no startup-clear: TPM2_Startup is never sent
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            try:
                yield f"swtpm:host=127.0.0.1,port={port}"
            finally:
                proc.terminate()
                proc.wait(10)
            return
    pytest.fail("swtpm did not start")


@pytest.mark.swtpm
@pytest.mark.subprocess
def test_a_tpm_that_was_never_started_says_tpm2_startup(unstarted_swtpm: str) -> None:
    with pytest.raises(TpmError) as err, TpmAttestor(unstarted_swtpm) as tpm:
        tpm.read_ek()
    assert isinstance(err.value, TpmUnusableError) and err.value.exit_code == 3
    assert "TPM_RC_INITIALIZE" in err.value.message and "tpm2_startup" in err.value.hint
