"""The agent's error hierarchy.

Every expected failure is an :class:`AgentError` with a message that says what
failed and a ``hint`` that says what to do. The CLI prints both and exits with
``exit_code``; nothing else reaches the user as a traceback. ``permanent``
tells the lifecycle whether retrying can help.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class. ``hint`` names the fix."""

    exit_code = 1
    permanent = False

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(AgentError):
    """The agent configuration (file, kernel command line, environment) is invalid."""

    exit_code = 2
    permanent = True


class TpmError(AgentError):
    """The TPM cannot be used: no device, a TSS error, a missing EK certificate."""

    exit_code = 3


class TpmUnavailableError(TpmError):
    """No TPM at the configured TCTI."""

    permanent = True


class EkCertificateError(TpmError):
    """The EK certificate is missing or does not match the EK."""

    permanent = True


class ServerUnavailableError(AgentError):
    """The server cannot be reached (transient)."""

    exit_code = 4


class ServerNotTrustedError(AgentError):
    """The server's certificate does not chain to the bootstrap bundle or has the wrong SPIFFE ID."""

    exit_code = 5
    permanent = True


class AttestationRefusedError(AgentError):
    """The server refused the attestation; ``reason`` is the server's message."""

    exit_code = 6

    def __init__(self, message: str, *, hint: str = "", code: str = "", permanent: bool = True) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.permanent = permanent


class CheckError(AgentError):
    """A node or GPU check could not run at all (not the same as a failed check)."""

    exit_code = 7


class PoolProfileError(ConfigError):
    """A pool profile is invalid: unknown keys, wrong types, bad values."""


class JoinRefusedError(AgentError):
    """The join broker refused to issue credentials."""

    exit_code = 8

    def __init__(self, message: str, *, hint: str = "", code: str = "", permanent: bool = True) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.permanent = permanent


class KubeadmError(AgentError):
    """kubeadm join failed."""

    exit_code = 9


class JoinConfigError(KubeadmError):
    """The join credentials or node settings cannot make a valid JoinConfiguration (nothing was run)."""

    permanent = True


class StateError(AgentError):
    """The agent's state directory is unreadable or corrupt."""

    exit_code = 10
    permanent = True
