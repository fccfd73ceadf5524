"""The agent's error hierarchy and the exit statuses that follow from it.

Every expected failure is an :class:`AgentError` with a message that says what
failed and a ``hint`` that says what to do. The CLI prints both and exits with
the class's ``exit_code``; nothing else reaches the user as a traceback.

Permanence and the exit status are properties of the *class*, never of one
instance: ``permanent`` tells the lifecycle that retrying cannot help (the run
stops, and systemd does not restart it), and :data:`EXIT_STATUSES` is the one
table of what each exit status means. Each status is used by classes of one
permanence only, so ``RestartPreventExitStatus=`` in ``nodeagent.service`` can
list exactly the permanent ones (a test compares the unit with this table, and
docs/systemd.md shows it). ``action`` tells the lifecycle what to do *before*
the permanence decides (attest anew, ask for a new token).

Refusals by the server are built from its status and reason slug by
:mod:`agent.refusals`; their classes are here so that the table stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.kubeadm import KubeadmFailure


class Action(StrEnum):
    """What the lifecycle does with a failure, before its permanence decides."""

    STEP = "step"  # nothing special: a transient failure retries the step, a permanent one stops the run
    ATTEST_AGAIN = "attest_again"  # attest anew first (once a run), even while the SVID is valid
    NEW_TOKEN = "new_token"  # noqa: S105 - an action name, not a secret; ask the broker for a new token, then run kubeadm join again


@dataclass(frozen=True)
class ExitStatus:
    """One row of the exit status table."""

    code: int
    name: str  # a stable slug for fleet tooling (``nodeagent status --json`` ``exit_class``)
    permanent: bool
    meaning: str


# The one table. 0 and 1 are not error classes of their own: 0 is success, 1 anything unexpected.
EXIT_STATUSES: tuple[ExitStatus, ...] = (
    ExitStatus(0, "ok", False, "joined (or already joined), or the command succeeded"),
    ExitStatus(1, "unexpected", False, "an unexpected error, probably a bug: see the journal"),
    ExitStatus(2, "config", True, "the configuration or the command line is invalid"),
    ExitStatus(
        3,
        "tpm_unusable",
        True,
        "no TPM at the TCTI, no usable EK certificate, or a TPM that needs a person "
        "(failure mode, not started, disabled hierarchy, hierarchy password)",
    ),
    ExitStatus(
        4, "server_unreachable", False, "the attestation server or the join broker cannot be reached"
    ),
    ExitStatus(5, "server_not_trusted", True, "the server is not the one the bootstrap bundle names"),
    ExitStatus(
        6, "attestation_refused", True, "the server refused the attestation (EK trust, evidence, request)"
    ),
    ExitStatus(7, "checks_failing", False, "the node or GPU checks fail, or cannot run yet"),
    ExitStatus(8, "join_refused", True, "the broker refused to issue credentials (policy, pool, request)"),
    ExitStatus(9, "kubeadm_failed", False, "kubeadm join failed"),
    ExitStatus(
        10, "state_corrupt", True, "the state folder is unusable or holds a file this agent cannot read"
    ),
    ExitStatus(11, "banned", True, "an operator banned this node"),
    ExitStatus(12, "join_config_invalid", True, "the broker's answer cannot make a valid JoinConfiguration"),
    ExitStatus(
        13, "tpm_error", False, "a TPM command failed in a way that may pass (busy, lockout, memory)"
    ),
    ExitStatus(
        14, "refused_for_now", False, "the server refused for now: a limit, a timeout, or its own fault"
    ),
    ExitStatus(15, "not_attested", False, "the server does not know this node's identity: it attests again"),
    ExitStatus(
        16,
        "unit_start_failed",
        False,
        "systemd did not take the start of a unit the agent starts (the SPIRE agent, after the join)",
    ),
    ExitStatus(130, "interrupted", False, "interrupted (Ctrl-C)"),
)
EXIT_BY_CODE = {e.code: e for e in EXIT_STATUSES}


def exit_status(code: int) -> ExitStatus:
    """The table row of ``code``; an unknown code reads as ``unexpected``."""
    return EXIT_BY_CODE.get(code, EXIT_BY_CODE[1])


def permanent_exit_codes() -> list[int]:
    """What ``RestartPreventExitStatus=`` lists."""
    return [e.code for e in EXIT_STATUSES if e.permanent]


def exit_status_help() -> str:
    """The exit status table as plain text, for ``--help`` epilogs."""
    lines = ["exit statuses (permanent ones stop systemd's restarts):"]
    for e in EXIT_STATUSES:
        kind = "permanent" if e.permanent else "transient" if e.code else ""
        lines.append(f"  {e.code:>3}  {e.name:<20} {kind:<10} {e.meaning}")
    return "\n".join(lines)


class AgentError(Exception):
    """Base class. ``hint`` names the fix."""

    exit_code = 1
    permanent = False
    action = Action.STEP

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    @property
    def reason(self) -> str:
        """A stable slug for the failure: the server's reason for refusals, else the exit class."""
        return exit_status(self.exit_code).name


class ConfigError(AgentError):
    """The agent configuration (file, kernel command line, environment) is invalid."""

    exit_code = 2
    permanent = True


class PoolProfileError(ConfigError):
    """A pool profile is invalid: unknown keys, wrong types, bad values."""


class TpmError(AgentError):
    """A TPM command failed in a way that may pass on a retry (busy, lockout, out of memory)."""

    exit_code = 13


class TpmUnavailableError(TpmError):
    """No TPM at the configured TCTI."""

    exit_code = 3
    permanent = True


class TpmUnusableError(TpmError):
    """The TPM answers but needs a person first: failure mode, not started, a disabled hierarchy, a password."""

    exit_code = 3
    permanent = True


class AkUnusableError(TpmError):
    """The AK kept since the last attestation is missing or cannot be loaded (TPM cleared, another
    machine's state folder): the agent attests again, which makes and records a new one."""

    action = Action.ATTEST_AGAIN


class EventLogUnavailableError(TpmError):
    """The firmware's TCG event log cannot be read (no securityfs, no log, too large): no quote can prove the boot."""

    exit_code = 3
    permanent = True


class EkCertificateError(TpmError):
    """The EK certificate is missing or does not match the EK."""

    exit_code = 3
    permanent = True


class ServerUnavailableError(AgentError):
    """The server cannot be reached (transient)."""

    exit_code = 4


class ServerNotTrustedError(AgentError):
    """The server's certificate does not chain to the bootstrap bundle or has the wrong SPIFFE ID."""

    exit_code = 5
    permanent = True


class RefusalError(AgentError):
    """The server answered with a refusal. ``code`` is the gRPC status name, ``reason`` its reason slug.

    ``reason`` is the server's slug (:mod:`protocol.reasons`) when it sent one this agent knows,
    else the exit class's name; ``wire_reason`` is whatever it sent. Built by
    :func:`agent.refusals.refusal`.
    """

    exit_code = 14

    def __init__(
        self,
        message: str,
        *,
        hint: str = "",
        code: str = "",
        reason: str = "",
        wire_reason: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self._reason = reason
        self.wire_reason = wire_reason
        self.retry_after_s = retry_after_s  # the server's RetryInfo: wait at least this long

    @property
    def reason(self) -> str:
        return self._reason or super().reason


class RefusedForNowError(RefusalError):
    """The server refused for now (a limit, a timeout, its store or token backend): back off and retry."""


class AttestationRefusedError(RefusalError):
    """The server refused the attestation: the EK is not trusted, the evidence is wrong, a bad request."""

    exit_code = 6
    permanent = True


class JoinRefusedError(RefusalError):
    """The join broker refused to issue credentials: policy, unknown pool, a bad request."""

    exit_code = 8
    permanent = True


class NotAttestedError(JoinRefusedError):
    """The broker does not know this node's identity (its store was reset?): attest again, then retry."""

    exit_code = 15
    permanent = False
    action = Action.ATTEST_AGAIN


class BannedError(RefusalError):
    """An operator banned this node (attestation or join)."""

    exit_code = 11
    permanent = True


class CheckError(AgentError):
    """A node or GPU check could not run at all (not the same as a failed check)."""

    exit_code = 7


class VerificationFailedError(CheckError):
    """The local checks fail: retried (GPUs may still be coming up), reported in the status."""


class KubeadmError(AgentError):
    """kubeadm join failed: the lifecycle asks for a new token and runs it again."""

    exit_code = 9
    action = Action.NEW_TOKEN


class KubeadmFailedError(KubeadmError):
    """kubeadm ran and failed; ``failure`` (agent.kubeadm.KubeadmFailure) is what it said about itself."""

    def __init__(self, message: str, *, hint: str = "", failure: KubeadmFailure | None = None) -> None:
        super().__init__(message, hint=hint)
        self.failure = failure


class JoinConfigError(KubeadmError):
    """The join credentials or node settings cannot make a valid JoinConfiguration (nothing was run)."""

    exit_code = 12
    permanent = True
    action = Action.STEP


class KubernetesVersionError(JoinConfigError):
    """The join answer's Kubernetes version is one this image does not carry, or one the pool's skew policy
    refuses for this node (agent.kubeversion); nothing was installed."""


class UnitStartError(AgentError):
    """``systemctl start --no-block`` of a unit the agent starts after the join failed (systemd busy or
    unreachable, a start refused): retried. The join is never touched."""

    exit_code = 16


class UnitMissingError(ConfigError):
    """The unit the agent is set to start is not installed or cannot be loaded (systemctl's exit status 5
    or 6), or there is no systemctl: the setting (spire_agent_unit) or the image is wrong."""


class StateError(AgentError):
    """The agent's state directory is unusable or a file in it is corrupt."""

    exit_code = 10
    permanent = True
