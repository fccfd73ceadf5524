"""The join-credential broker: ``nodetrust.join.v1.Join/RequestJoin`` over mutual TLS.

The caller is identified only by the X509-SVID it presents (issued by our CA,
unexpired: gRPC's TLS checks both), whose URI SAN must be a TPM agent ID of
our trust domain that the store knows as attested and not banned. The server
then checks the pool exists, the node name, the freshness and uniqueness of
the request, parses the verification report and recomputes its verdict under
the pool policy it holds (the agent's own statuses are ignored), and only then
mints a one-time bootstrap token: created in the backend, recorded (as a hash)
as the node's one live token under a per-node lock, replacing and deleting any
previous one.

The token never reaches a log or the audit trail: only its public id does.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from cryptography import x509

from protocol._gen.nodetrust.join.v1 import join_pb2, join_pb2_grpc
from protocol.errors import ProtocolError, SpiffeIdError
from protocol.k8s import node_name_problem
from protocol.policy import evaluate
from protocol.report import parse_report
from protocol.spiffe import SpiffeId, is_tpm_agent_id
from server.attest_service import grpc_status
from server.audit import AuditLog
from server.errors import (
    BannedError,
    InvalidRequestError,
    NotFoundError,
    PolicyDeniedError,
    ReplayError,
    ServerError,
    StoreError,
    TokenBackendError,
    TokenConflictError,
    UnauthenticatedError,
)
from server.metrics import Metrics
from server.pools import JoinSettings, Pool
from server.store import JoinRecord, Store, TokenRecord
from server.tokens.backend import TokenBackend
from server.tokens.token import BootstrapToken, new_token

log = logging.getLogger(__name__)
T = TypeVar("T")
_REQUEST_ID_RE = re.compile(r"^[0-9a-f]{32}$")
REQUEST_ID_MEMORY_S = 24 * 3600


class NotAttestedError(ServerError):
    grpc_code = "PERMISSION_DENIED"
    reason = "not_attested"


@dataclass
class _Attempt:
    peer: str
    started: float = field(default_factory=time.monotonic)
    agent_id: str = ""
    pool: str = ""
    node_name: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


def peer_spiffe_id(context: grpc.aio.ServicerContext[Any, Any], trust_domain: str) -> SpiffeId:
    """The caller's SPIFFE ID from its (already chain-verified) client certificate."""
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert") or []
    if not pems:
        raise UnauthenticatedError("no client certificate: present the agent X509-SVID from AttestAgent")
    try:
        cert = x509.load_pem_x509_certificate(pems[0])
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise UnauthenticatedError("the client certificate is not an X509-SVID") from exc
    if len(uris) != 1:
        raise UnauthenticatedError("the client certificate must carry exactly one SPIFFE ID")
    try:
        spiffe_id = SpiffeId.parse(uris[0])
    except SpiffeIdError as exc:
        raise UnauthenticatedError(f"the client certificate's URI SAN is not a SPIFFE ID: {exc}") from exc
    if not is_tpm_agent_id(spiffe_id, trust_domain):
        raise UnauthenticatedError(f"{spiffe_id} is not a TPM-attested agent of {trust_domain}")
    return spiffe_id


class JoinService(join_pb2_grpc.JoinServicer):
    def __init__(
        self,
        *,
        trust_domain: str,
        settings: JoinSettings,
        store: Store,
        backend: TokenBackend,
        audit: AuditLog,
        metrics: Metrics,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.trust_domain = trust_domain
        self.settings = settings
        self.store = store
        self.backend = backend
        self.audit = audit
        self.metrics = metrics
        self.executor = executor
        self.clock = clock

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def RequestJoin(
        self, request: join_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> join_pb2.JoinResponse:
        attempt = _Attempt(peer=context.peer() or "", pool=request.pool, node_name=request.node_name)
        try:
            response = await self._join(request, context, attempt)
            self._finish(attempt, "ok", None)
            return response
        except ServerError as err:
            self._finish(attempt, "denied" if err.grpc_code == "PERMISSION_DENIED" else "error", err)
            await context.abort(grpc_status(err), err.message)
        except Exception:
            log.exception("join request from %s failed unexpectedly", attempt.peer)
            self._finish(attempt, "error", ServerError("internal error"))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")
        raise AssertionError("unreachable")  # pragma: no cover - abort() raises

    async def _join(
        self, request: join_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any], attempt: _Attempt
    ) -> join_pb2.JoinResponse:
        agent_id = str(peer_spiffe_id(context, self.trust_domain))
        attempt.agent_id = agent_id
        try:
            record = await self._in_thread(self.store.get_agent, agent_id)
        except ServerError:
            raise
        except Exception as exc:
            raise StoreError(f"could not read the agent record: {exc}") from exc
        if record is None or not record.attestation_type:
            raise NotAttestedError(f"{agent_id} has not attested to this server")
        if record.banned:
            raise BannedError(f"{agent_id} is banned")
        pool = self.settings.pools.get(request.pool)
        if pool is None:
            raise NotFoundError(
                f"unknown pool {request.pool!r}; this server has: {', '.join(sorted(self.settings.pools))}",
                reason="unknown_pool",
            )
        problem = node_name_problem(request.node_name)
        if problem is not None:
            raise InvalidRequestError(f"node name {request.node_name!r}: {problem}", reason="bad_node_name")
        now = self.clock()
        skew = self.settings.clock_skew.total_seconds()
        if abs(now - request.requested_at) > skew:
            raise InvalidRequestError(
                f"the request is {now - request.requested_at:+.0f} s off the server's clock (limit {skew:.0f} s): "
                "synchronise the node's clock",
                reason="stale_request",
            )
        if not _REQUEST_ID_RE.match(request.request_id):
            raise InvalidRequestError(
                "request_id must be 32 lowercase hex characters", reason="bad_request_id"
            )
        try:
            report = parse_report(request.report)
        except ProtocolError as exc:
            raise InvalidRequestError(f"verification report: {exc}", reason="bad_report") from exc
        verdict = evaluate(report, pool.policy)
        attempt.fields["verdict"] = "pass" if verdict.passed else "fail"
        if not verdict.passed:
            reasons = "; ".join(f"{f.check}: {f.reason}" for f in verdict.failures[:10])
            attempt.fields["failed_checks"] = [f.check for f in verdict.failures]
            raise PolicyDeniedError(f"the node fails pool {pool.name}: {reasons}")
        fresh = await self._in_thread(
            self.store.consume_request_id, agent_id, request.request_id, int(now) + REQUEST_ID_MEMORY_S
        )
        if not fresh:
            raise ReplayError(f"request {request.request_id} was already used: a replayed request")
        token = await self._in_thread(self._mint, agent_id, pool, request.node_name, int(now))
        attempt.fields.update(token_id=token.token_id, token_expires_at=token.expires_at)
        await self._in_thread(
            self.store.record_join,
            JoinRecord(agent_id=agent_id, node_name=request.node_name, pool=pool.name, token_id=token.token_id,
                       verdict="pass", at=int(now)),
        )  # fmt: skip
        labels = dict(pool.policy.labels)
        labels["nodetrust.io/pool"] = pool.name
        return join_pb2.JoinResponse(
            token=token.value,
            token_expires_at=token.expires_at,
            ca_cert_hashes=list(self.settings.ca_cert_hashes),
            api_server_endpoint=pool.api_server_endpoint,
            kubernetes_version=pool.kubernetes_version,
            labels=labels,
            taints=[join_pb2.Taint(key=t.key, value=t.value, effect=t.effect) for t in pool.policy.taints],
            verdict="pass" + (f" with {len(verdict.warnings)} warning(s)" if verdict.warnings else ""),
        )

    def _mint(self, agent_id: str, pool: Pool, node_name: str, now: int) -> BootstrapToken:
        """Create the node's one live token (runs in a worker thread, under the node lock)."""
        try:
            return self._mint_once(agent_id, pool, node_name, now)
        except TokenConflictError:
            # A 6-character token id collided with an existing one: draw again, once.
            return self._mint_once(agent_id, pool, node_name, now)

    def _mint_once(self, agent_id: str, pool: Pool, node_name: str, now: int) -> BootstrapToken:
        token = new_token(
            ttl_s=int(self.settings.token_ttl.total_seconds()),
            now=now,
            description=f"nodetrust join of {node_name} ({pool.name})",
            extra_groups=pool.extra_groups,
        )
        with self.store.node_lock(agent_id):
            try:
                ref = self.backend.create(token)
            except ServerError:
                raise
            except Exception as exc:
                raise TokenBackendError(f"the token backend failed: {type(exc).__name__}") from exc
            record = TokenRecord(
                agent_id=agent_id,
                token_id=token.token_id,
                secret_sha256=token.secret_sha256,
                pool=pool.name,
                node_name=node_name,
                issued_at=now,
                expires_at=token.expires_at,
                backend_ref=ref,
            )
            try:
                previous = self.store.replace_token(record)
            except BaseException:
                self._delete_quietly(token.token_id, ref)
                raise
            if previous is not None:
                self._delete_quietly(previous.token_id, previous.backend_ref)
        return token

    def _delete_quietly(self, token_id: str, ref: str) -> None:
        try:
            self.backend.delete(token_id, ref)
        except Exception:
            log.warning(
                "could not delete bootstrap token %s from the backend; it expires on its own",
                token_id,
                exc_info=True,
            )

    def sweep_expired(self) -> int:
        """Delete expired tokens from the backend and forget them (runs periodically in a thread)."""
        count = 0
        for rec in list(self.store.expired_tokens(int(self.clock()))):
            self._delete_quietly(rec.token_id, rec.backend_ref)
            self.store.forget_token(rec.agent_id, rec.token_id)
            count += 1
        return count

    def _finish(self, attempt: _Attempt, result: str, err: ServerError | None) -> None:
        elapsed = time.monotonic() - attempt.started
        reason = err.reason if err else "joined"
        self.metrics.joins.labels(result=result, reason=reason).inc()
        self.metrics.join_seconds.observe(elapsed)
        self.audit.write(
            "join",
            result=result,
            reason=reason,
            status=err.grpc_code if err else "OK",
            message=err.message if err else "token issued",
            peer=attempt.peer,
            spiffe_id=attempt.agent_id,
            pool=attempt.pool,
            node_name=attempt.node_name,
            duration_ms=round(elapsed * 1000, 1),
            **attempt.fields,
        )
