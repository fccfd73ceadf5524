"""The join-credential broker: ``nodetrust.join.v1.Join`` over mutual TLS.

``RequestJoin``: the caller is identified only by the X509-SVID it presents
(issued by our CA, unexpired: gRPC's TLS checks both), whose URI SAN must be a
TPM agent ID of our trust domain that the store knows as attested and not
banned. The server then checks the pool exists, the node name, the freshness and
uniqueness of the request, parses the verification report and recomputes its
verdict under the pool policy it holds (the agent's own statuses are ignored),
and only then mints a one-time bootstrap token: recorded (as a hash) as the
node's one live token under a per-node lock, replacing and revoking any previous
one, and only then created in the backend (so a token the server is killed
while creating is still recorded, and swept when it expires).

Limits per agent (docs/join.md, "Limits"): a repeated request for the same pool
and node within ``token_reuse_window`` gets the same live token back (nothing new
is minted or stored); at most ``joins_per_agent`` tokens per ``join_window``;
the joins history is pruned after ``joins_retention``.

``ReportJoined``: the agent says ``kubeadm join`` succeeded with its token; the
broker revokes it at once (deletes it from the backend), so the "one-time" token
cannot register another node for the rest of its TTL.

The token never reaches a log or the audit trail: only its public id does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from cryptography import x509

from protocol._gen.nodetrust.join.v1 import join_pb2
from protocol.errors import ProtocolError, SpiffeIdError
from protocol.k8s import node_name_problem
from protocol.policy import judge
from protocol.quote import NONCE_BYTES
from protocol.report import Status, parse_report
from protocol.spiffe import SpiffeId, is_agent_id
from server import measured_boot
from server.boundary import Call, Context, Method
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
from server.measured_boot import QuoteRefusedError
from server.pools import JoinSettings, Pool
from server.store import AgentRecord, JoinRecord, Store, TokenRecord
from server.tokens.backend import TokenBackend
from server.tokens.token import TOKEN_ID_RE, BootstrapToken, new_token

log = logging.getLogger(__name__)
T = TypeVar("T")
_REQUEST_ID_RE = re.compile(r"[0-9a-f]{32}")
REQUEST_ID_MEMORY_S = 24 * 3600
MAX_POOL_CHARS = 63
MAX_REUSE_ENTRIES = 10_000


class NotAttestedError(ServerError):
    grpc_code = "PERMISSION_DENIED"
    reason = "not_attested"


class IdentityRefusedError(ServerError):
    """The machine may not join as this name or pool (enrolment, name binding, changed measurements)."""

    grpc_code = "PERMISSION_DENIED"
    reason = "node_name_taken"


class JoinRateLimitedError(ServerError):
    grpc_code = "RESOURCE_EXHAUSTED"
    reason = "join_rate_limited"


def peer_spiffe_id(context: Context, trust_domain: str) -> SpiffeId:
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
    if not is_agent_id(spiffe_id, trust_domain):
        raise UnauthenticatedError(
            f"{spiffe_id} is not a TPM-attested agent (tpm or tpm_devid) of {trust_domain}"
        )
    return spiffe_id


@dataclass(frozen=True)
class _Issued:
    """A token handed out recently, kept in memory for the reuse window (never on disk)."""

    token: BootstrapToken
    pool: str
    node_name: str
    issued_mono: float


class JoinService:
    def __init__(
        self,
        *,
        trust_domain: str,
        settings: JoinSettings,
        store: Store,
        backend: TokenBackend,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trust_domain = trust_domain
        self.settings = settings
        self.store = store
        self.backend = backend
        self.executor = executor
        self.clock = clock
        self.monotonic = monotonic
        self._recent: OrderedDict[str, _Issued] = OrderedDict()
        self._recent_lock = threading.Lock()

    def methods(self) -> dict[str, Method]:
        return {
            "BeginJoin": Method("begin_join", self.begin_join),
            "RequestJoin": Method("join", self.request_join),
            "ReportJoined": Method("joined", self.report_joined),
            "Recheck": Method("recheck", self.recheck),
        }

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _caller(self, context: Context, call: Call) -> str:
        return (await self._caller_record(context, call)).spiffe_id

    async def _caller_record(self, context: Context, call: Call) -> AgentRecord:
        agent_id = str(peer_spiffe_id(context, self.trust_domain))
        call.set(spiffe_id=agent_id)
        try:
            record = await self._in_thread(self.store.get_agent, agent_id)
        except ServerError:
            raise
        except Exception as exc:
            raise StoreError("could not read the agent record", detail=str(exc)) from exc
        if record is None or not record.attestation_type:
            raise NotAttestedError(f"{agent_id} has not attested to this server")
        if record.banned:
            raise BannedError(f"{agent_id} is banned")
        call.set(ek_hash=record.ek_hash)
        return record

    def _pool(self, name: str) -> Pool:
        pool = self.settings.pools.get(name)
        if pool is None:
            known = ", ".join(sorted(self.settings.pools))
            raise NotFoundError(
                f"unknown pool {name[:MAX_POOL_CHARS]!r}; this server has: {known}", reason="unknown_pool"
            )
        return pool

    # -- BeginJoin ----------------------------------------------------------------
    async def begin_join(
        self, request: join_pb2.BeginJoinRequest, context: Context, call: Call
    ) -> join_pb2.BeginJoinResponse:
        call.set(pool=request.pool)
        record = await self._caller_record(context, call)
        pool = self._pool(request.pool)
        policy = pool.measured_boot
        if policy is None:
            call.commit("no_quote_needed", "the pool does not check measured boot")
            return join_pb2.BeginJoinResponse()
        nonce = os.urandom(NONCE_BYTES)
        expires = int(self.clock() + policy.nonce_ttl_s)
        await self._in_thread(
            self.store.issue_nonce, record.spiffe_id, hashlib.sha256(nonce).hexdigest(), pool.name, expires
        )
        call.set(pcrs=list(policy.quoted_pcrs), pcr_bank=policy.bank)
        call.commit("nonce_issued", "quote nonce issued")
        return join_pb2.BeginJoinResponse(
            nonce=nonce, pcr_bank=policy.bank, pcrs=list(policy.quoted_pcrs), expires_at=expires
        )

    def _identity_checks(self, record: AgentRecord, pool: Pool, node_name: str) -> None:
        """In a worker thread: the enrolment registry and the node-name binding (before any token)."""
        enrolment = self.store.enrolment(record.ek_hash)
        if enrolment is None and pool.require_enrolment:
            raise IdentityRefusedError(
                f"pool {pool.name} admits only enrolled machines and this EK ({record.ek_hash[:16]}...) is not: "
                "enrol it with `nodeserver enrol add`",
                reason="not_enrolled",
            )
        if enrolment is not None and (enrolment.node_name != node_name or enrolment.pool != pool.name):
            raise IdentityRefusedError(
                f"this machine is enrolled as {enrolment.node_name!r} in pool {enrolment.pool!r}, "
                f"not as {node_name!r} in {pool.name!r}",
                reason="enrolment_mismatch",
            )
        bound = self.store.node_name_binding(node_name)
        if bound is not None and bound.agent_id != record.spiffe_id:
            raise IdentityRefusedError(
                f"node name {node_name!r} belongs to another machine (EK {bound.ek_hash[:16]}..., since "
                f"{time.strftime('%Y-%m-%d', time.gmtime(bound.bound_at))}); an operator can release it with "
                "`nodeserver names release`",
                reason="node_name_taken",
            )

    async def _measured_boot(
        self,
        request: join_pb2.JoinRequest | join_pb2.RecheckRequest,
        record: AgentRecord,
        pool: Pool,
        call: Call,
    ) -> None:
        policy = pool.measured_boot
        if policy is None:
            return
        if not (request.nonce and request.quote and request.quote_signature and request.event_log):
            raise InvalidRequestError(
                f"pool {pool.name} checks measured boot: call BeginJoin, then send a TPM2_Quote over its nonce and "
                "the event log (upgrade the agent)",
                reason="quote_missing",
            )
        now = int(self.clock())
        nonce_pool = await self._in_thread(
            self.store.consume_nonce, record.spiffe_id, hashlib.sha256(request.nonce).hexdigest(), now
        )
        if nonce_pool is None or nonce_pool != pool.name:
            raise QuoteRefusedError(
                "the request's nonce is not one BeginJoin issued to this agent for this pool, or it expired or was "
                "used: call BeginJoin again",
                reason="quote_nonce",
            )
        admission = await self._in_thread(
            partial(
                measured_boot.verify,
                policy,
                ak_public_hex=record.ak_public,
                ak_qualified_name_hex=record.ak_qualified_name,
                nonce=request.nonce,
                quote=request.quote,
                signature=request.quote_signature,
                event_log=request.event_log,
            )
        )
        call.set(
            release=admission.release,
            checked_pcrs=list(admission.checked_pcrs),
            unchecked_pcrs=list(admission.unchecked_pcrs),
        )

    # -- RequestJoin --------------------------------------------------------------
    async def request_join(
        self, request: join_pb2.JoinRequest, context: Context, call: Call
    ) -> join_pb2.JoinResponse:
        call.set(pool=request.pool, node_name=request.node_name)
        record = await self._caller_record(context, call)
        agent_id = record.spiffe_id
        pool = self._pool(request.pool)
        problem = node_name_problem(request.node_name)
        if problem is not None:
            raise InvalidRequestError(
                f"node name {request.node_name[:253]!r}: {problem}", reason="bad_node_name"
            )
        now = self.clock()
        skew = self.settings.clock_skew.total_seconds()
        if abs(now - request.requested_at) > skew:
            raise InvalidRequestError(
                f"the request is {now - request.requested_at:+.0f} s off the server's clock (limit {skew:.0f} s): "
                "synchronise the node's clock",
                reason="stale_request",
            )
        if not _REQUEST_ID_RE.fullmatch(request.request_id):
            raise InvalidRequestError(
                "request_id must be 32 lowercase hex characters", reason="bad_request_id"
            )
        await self._in_thread(self._identity_checks, record, pool, request.node_name)
        # What the node booted, before its word about its GPUs: an admitted node's report is the word
        # of a verified image's agent.
        await self._measured_boot(request, record, pool, call)
        try:
            report = parse_report(request.report)
        except ProtocolError as exc:
            raise InvalidRequestError(f"verification report: {exc}", reason="bad_report") from exc
        checks, verdict = judge(report, pool.policy)
        call.set(
            verdict="pass" if verdict.passed else "fail",
            passed_checks=sorted(c.name for c in checks if c.status == Status.PASS),
            warned_checks=sorted({w.check for w in verdict.warnings}),
        )
        if not verdict.passed:
            reasons = "; ".join(f"{f.check}: {f.reason}" for f in verdict.failures[:10])
            call.set(failed_checks=[f.check for f in verdict.failures])
            raise PolicyDeniedError(f"the node fails pool {pool.name}: {reasons}")
        fresh = await self._in_thread(
            self.store.consume_request_id, agent_id, request.request_id, int(now) + REQUEST_ID_MEMORY_S
        )
        if not fresh:
            raise ReplayError(f"request {request.request_id} was already used: a replayed request")
        token, _reused = await self._in_thread(self._grant, record, pool, request.node_name, int(now), call)
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

    def _grant(
        self, record: AgentRecord, pool: Pool, node_name: str, now: int, call: Call
    ) -> tuple[BootstrapToken, bool]:
        """In a worker thread, under the node lock: reuse the live token, or mint one within the limits."""
        agent_id = record.spiffe_id
        with self.store.node_lock(agent_id):
            reused = self._reusable(agent_id, pool.name, node_name, now)
            if reused is not None:
                with call.committing():
                    call.set(token_id=reused.token_id, token_expires_at=reused.expires_at, token_reused=True)
                    call.commit("token_reused", "the live token of this node, issued moments ago")
                return reused, True
            window = self.settings.join_window.total_seconds()
            try:
                recent = self.store.count_joins_since(agent_id, now - int(window))
            except ServerError:
                raise
            except Exception as exc:
                raise StoreError("could not count the agent's joins", detail=str(exc)) from exc
            if recent >= self.settings.joins_per_agent:
                raise JoinRateLimitedError(
                    f"this agent was issued {recent} tokens in the last {window:.0f} s "
                    f"(limit {self.settings.joins_per_agent}); retry later",
                    retry_after_s=min(window, 60.0),
                )
            with call.committing():
                # The first grant binds the name to this machine's EK (the store's primary key makes it
                # one machine's even when two replicas race).
                bound = self.store.bind_node_name(node_name, agent_id, record.ek_hash, now)
                if bound.agent_id != agent_id:
                    raise IdentityRefusedError(
                        f"node name {node_name!r} belongs to another machine", reason="node_name_taken"
                    )
                token = self._mint(agent_id, pool, node_name, now)
                call.set(token_id=token.token_id, token_expires_at=token.expires_at)
                try:
                    self.store.record_join(
                        JoinRecord(agent_id=agent_id, node_name=node_name, pool=pool.name,
                                   token_id=token.token_id, verdict="pass", at=now)
                    )  # fmt: skip
                    call.on_cancel.append(lambda: self._revoke_later(agent_id, token.token_id))
                    call.commit("joined", "token issued")
                except BaseException:
                    self._revoke(agent_id, token.token_id, "its grant could not be recorded")
                    raise
            self._remember(agent_id, token, pool.name, node_name)
            return token, False

    def _reusable(self, agent_id: str, pool: str, node_name: str, now: int) -> BootstrapToken | None:
        with self._recent_lock:
            issued = self._recent.get(agent_id)
        if issued is None or issued.pool != pool or issued.node_name != node_name:
            return None
        if self.monotonic() - issued.issued_mono > self.settings.token_reuse_window.total_seconds():
            return None
        live = self.store.live_token(agent_id, now)
        if live is None or live.token_id != issued.token.token_id:
            return None  # revoked, replaced or expired since: mint a new one
        return issued.token

    def _remember(self, agent_id: str, token: BootstrapToken, pool: str, node_name: str) -> None:
        if self.settings.token_reuse_window.total_seconds() <= 0:
            return
        with self._recent_lock:
            self._recent.pop(agent_id, None)
            self._recent[agent_id] = _Issued(token, pool, node_name, self.monotonic())
            while len(self._recent) > MAX_REUSE_ENTRIES:
                self._recent.popitem(last=False)

    def _forget_recent(self, agent_id: str, token_id: str | None = None) -> None:
        with self._recent_lock:
            issued = self._recent.get(agent_id)
            if issued is not None and (token_id is None or issued.token.token_id == token_id):
                del self._recent[agent_id]

    def _mint(self, agent_id: str, pool: Pool, node_name: str, now: int) -> BootstrapToken:
        try:
            return self._mint_once(agent_id, pool, node_name, now)
        except TokenConflictError:
            # A 6-character token id collided with an existing one: draw again, once.
            return self._mint_once(agent_id, pool, node_name, now)

    def _mint_once(self, agent_id: str, pool: Pool, node_name: str, now: int) -> BootstrapToken:
        """Record the token first, then create it in the backend (caller holds the node lock).

        A token recorded but never created (the server killed in between) is swept when it
        expires like any other; one created but not recorded cannot happen.
        """
        token = new_token(
            ttl_s=int(self.settings.token_ttl.total_seconds()),
            now=now,
            description=f"nodetrust join of {node_name} ({pool.name})",
            extra_groups=pool.extra_groups,
        )
        record = TokenRecord(
            agent_id=agent_id,
            token_id=token.token_id,
            secret_sha256=token.secret_sha256,
            pool=pool.name,
            node_name=node_name,
            issued_at=now,
            expires_at=token.expires_at,
        )
        try:
            previous = self.store.replace_token(record)
        except StoreError as exc:
            if exc.reason == "token_id_taken":
                raise TokenConflictError("token id collision", detail=str(exc)) from exc
            raise
        if previous is not None:
            self._forget_recent(agent_id, previous.token_id)
            self._delete_quietly(agent_id, previous.token_id, previous.backend_ref)
        try:
            self.backend.create(token)
        except BaseException as exc:
            self._forget_quietly(agent_id, token.token_id)
            if isinstance(exc, ServerError):
                raise
            if isinstance(exc, Exception):
                raise TokenBackendError(
                    "the token backend failed", detail=f"{type(exc).__name__}: {exc}"
                ) from exc
            raise
        return token

    def _forget_quietly(self, agent_id: str, token_id: str) -> None:
        try:
            self.store.revoke_token(agent_id, token_id)
            self.store.forget_token(agent_id, token_id)
        except Exception:
            log.warning("could not forget token %s; the sweeper removes it", token_id, exc_info=True)

    def _delete_quietly(self, agent_id: str, token_id: str, backend_ref: str) -> bool:
        """Delete a revoked token from the backend and forget it; False (left for the sweeper) on failure."""
        try:
            self.backend.delete(token_id, backend_ref)
        except Exception:
            log.warning(
                "could not delete bootstrap token %s from the backend; the sweeper retries",
                token_id,
                exc_info=True,
            )
            return False
        try:
            self.store.forget_token(agent_id, token_id)
        except Exception:
            log.warning("could not forget token %s; the sweeper retries", token_id, exc_info=True)
        return True

    def _revoke(self, agent_id: str, token_id: str, why: str) -> bool:
        """Revoke the agent's token ``token_id`` now: store first (it stops being live), then backend."""
        self._forget_recent(agent_id, token_id)
        live = self.store.live_token(agent_id, int(self.clock()))
        revoked = self.store.revoke_token(agent_id, token_id)
        if revoked:
            log.info("revoked bootstrap token %s of %s: %s", token_id, agent_id, why)
            ref = live.backend_ref if live is not None and live.token_id == token_id else ""
            self._delete_quietly(agent_id, token_id, ref)
        return revoked

    def _revoke_later(self, agent_id: str, token_id: str) -> None:
        """The client went away after its token was granted: nobody holds it, so revoke it."""

        def work() -> None:
            try:
                self._revoke(agent_id, token_id, "the client cancelled before receiving it")
            except Exception:
                log.warning("could not revoke the undelivered token %s", token_id, exc_info=True)

        threading.Thread(target=work, name="nodeserver-revoke", daemon=True).start()

    # -- Recheck --------------------------------------------------------------------
    async def recheck(
        self, request: join_pb2.RecheckRequest, context: Context, call: Call
    ) -> join_pb2.RecheckResponse:
        call.set(pool=request.pool, node_name=request.node_name)
        record = await self._caller_record(context, call)
        pool = self._pool(request.pool)
        await self._in_thread(self._identity_checks, record, pool, request.node_name)
        if pool.measured_boot is None:
            call.commit("not_checked", "the pool does not check measured boot")
            return join_pb2.RecheckResponse()
        try:
            await self._measured_boot(request, record, pool, call)
        except measured_boot.BootNotAcceptedError as exc:
            banned = pool.measured_boot.on_change == "ban"
            if banned:
                await self._in_thread(self.store.ban_agent, record.spiffe_id)
                self._forget_recent(record.spiffe_id)
            call.set(banned=banned)
            raise IdentityRefusedError(
                "this node's boot measurements changed since it joined"
                + (" (it is now banned and its token revoked)" if banned else "")
                + f": {exc.message}",
                reason="measurement_changed",
                detail=exc.detail,
            ) from exc
        release = str(call.fields.get("release", ""))
        call.commit("rechecked", "boot measurements still match")
        return join_pb2.RecheckResponse(release=release)

    # -- ReportJoined -----------------------------------------------------------------
    async def report_joined(
        self, request: join_pb2.JoinedRequest, context: Context, call: Call
    ) -> join_pb2.JoinedResponse:
        call.set(token_id=request.token_id[:6], node_name=request.node_name)
        agent_id = await self._caller(context, call)
        if not TOKEN_ID_RE.fullmatch(request.token_id):
            raise InvalidRequestError(
                "token_id must be the 6-character id of a bootstrap token", reason="unknown_token"
            )
        revoked = await self._in_thread(self._joined, agent_id, request.token_id, request.node_name)
        call.set(token_revoked=revoked)
        call.commit(
            "token_revoked" if revoked else "already_revoked",
            "joined; token revoked" if revoked else "joined",
        )
        return join_pb2.JoinedResponse(revoked=revoked)

    def _joined(self, agent_id: str, token_id: str, node_name: str) -> bool:
        with self.store.node_lock(agent_id):
            live = self.store.live_token(agent_id, int(self.clock()))
            if live is not None and live.token_id == token_id and live.node_name != node_name:
                raise InvalidRequestError(
                    f"token {token_id} was issued for node {live.node_name!r}, not {node_name[:253]!r}",
                    reason="unknown_token",
                )
            return self._revoke(agent_id, token_id, f"node {node_name} reported joined")

    # -- housekeeping -----------------------------------------------------------------
    def sweep(self) -> int:
        """Delete revoked and expired tokens from the backend, forget them, prune the history.

        Runs periodically in a thread. A token whose deletion fails stays recorded and is tried
        again on the next round.
        """
        now = int(self.clock())
        count = 0
        for rec in list(self.store.stale_tokens(now)):
            if rec.expires_at <= now:
                self._forget_recent(rec.agent_id, rec.token_id)
            if self._delete_quietly(rec.agent_id, rec.token_id, rec.backend_ref):
                count += 1
        retention = int(self.settings.joins_retention.total_seconds())
        pruned = self.store.prune_joins(now - retention)
        if pruned:
            log.info("pruned %d join record(s) older than %s", pruned, self.settings.joins_retention)
        return count

    # Kept for callers of the old name (the demo, the benches).
    sweep_expired = sweep
