"""The image builder's error hierarchy: a message that says what failed, a hint that names the fix."""

from __future__ import annotations


class BuildError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class DefinitionError(BuildError):
    """definition.yaml is invalid."""

    exit_code = 2


class LockError(BuildError):
    """The lock file is missing, stale, or does not cover an input."""

    exit_code = 3


class FetchError(BuildError):
    """A download failed or its digest does not match."""

    exit_code = 4


class VerificationError(BuildError):
    """A checksum, signature or digest does not match."""

    exit_code = 5


class InstallerError(BuildError):
    """The installer failed, hung, or asked a question; the message carries the diagnosis."""

    exit_code = 6


class VmError(BuildError):
    """libvirt or QEMU could not run the build VM."""

    exit_code = 7


class OutputError(BuildError):
    """Publishing or reading build outputs failed."""

    exit_code = 8


class KeyFileError(BuildError):
    """A signing or verification key is missing, unreadable, unsafe, encrypted without a passphrase,
    or of a kind the builder does not sign with (ECDSA P-256 and Ed25519 only)."""

    exit_code = 9


class FolderMismatch(VerificationError):
    """One file of a build folder does not match what another file says about it.

    ``path`` names that file (relative to the folder) and ``reason`` says why; the message is
    ``"<path>: <reason>"``.
    """

    def __init__(self, path: str, reason: str, *, hint: str = "") -> None:
        super().__init__(f"{path}: {reason}", hint=hint)
        self.path = path
        self.reason = reason


class CommandError(BuildError):
    """A host command could not be started, timed out, or exited non-zero."""

    exit_code = 10

    def __init__(
        self,
        message: str,
        *,
        argv: list[str],
        returncode: int | None,
        output: str = "",
        hint: str = "",
    ) -> None:
        super().__init__(message, hint=hint)
        self.argv = argv
        self.returncode = returncode
        self.output = output


class BootTestFailed(BuildError):
    """The built image booted (or failed to) and a boot-test check failed; nothing was published.
    (``imagebuilder test`` itself exits 1 for a failed check and keeps this code for the build.)"""

    exit_code = 12


class ToolMissingError(BuildError):
    """A host tool the builder needs is not installed; the hint names the package."""

    exit_code = 11
