"""``nodeagent run``: power-on to joined without a human.

    preflight -> attest -> verify -> join_request -> kubeadm_join -> joined

The step is persisted before it runs and after it succeeds (agent.state), so a
crash or a reboot resumes at the right place:

* a completed join is never repeated: the ``joined`` marker (or an existing
  ``/etc/kubernetes/kubelet.conf``) ends the run at once;
* the bootstrap token is never written to disk; a crash after the join request
  but before kubeadm finishes resumes at ``join_request`` and asks for a new
  token (the broker replaces and revokes the old one);
* the SVID is re-used while it has more than ``reattest_before_s`` left, and
  the agent attests again before it expires.

Transient failures (server down, network, TPM busy, GPUs not ready, kubeadm
failing to reach the API server) are retried with capped exponential backoff
and full jitter; permanent refusals (banned, policy, bad configuration) stop
with the reason and what to do, visible in ``nodeagent status`` and through
sd_notify ``STATUS=``.

``NODEAGENT_FAULT_KILL_AFTER=<step>`` makes the process SIGKILL itself right
after persisting that step's completion: a fault-injection hook for the tests
that prove resumption (it does nothing unless set).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from agent.config import AgentConfig
from agent.errors import AgentError, ConfigError, StateError
from agent.state import LastError, State, StateStore, Step
from agent.svid import SvidStore

log = logging.getLogger(__name__)
KUBELET_CONF = Path("/etc/kubernetes/kubelet.conf")
FAULT_ENV = "NODEAGENT_FAULT_KILL_AFTER"


class VerificationFailedError(AgentError):
    """The local checks fail: retried (GPUs may still be coming up), reported in the status."""

    exit_code = 7


@dataclass
class Outcome:
    joined: bool
    state: State


def backoff(attempt: int, initial: float, cap: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, initial * 2**attempt)]."""
    return rng.uniform(0, min(cap, initial * (2 ** min(attempt, 20))))


def _notify(text: str) -> None:
    try:
        from agent.sdnotify import status
    except ImportError:  # pragma: no cover - the module ships with the agent
        return
    status(text)


class Lifecycle:
    def __init__(
        self,
        config: AgentConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        kubelet_conf: Path = KUBELET_CONF,
    ) -> None:
        self.config = config
        self.sleep = sleep
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.kubelet_conf = kubelet_conf
        self.states = StateStore(Path(config.state_dir))
        self.svids = SvidStore(Path(config.state_dir))
        self._report: bytes = b""
        self._grant: object = None

    # -- the driver -----------------------------------------------------------
    def run(self) -> Outcome:
        state = self.states.load()
        if self.states.joined() or state.step == Step.JOINED or self.kubelet_conf.exists():
            if not self.states.joined():
                self.states.mark_joined()
            state.step = Step.JOINED
            _notify("joined (nothing to do)")
            log.info("this node has already joined; nothing to do")
            return Outcome(True, state)
        if state.step == Step.KUBEADM_JOIN:
            # The token lived only in memory: ask for a new one.
            log.info("resuming after an interrupted join: requesting new credentials")
            state.step = Step.JOIN_REQUEST
        deadline = self.clock() + self.config.deadline_s
        steps: dict[Step, Callable[[State], Step]] = {
            Step.PREFLIGHT: self._preflight,
            Step.ATTEST: self._attest,
            Step.VERIFY: self._verify,
            Step.JOIN_REQUEST: self._join_request,
            Step.KUBEADM_JOIN: self._kubeadm_join,
        }
        while state.step != Step.JOINED:
            step = state.step
            _notify(f"{step}: running (attempt {state.attempts + 1})")
            try:
                next_step = steps[step](state)
            except AgentError as exc:
                state.attempts += 1
                state.last_error = LastError(str(step), exc.message, exc.hint, exc.permanent, self.clock())
                state.history.append({"at": self.clock(), "step": str(step), "error": exc.message})
                self.states.save(state)
                log.warning("%s failed (attempt %d): %s", step, state.attempts, exc.message)
                if exc.permanent:
                    _notify(f"{step}: stopped: {exc.message}")
                    raise
                delay = backoff(
                    state.attempts - 1, self.config.retry_initial_s, self.config.retry_max_s, self.rng
                )
                if self.clock() + delay > deadline:
                    _notify(f"{step}: giving up for now: {exc.message}")
                    raise
                _notify(f"{step}: {exc.message}; retrying in {delay:.0f} s")
                self.sleep(delay)
                if isinstance(exc, _Restart):
                    state.step = exc.step
                continue
            state.history.append({"at": self.clock(), "step": str(step), "ok": True})
            state.step = next_step
            state.attempts = 0
            state.last_error = None
            self.states.save(state)
            self._fault_hook(step)
        self.states.mark_joined()
        state.joined_at = self.clock()
        self.states.save(state)
        _notify("joined")
        return Outcome(True, state)

    @staticmethod
    def _fault_hook(step: Step) -> None:
        if os.environ.get(FAULT_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)

    # -- steps -----------------------------------------------------------------
    def _bundle(self) -> bytes:
        try:
            return Path(self.config.bundle).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the trust bundle {self.config.bundle}: {exc.strerror}",
                hint="install the server's bundle (nodeserver bundle) there, or set bundle",
            ) from exc

    def _preflight(self, state: State) -> Step:
        missing = self.config.missing_for_join()
        if missing:
            raise ConfigError(
                f"missing setting(s): {', '.join(missing)}",
                hint="set them in /etc/nodeagent/config.yaml, on the kernel command line (nodeagent.server=...) "
                "or as NODEAGENT_* environment variables",
            )
        self._bundle()
        from protocol.k8s import node_name_problem

        problem = node_name_problem(self.config.effective_node_name)
        if problem is not None:
            raise ConfigError(
                f"node name {self.config.effective_node_name!r}: {problem}", hint="set node_name"
            )
        from agent.tpm.attestor import TpmAttestor

        with TpmAttestor(self.config.tcti, ek_alg=self.config.ek_alg) as tpm:
            tpm.read_ek()
        return Step.ATTEST

    def _svid_valid_until(self) -> float:
        loaded = self.svids.load()
        if loaded is None:
            return 0.0
        cert: x509.Certificate = loaded[0]
        return cert.not_valid_after_utc.timestamp()

    def _attest(self, state: State) -> Step:
        if self._svid_valid_until() - self.clock() > self.config.reattest_before_s:
            log.info("the stored SVID is still valid; not attesting again")
            return Step.VERIFY
        from agent.attest_client import ServerTarget, attest

        target = ServerTarget.parse(self.config.server, self.config.trust_domain, self._bundle())
        svid = attest(
            target,
            tcti=self.config.tcti,
            state_dir=Path(self.config.state_dir),
            ek_alg=self.config.ek_alg,
            require_ek_cert=self.config.require_ek_cert,
            timeout=self.config.timeout_s,
        )
        state.spiffe_id = svid.spiffe_id
        state.svid_expires_at = svid.expires_at
        return Step.VERIFY

    def _verify(self, state: State) -> Step:
        from agent.checks import run_checks
        from agent.pool import load_pool
        from protocol.report import canonical_json

        spec = self.config.pool_profile or (
            "/etc/nodeagent/pool.yaml" if Path("/etc/nodeagent/pool.yaml").is_file() else self.config.pool
        )
        report = run_checks(load_pool(spec))
        self._report = canonical_json(report)
        state.verdict = "pass" if report.verdict.passed else "fail"
        if not report.verdict.passed:
            reasons = "; ".join(f"{f.check}: {f.reason}" for f in report.verdict.failures[:5])
            raise VerificationFailedError(
                f"the node fails its checks: {reasons}", hint="run `nodeagent check` to see every check"
            )
        return Step.JOIN_REQUEST

    def _join_request(self, state: State) -> Step:
        if not self._report:
            return Step.VERIFY  # resumed after a restart: the report is not kept on disk
        if self._svid_valid_until() - self.clock() <= self.config.reattest_before_s:
            raise _Restart(Step.ATTEST, "the SVID expires soon: attesting again first")
        from agent.errors import JoinRefusedError
        from agent.join_client import request_join_async

        try:
            self._grant = asyncio.run(
                request_join_async(
                    self.config.join_address,
                    trust_domain=self.config.trust_domain,
                    bundle_pem=self._bundle(),
                    svid_cert=self.svids.cert_path,
                    svid_key=self.svids.key_path,
                    pool=self.config.pool,
                    node_name=self.config.effective_node_name,
                    report=self._report,
                    timeout=self.config.timeout_s,
                )
            )
        except JoinRefusedError as exc:
            if "not attested" in exc.message:
                raise _Restart(Step.ATTEST, exc.message) from exc
            raise
        return Step.KUBEADM_JOIN

    def _kubeadm_join(self, state: State) -> Step:
        from agent.join_client import JoinGrant
        from agent.kubeadm import join_configuration, kubeadm_join, write_join_config

        grant = self._grant
        if not isinstance(grant, JoinGrant):
            return Step.JOIN_REQUEST
        self._grant = None  # one use only
        doc = join_configuration(
            token=grant.token,
            api_server_endpoint=grant.api_server_endpoint,
            ca_cert_hashes=grant.ca_cert_hashes,
            node_name=self.config.effective_node_name,
            taints=grant.taints,
            labels=grant.labels,
            kubelet_extra_args=grant.kubelet_extra_args,
            cri_socket=self.config.cri_socket,
        )
        path = Path(self.config.join_config)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_join_config(path, doc)
        try:
            kubeadm_join(path, kubeadm=self.config.kubeadm)
        except AgentError as exc:
            raise _Restart(Step.JOIN_REQUEST, exc.message, hint=exc.hint) from exc
        return Step.JOINED


class _Restart(AgentError):
    """A transient failure that sends the lifecycle back to an earlier step."""

    def __init__(self, step: Step, message: str, *, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.step = step


def status_lines(state_dir: Path) -> list[str]:
    """What ``nodeagent status`` prints."""
    store = StateStore(state_dir)
    try:
        state = store.load()
    except StateError as exc:
        return [f"state: unreadable ({exc.message})", f"what to do: {exc.hint}"]
    lines = [f"step: {'joined' if store.joined() else state.step}"]
    if state.spiffe_id:
        lines.append(f"identity: {state.spiffe_id}")
    if state.svid_expires_at:
        left = state.svid_expires_at - time.time()
        lines.append(f"SVID expires: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(state.svid_expires_at))}"
                     + (" (expired)" if left <= 0 else f" (in {left / 60:.0f} min)"))  # fmt: skip
    if state.verdict:
        lines.append(f"last verification: {state.verdict}")
    if state.updated_at:
        lines.append(f"updated: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(state.updated_at))}")
    if state.last_error is not None and not store.joined():
        e = state.last_error
        kind = (
            "permanent: fix it, then restart the agent"
            if e.permanent
            else f"transient, attempt {state.attempts}"
        )
        lines.append(f"last error ({e.step}, {kind}): {e.message}")
        if e.hint:
            lines.append(f"what to do: {e.hint}")
    return lines
