"""Turn TSS return codes into messages that name a cause and a fix."""

from __future__ import annotations

# Format-one codes carry a parameter/handle/session number in bits 8..11; mask it off.
_FMT1 = 0x080
_KNOWN: dict[int, tuple[str, str]] = {
    0x0902: (
        "the TPM is out of object memory (TPM_RC_OBJECT_MEMORY)",
        "use the kernel resource manager (/dev/tpmrm0) or restart the process that leaks handles",
    ),
    0x0903: (
        "the TPM is out of session memory (TPM_RC_SESSION_MEMORY)",
        "use /dev/tpmrm0 so stale sessions are flushed",
    ),
    0x0101: ("the TPM has not been started (TPM_RC_INITIALIZE)", "run TPM2_Startup (tpm2_startup -c)"),
    0x018B: ("the NV index or handle does not exist (TPM_RC_HANDLE)", "check the handle"),
    0x009A: ("the TPM is in failure mode or lockout", "check the TPM's state in the firmware set-up"),
    0x0921: ("the TPM is in dictionary-attack lockout (TPM_RC_LOCKOUT)", "wait or reset the DA counter"),
    0x0149: ("the endorsement hierarchy is disabled (TPM_RC_HIERARCHY)", "enable it in the firmware set-up"),
}
_FMT1_KNOWN: dict[int, tuple[str, str]] = {
    0x0F: (
        "an authorisation failed (TPM_RC_AUTH_FAIL/BAD_AUTH)",
        "the endorsement or owner hierarchy has a password; nodeagent needs them empty",
    ),
    0x22: (
        "an authorisation failed (TPM_RC_BAD_AUTH)",
        "the endorsement or owner hierarchy has a password; nodeagent needs them empty",
    ),
    0x1D: (
        "the policy check failed (TPM_RC_POLICY_FAIL)",
        "the EK is not the TCG default EK; check the EK template in NV",
    ),
    0x1F: (
        "the credential integrity check failed (TPM_RC_INTEGRITY)",
        "the server built the challenge for another EK or AK: the EK certificate may not match this TPM's EK",
    ),
    0x15: (
        "the credential could not be decrypted (TPM_RC_SIZE/VALUE)",
        "the server's challenge does not match this TPM's EK",
    ),
}


def describe(rc: int) -> tuple[str, str]:
    """Return (cause, fix) for a TSS2 return code."""
    base = rc & 0xFFFF
    layer = rc >> 16
    if layer == 0 and base in _KNOWN:
        return _KNOWN[base]
    if layer == 0 and base & _FMT1:
        err = base & 0x3F
        if err in _FMT1_KNOWN:
            return _FMT1_KNOWN[err]
    if layer in (0x0A, 0x0B):
        return (
            f"the TCTI could not reach the TPM (rc 0x{rc:08x})",
            "check that the TPM device or simulator named by --tcti exists and is accessible",
        )
    return (f"TPM error rc 0x{rc:08x}", "see the agent log; run `tpm2_rc_decode` on the code")
