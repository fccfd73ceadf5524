"""Measured-boot evidence for a join: a TPM2_Quote over the server's nonce, and the firmware's event log.

``Join.BeginJoin`` answers with a nonce, a PCR bank and the PCRs its pool checks
(:class:`QuoteRequest`). :func:`make_evidence` loads the AK the agent kept from its last
attestation (:mod:`agent.tpm.akblob`) under the SRK, quotes exactly those PCRs of that bank with
the nonce as ``qualifyingData``, flushes every object it loaded, and reads the TCG event log
(``/sys/kernel/security/tpm0/binary_bios_measurements``, bounded). The server replays the log,
checks that it is the one the quote covers, and compares it with the boot reference values of the
releases its pool accepts (docs/attestation.md, "Measured boot").

The request is the server's word, so it is checked before the TPM sees it: a known bank, PCRs
0..23 without duplicates, a nonce of 16..64 bytes (TPM2B_DATA holds at most 64).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from agent.errors import AkUnusableError, EventLogUnavailableError, RefusedForNowError
from agent.files import FileTooLargeError, read_bounded
from agent.tpm.akblob import AkBlob
from agent.tpm.attestor import TpmAttestor
from protocol import eventlog

log = logging.getLogger(__name__)

DEFAULT_EVENT_LOG = "/sys/kernel/security/tpm0/binary_bios_measurements"
BANKS = ("sha256", "sha384", "sha512")  # SHA-1 is never quoted: a SHA-1-only TPM cannot prove a boot
MIN_NONCE_BYTES = 16
MAX_NONCE_BYTES = 64


@dataclass(frozen=True)
class QuoteRequest:
    """What BeginJoin asked for: quote ``pcrs`` of ``bank`` over ``nonce``."""

    nonce: bytes
    bank: str
    pcrs: tuple[int, ...]
    expires_at: int = 0

    def problem(self) -> str:
        """Why the server's request cannot be quoted ("" when it can)."""
        if self.bank not in BANKS:
            return f"the server asks for a quote of the {self.bank[:16]!r} bank; this agent quotes {', '.join(BANKS)}"
        if (
            not self.pcrs
            or len(set(self.pcrs)) != len(self.pcrs)
            or any(not 0 <= p <= 23 for p in self.pcrs)
        ):
            return f"the server's PCR selection {list(self.pcrs)[:30]} is not a set of PCRs 0..23"
        if not MIN_NONCE_BYTES <= len(self.nonce) <= MAX_NONCE_BYTES:
            return (
                f"the server's nonce has {len(self.nonce)} bytes, not {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES}"
            )
        return ""


@dataclass(frozen=True)
class QuoteEvidence:
    """What RequestJoin carries for a pool that checks measured boot."""

    nonce: bytes
    quote: bytes  # TPMS_ATTEST
    signature: bytes  # TPMT_SIGNATURE
    event_log: bytes


def read_event_log(path: Path) -> bytes:
    """The firmware's event log, at most :data:`protocol.eventlog.MAX_LOG_BYTES` (what the server takes)."""
    try:
        raw = read_bounded(path, eventlog.MAX_LOG_BYTES)
    except FileNotFoundError as exc:
        raise EventLogUnavailableError(
            f"there is no TPM event log at {path}",
            hint="the pool checks measured boot: boot with UEFI and a TPM 2.0 enabled in the firmware, and mount "
            "securityfs (mount -t securityfs securityfs /sys/kernel/security); or set event_log",
        ) from exc
    except FileTooLargeError as exc:
        raise EventLogUnavailableError(
            f"the event log {path} is not one the server takes: {exc}",
            hint=f"the server reads at most {eventlog.MAX_LOG_BYTES} bytes; check event_log names the firmware's log",
        ) from exc
    except OSError as exc:
        raise EventLogUnavailableError(
            f"cannot read the event log {path}: {exc.strerror}",
            hint="the agent must run as root to read securityfs; check event_log",
        ) from exc
    if not raw:
        raise EventLogUnavailableError(
            f"the event log {path} is empty",
            hint="the firmware logged no measurements: enable the TPM in its setup",
        )
    return raw


def make_evidence(
    tcti: str, ak: AkBlob | None, request: QuoteRequest, event_log_path: Path
) -> QuoteEvidence:
    """Quote what ``request`` names with the kept AK and read the event log; the TPM is left as found."""
    problem = request.problem()
    if problem:
        raise RefusedForNowError(
            problem, hint="the server and the agent may be of different versions; the agent retries"
        )
    if ak is None:
        raise AkUnusableError(
            "no AK is kept from the last attestation (an older agent attested)",
            hint="the agent attests again, which makes and keeps a new AK",
        )
    # The log first: a node without one cannot prove its boot, and the TPM is not touched for nothing.
    raw_log = read_event_log(event_log_path)
    with TpmAttestor(tcti) as tpm:
        tpm.load_ak(ak)
        quote, signature = tpm.quote(request.bank, request.pcrs, request.nonce)
    log.info(
        "quoted PCRs %s of the %s bank over the server's nonce; event log of %d bytes",
        ",".join(str(p) for p in request.pcrs),
        request.bank,
        len(raw_log),
    )
    return QuoteEvidence(nonce=request.nonce, quote=quote, signature=signature, event_log=raw_log)
