"""The server's error hierarchy, mapped once to gRPC status codes at the boundary (server.boundary).

Each class carries the gRPC status code name it maps to (``grpc_code``) and a
``reason`` slug (one of :data:`protocol.reasons.REASONS`) that travels to the
client as a structured detail and is used in the audit log and the metrics.
Messages go to the peer, so they never contain secrets nor server paths:
``detail`` carries what only the server's log may see (an exception's text, a
file name). ``retry_after_s`` becomes a ``google.rpc.RetryInfo`` for limits.
"""

from __future__ import annotations


class ServerError(Exception):
    """Base class."""

    grpc_code = "INTERNAL"
    reason = "internal"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        detail: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.retry_after_s = retry_after_s
        if reason is not None:
            self.reason = reason

    def __str__(self) -> str:
        return self.message


class ConfigError(ServerError):
    """The server configuration is invalid; raised at start."""

    reason = "config"


class InvalidRequestError(ServerError):
    """Malformed request or payload."""

    grpc_code = "INVALID_ARGUMENT"
    reason = "invalid_argument"


class PayloadTooLargeError(ServerError):
    grpc_code = "RESOURCE_EXHAUSTED"
    reason = "payload_too_large"


class UnknownAttestorError(ServerError):
    grpc_code = "FAILED_PRECONDITION"
    reason = "unknown_attestor"


class AttestationDeniedError(ServerError):
    """The evidence is well-formed but not acceptable (untrusted EK, bad AK, wrong secret)."""

    grpc_code = "PERMISSION_DENIED"
    reason = "denied"


class BannedError(AttestationDeniedError):
    reason = "banned"


class AgentNotAttestedError(AttestationDeniedError):
    """The server knows no attestation of the agent the request speaks for (DevID enrolment)."""

    reason = "not_attested"


class NotJoinedError(AttestationDeniedError):
    """DevID enrolment for a machine this server never admitted by a join (``devid.require_join``)."""

    reason = "not_joined"


class EkNotTrustedError(AttestationDeniedError):
    """The EK is neither listed nor certified by a trusted manufacturer CA (``server.ek_trust``).

    ``reason`` is the verdict's stable ``reason_code`` (``ek_issuer_unknown``,
    ``ek_cert_key_mismatch``, ...); the message is the verdict's ``reason``.
    """

    reason = "ek_not_trusted"


class ChallengeTimeoutError(ServerError):
    grpc_code = "DEADLINE_EXCEEDED"
    reason = "challenge_timeout"


class UnauthenticatedError(ServerError):
    grpc_code = "UNAUTHENTICATED"
    reason = "unauthenticated"


class NotFoundError(ServerError):
    grpc_code = "NOT_FOUND"
    reason = "not_found"


class PolicyDeniedError(ServerError):
    """The verification report fails the pool policy."""

    grpc_code = "PERMISSION_DENIED"
    reason = "policy"


class ReplayError(ServerError):
    grpc_code = "ALREADY_EXISTS"
    reason = "replay"


class StoreError(ServerError):
    """The store is unavailable or inconsistent."""

    grpc_code = "UNAVAILABLE"
    reason = "store"


class TokenBackendError(ServerError):
    """The bootstrap-token backend (Kubernetes API, file) failed."""

    grpc_code = "UNAVAILABLE"
    reason = "token_backend"


class CancelledByClientError(ServerError):
    """The client cancelled or reset the stream mid-flow."""

    grpc_code = "CANCELLED"
    reason = "cancelled"


class TokenConflictError(TokenBackendError):
    """The backend already holds a bootstrap token with this id: mint a new token and try again."""

    grpc_code = "ABORTED"
    reason = "token_conflict"
