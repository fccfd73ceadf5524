"""TSS2 return codes: the TSS's own decoding, and advice that fits the code.

The text that names a code comes from the TSS itself (``Tss2_RC_Decode``, through
tpm2-pytss), so the agent never mislabels one. The advice comes from the code's
structure, as TPM 2.0 Part 2 §6.6 lays it out:

* bits 16..23 are the layer (0 the TPM, 7 ESAPI, 8 SAPI, 9 marshalling, 10 the TCTI,
  11 the resource manager, 12 TPM codes passed on by the resource manager);
* for a TPM code, bit 7 set is a *format-one* code: the error is bits 0..5 plus 0x080,
  and bits 8..11 say which handle, parameter or session it was about (masked off here);
* otherwise bit 8 (0x100) marks a TPM 2.0 code, bit 11 (0x800) a warning, and the error
  is bits 0..6 (a code without bit 8 is a TPM 1.2 answer).

``permanent`` advice means a person must act first (the TPM is in failure mode, was
never started, has a disabled hierarchy or a password): retrying cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass

TPM_LAYER = 0
FAPI_LAYER = 6
POLICY_LAYER = 13
ESAPI_LAYER, SYS_LAYER, MU_LAYER = 7, 8, 9
TCTI_LAYER, RESMGR_LAYER, RESMGR_TPM_LAYER = 10, 11, 12
FMT1 = 0x080
VER1 = 0x100
WARN = 0x900
HANDLE = FMT1 + 0x00B  # TPM_RC_HANDLE


@dataclass(frozen=True)
class _Advice:
    name: str
    cause: str
    fix: str
    permanent: bool = False


_USE_TPMRM = (
    "use the kernel resource manager (/dev/tpmrm0), which flushes stale objects, "
    "or stop the process that leaks TPM handles"
)
_BUSY = "the TPM is busy for a moment; the agent retries"
_WRONG_KEY = (
    "the server's challenge does not match this TPM's EK and AK (the EK certificate may be another TPM's)"
)
_ALGORITHM = "this TPM does not support the EK or AK algorithm or size: try the other ek_alg (rsa or ecc)"
_HIERARCHY_AUTH = (
    "the endorsement or owner hierarchy has a password; nodeagent needs them empty "
    "(clear it with tpm2_changeauth, or the firmware's TPM clear)"
)

# Format-zero TPM 2.0 errors and warnings, by error number (bits 0..6 | VER1 | WARN).
_FMT0: dict[int, _Advice] = {
    VER1 + 0x000: _Advice(
        "TPM_RC_INITIALIZE",
        "the TPM has not been started",
        "the firmware did not send TPM2_Startup: run `tpm2_startup -c` once, or fix the firmware's TPM "
        "setting (swtpm: start it with --flags startup-clear)",
        permanent=True,
    ),
    VER1 + 0x001: _Advice(
        "TPM_RC_FAILURE",
        "the TPM is in failure mode and accepts no commands",
        "reboot the machine (only a reset leaves failure mode; `tpm2_gettestresult` shows why); if it "
        "persists, update the TPM firmware or replace the TPM",
        permanent=True,
    ),
    VER1 + 0x020: _Advice(
        "TPM_RC_DISABLED",
        "the command is disabled",
        "enable the TPM and its hierarchies in the firmware set-up",
        permanent=True,
    ),
    VER1 + 0x030: _Advice(
        "TPM_RC_REBOOT",
        "the TPM needs a reboot",
        "reboot the machine (TPM2_Shutdown, then TPM2_Startup)",
        True,
    ),
    VER1 + 0x053: _Advice(
        "TPM_RC_NEEDS_TEST", "the TPM has not self-tested a function", "run `tpm2_selftest --fulltest`"
    ),
    VER1 + 0x049: _Advice(
        "TPM_RC_NV_AUTHORIZATION", "the NV index needs an authorisation", "check the NV index's attributes"
    ),
    VER1 + 0x04A: _Advice(
        "TPM_RC_NV_UNINITIALIZED", "the NV index was never written", "re-provision the EK certificate"
    ),
    WARN + 0x001: _Advice("TPM_RC_CONTEXT_GAP", "the TPM's context counter is exhausted", _USE_TPMRM),
    WARN + 0x002: _Advice("TPM_RC_OBJECT_MEMORY", "the TPM is out of object memory", _USE_TPMRM),
    WARN + 0x003: _Advice("TPM_RC_SESSION_MEMORY", "the TPM is out of session memory", _USE_TPMRM),
    WARN + 0x004: _Advice("TPM_RC_MEMORY", "the TPM is out of memory", _USE_TPMRM),
    WARN + 0x005: _Advice("TPM_RC_SESSION_HANDLES", "the TPM has no session handle left", _USE_TPMRM),
    WARN + 0x006: _Advice("TPM_RC_OBJECT_HANDLES", "the TPM has no object handle left", _USE_TPMRM),
    WARN + 0x008: _Advice("TPM_RC_YIELDED", "the TPM yielded", _BUSY),
    WARN + 0x009: _Advice("TPM_RC_CANCELED", "the command was cancelled", _BUSY),
    WARN + 0x00A: _Advice("TPM_RC_TESTING", "the TPM is running its self-tests", _BUSY),
    WARN + 0x020: _Advice("TPM_RC_NV_RATE", "the TPM is rate-limiting NV writes", _BUSY),
    WARN + 0x021: _Advice(
        "TPM_RC_LOCKOUT",
        "the TPM is in dictionary-attack lockout",
        "wait for the lockout recovery time to pass, or clear it with the lockout authorisation "
        "(tpm2_dictionarylockout --clear-lockout); then find what sent wrong passwords",
    ),
    WARN + 0x022: _Advice("TPM_RC_RETRY", "the TPM could not start the command", _BUSY),
    WARN + 0x023: _Advice("TPM_RC_NV_UNAVAILABLE", "the TPM's NV is not available", _BUSY),
}
# Format-one errors, by error number (bits 0..5 | FMT1).
_FMT1: dict[int, _Advice] = {
    FMT1 + 0x001: _Advice(
        "TPM_RC_ASYMMETRIC", "the TPM does not support the asymmetric algorithm", _ALGORITHM, True
    ),
    FMT1 + 0x002: _Advice("TPM_RC_ATTRIBUTES", "an object has attributes the TPM refuses", _ALGORITHM, True),
    FMT1 + 0x004: _Advice("TPM_RC_VALUE", "a value is out of range", _WRONG_KEY),
    FMT1 + 0x005: _Advice(
        "TPM_RC_HIERARCHY",
        "a hierarchy is disabled",
        "enable the endorsement and storage hierarchies in the firmware set-up (or tpm2_hierarchycontrol)",
        permanent=True,
    ),
    FMT1 + 0x007: _Advice("TPM_RC_KEY_SIZE", "the TPM does not support the key size", _ALGORITHM, True),
    FMT1 + 0x00A: _Advice("TPM_RC_TYPE", "the TPM does not support the object type", _ALGORITHM, True),
    HANDLE: _Advice(
        "TPM_RC_HANDLE",
        "a handle does not exist in the TPM",
        "check the handle (tpm2_getcap handles-persistent)",
    ),
    FMT1 + 0x00E: _Advice(
        "TPM_RC_AUTH_FAIL", "an authorisation failed (the DA counter went up)", _HIERARCHY_AUTH, True
    ),
    FMT1 + 0x015: _Advice("TPM_RC_SIZE", "a structure has the wrong size", _WRONG_KEY),
    FMT1 + 0x01D: _Advice(
        "TPM_RC_POLICY_FAIL",
        "a policy check failed",
        "the EK is not the TCG default EK: check the EK template in NV",
    ),
    FMT1 + 0x01F: _Advice("TPM_RC_INTEGRITY", "the credential's integrity check failed", _WRONG_KEY),
    FMT1 + 0x022: _Advice("TPM_RC_BAD_AUTH", "an authorisation failed", _HIERARCHY_AUTH, True),
    FMT1 + 0x026: _Advice("TPM_RC_CURVE", "the TPM does not support the curve", _ALGORITHM, True),
}
_LAYER_ADVICE: dict[int, _Advice] = {
    TCTI_LAYER: _Advice(
        "TCTI",
        "the TCTI could not talk to the TPM",
        "check that the TPM device or simulator named by --tcti exists, is reachable and that this user may use it",
    ),
    RESMGR_LAYER: _Advice(
        "RESMGR",
        "the TPM resource manager failed",
        "check tpm2-abrmd (systemctl status tpm2-abrmd), or use the kernel's /dev/tpmrm0",
    ),
    ESAPI_LAYER: _Advice(
        "ESAPI", "the TSS (ESAPI) refused the call", "see the agent log; this may be a bug"
    ),
    SYS_LAYER: _Advice("SAPI", "the TSS (SAPI) refused the call", "see the agent log; this may be a bug"),
    FAPI_LAYER: _Advice("FAPI", "the TSS (FAPI) refused the call", "see the agent log; this may be a bug"),
    POLICY_LAYER: _Advice("POLICY", "the TSS policy engine refused the call", "see the agent log"),
    MU_LAYER: _Advice(
        "MU", "the TSS could not (un)marshal a structure", "see the agent log; this may be a bug"
    ),
}


@dataclass(frozen=True)
class RcAdvice:
    """What a return code means and what to do about it."""

    rc: int
    name: str  # our name for the code (TPM_RC_FAILURE, TCTI, ...), "" when unknown
    decoded: str  # the TSS's own text (Tss2_RC_Decode)
    cause: str  # for people: ours, then the TSS's text and the code
    fix: str
    permanent: bool  # a person must act before retrying can help

    @property
    def error(self) -> int:
        """The error number without the layer and the handle/parameter/session bits."""
        return error_number(self.rc)


def tss_decode(rc: int) -> str:
    """``Tss2_RC_Decode(rc)``, the TSS's own text for a code."""
    from tpm2_pytss.constants import TSS2_RC

    return str(TSS2_RC(rc).decode())


def error_number(rc: int) -> int:
    """The TPM error number of a TPM-layer code (format one: ``0x080 | bits 0..5``); else the base code."""
    layer, base = (rc >> 16) & 0xFF, rc & 0xFFFF
    if layer not in (TPM_LAYER, RESMGR_TPM_LAYER):
        return base
    if base & FMT1:
        return FMT1 | (base & 0x3F)
    return base & (WARN | 0x07F)


def advise(rc: int) -> RcAdvice:
    """Decode ``rc`` with the TSS and pick the advice for its class."""
    rc &= 0xFFFFFFFF
    decoded = tss_decode(rc)
    layer, base = (rc >> 16) & 0xFF, rc & 0xFFFF
    advice: _Advice | None = None
    if layer in (TPM_LAYER, RESMGR_TPM_LAYER):
        number = error_number(rc)
        if base & FMT1:
            advice = _FMT1.get(number)
        elif not base & VER1:
            advice = _Advice(
                "TPM 1.2",
                "the device answered like a TPM 1.2",
                "this agent needs a TPM 2.0: switch the TPM to 2.0 mode in the firmware set-up",
                permanent=True,
            )
        else:
            advice = _FMT0.get(number)
            if advice is None and base & WARN == WARN:
                advice = _Advice("", "the TPM answered with a warning", _BUSY)
    else:
        advice = _LAYER_ADVICE.get(layer)
    if advice is None:
        advice = _Advice(
            "",
            "the TPM or the TSS reported an error",
            "see the agent log; `tpm2_rc_decode` explains the code",
        )
    named = f"{advice.name}, " if advice.name and advice.name.startswith("TPM_RC_") else ""
    return RcAdvice(
        rc=rc,
        name=advice.name,
        decoded=decoded,
        cause=f"{advice.cause} ({named}rc 0x{rc:x}: {decoded})",
        fix=advice.fix,
        permanent=advice.permanent,
    )


def describe(rc: int) -> tuple[str, str]:
    """(cause, fix) for a TSS2 return code."""
    advice = advise(rc)
    return advice.cause, advice.fix
