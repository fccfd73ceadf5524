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
  the agent attests again before it expires, or at once when the broker no
  longer knows it;
* a JoinConfiguration left in ``join_config`` by a killed run (it holds a
  token) is removed at the start of every run and on every way out;
* a ``kubeadm join`` that failed after its preflight phase (or was killed, or timed out) may have left
  a partial join behind (``/etc/kubernetes/bootstrap-kubelet.conf``, ``pki/ca.crt``, a started kubelet)
  that makes every later try fail at once; the agent marks each run of kubeadm join in
  ``<state_dir>/kubeadm-join-unfinished`` before it starts and clears the mark after a success or a
  failure in preflight (which writes nothing), so the next try runs ``kubeadm reset -f`` first when,
  and only when, an earlier try of its own may have left something. Never after a success: a joined
  node (the marker, ``/etc/kubernetes/kubelet.conf``) ends the run before any of this;
* the join answer's Kubernetes version selects what runs (agent.kubeversion): before ``kubeadm join`` the
  agent installs that version's staged debs offline and holds them, or refuses a version the image does
  not carry (``KubernetesVersionError``, permanent, nothing installed); the version is kept in the state
  (``kubernetes_version``), so ``nodeagent status`` shows it and the next verification's skew check
  judges it;
* after ``kubeadm join`` succeeds the agent reports it to the broker
  (Join.ReportJoined), which revokes the token at once; a failed report is
  logged and retried a few times, and never undoes the join;
* then, when configured (``devid_enrol``, ``spire_agent_unit``), the stage after the join
  (:mod:`agent.after_join`): a DevID for SPIRE's ``tpm_devid`` unless a valid one is there, then
  ``systemctl start --no-block`` of the image's SPIRE agent unit. It has its own persisted steps,
  error and retries, and a marker (``after-join-pending``) that makes nodeagent.service run again on
  a joined node until it is done; its failures never undo the join.

What a failure leads to comes from its class (:mod:`agent.errors`) and, for the
server's refusals, from the one table in :mod:`agent.refusals`: the exit status,
whether it is permanent, and the action (attest again, ask for a new token).

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
from typing import TYPE_CHECKING

from cryptography import x509

from agent.config import AgentConfig
from agent.errors import (
    Action,
    AgentError,
    ConfigError,
    KubeadmError,
    KubeadmFailedError,
    RefusalError,
    VerificationFailedError,
)
from agent.files import FileTooLargeError, ensure_private_dir, read_bounded, write_atomic
from agent.state import LastError, State, StateStore, Step
from agent.status import status_doc, status_lines
from agent.svid import SvidStore

if TYPE_CHECKING:
    from agent.after_join import AfterJoinStage

__all__ = ["Lifecycle", "Outcome", "VerificationFailedError", "backoff", "status_doc", "status_lines"]

log = logging.getLogger(__name__)
KUBELET_CONF = Path("/etc/kubernetes/kubelet.conf")
FAULT_ENV = "NODEAGENT_FAULT_KILL_AFTER"
MAX_BUNDLE_BYTES = 1024 * 1024
REPORT_ATTEMPTS = 3  # Join.ReportJoined tries; the token's TTL and the broker's own revocation back it up
REPORT_TIMEOUT_S = 15.0
UNFINISHED_JOIN_MARKER = "kubeadm-join-unfinished"


@dataclass
class Outcome:
    joined: bool
    state: State
    after_join: str = ""  # the stage after the join: "" (none), else its step (``done`` when finished)


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
        image_info: Path | None = None,
    ) -> None:
        self.config = config
        self.sleep = sleep
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.kubelet_conf = kubelet_conf
        self.image_info = image_info or Path(config.image_info)  # what the image carries (agent.kubeversion)
        self.states = StateStore(Path(config.state_dir))
        self.svids = SvidStore(Path(config.state_dir))
        self._report: bytes = b""
        self._grant: object = None
        self._policy: object = None
        self._force_attest = False  # the broker no longer knows the SVID: attest even while it is valid
        self._attested_again = False  # ATTEST_AGAIN is honoured once a run

    # -- the driver -----------------------------------------------------------
    def run(self) -> Outcome:
        self._remove_join_config()  # a killed run may have left one, with its token
        try:
            return self._run()
        finally:
            self._remove_join_config()

    def _run(self) -> Outcome:
        state = self.states.load()
        if self.states.joined() or state.step == Step.JOINED or self.kubelet_conf.exists():
            state.step = Step.JOINED
            stage = self._after_join_stage()
            due = stage.due(state)
            if due:  # before the joined marker, so that the unit runs again if this run dies
                self.states.mark_after_join_pending()
            if not self.states.joined():
                self.states.mark_joined()
            if not due:
                self.states.clear_after_join_pending()
                _notify("joined (nothing to do)")
                log.info("this node has already joined; nothing to do")
                return self._outcome(state)
            log.info("this node has already joined; the stage after the join has work left")
            stage.run(state)
            return self._outcome(state)
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
                self._failed(state, step, exc, deadline)
                continue
            state.history.append({"at": self.clock(), "step": str(step), "ok": True})
            state.step = next_step
            state.attempts = 0
            state.last_error = None
            self.states.save(state)
            self._fault_hook(step)
        stage = self._after_join_stage()
        due = stage.due(state)
        if due:  # before the joined marker, so that the unit runs again if this run dies
            self.states.mark_after_join_pending()
        self.states.mark_joined()
        state.joined_at = self.clock()
        self.states.save(state)
        _notify("joined")
        if due:
            stage.run(state)  # raises a failure of its own; the join stands
        return self._outcome(state)

    @staticmethod
    def _outcome(state: State) -> Outcome:
        return Outcome(True, state, str(state.after_join.step) if state.after_join is not None else "")

    def _after_join_stage(self) -> AfterJoinStage:
        from agent.after_join import AfterJoinStage

        def attest_again(state: State) -> None:
            self._force_attest = True
            self._attest(state)
            self.states.save(state)

        return AfterJoinStage(
            self.config,
            self.states,
            sleep=self.sleep,
            clock=self.clock,
            rng=self.rng,
            bundle=self._bundle,
            attest_again=attest_again,
            fault_hook=self._fault_hook,
        )

    def _failed(self, state: State, step: Step, exc: AgentError, deadline: float) -> None:
        """Record a failure, then re-raise it (permanent, or past the deadline) or wait and go on."""
        state.attempts += 1
        state.last_error = LastError.of(str(step), exc, self.clock())
        state.history.append(
            {"at": self.clock(), "step": str(step), "error": exc.message, "reason": exc.reason}
        )
        self.states.save(state)
        log.warning("%s failed (attempt %d, %s): %s", step, state.attempts, exc.reason, exc.message)
        if exc.action is Action.ATTEST_AGAIN and not self._attested_again:
            # Attest anew at once (the SVID may be valid but unknown to the server); once a run,
            # so that a refusal the detail cannot tell apart from "not attested" still stops.
            self._attested_again = self._force_attest = True
            _notify(f"{step}: {exc.message}; attesting again")
            log.info("attesting again: %s", exc.hint)
            state.step = Step.ATTEST
            return
        if exc.permanent:
            _notify(f"{step}: stopped: {exc.message}")
            raise exc
        delay = backoff(state.attempts - 1, self.config.retry_initial_s, self.config.retry_max_s, self.rng)
        retry_after = exc.retry_after_s if isinstance(exc, RefusalError) else None
        if retry_after is not None:
            delay = max(delay, retry_after)
        if self.clock() + delay > deadline:
            _notify(f"{step}: giving up for now: {exc.message}")
            raise exc
        _notify(f"{step}: {exc.message}; retrying in {delay:.0f} s")
        self.sleep(delay)
        if exc.action is Action.NEW_TOKEN:
            state.step = Step.JOIN_REQUEST
        elif exc.action is Action.ATTEST_AGAIN:
            self._force_attest = True
            state.step = Step.ATTEST

    def _remove_join_config(self) -> None:
        path = Path(self.config.join_config)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error(
                "could not remove the join configuration %s (it holds a token): %s", path, exc.strerror
            )
            return
        log.warning("removed a join configuration left behind by an interrupted run: %s", path)

    @staticmethod
    def _fault_hook(step: str) -> None:
        if os.environ.get(FAULT_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)

    # -- steps -----------------------------------------------------------------
    def _bundle(self) -> bytes:
        try:
            return read_bounded(Path(self.config.bundle), MAX_BUNDLE_BYTES)
        except FileTooLargeError as exc:
            raise ConfigError(
                f"the trust bundle {self.config.bundle} is not a bundle: {exc}",
                hint="install the server's bundle (nodeserver bundle) there, or set bundle",
            ) from exc
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
        if (
            not self._force_attest
            and self._svid_valid_until() - self.clock() > self.config.reattest_before_s
        ):
            log.info("the stored SVID is still valid; not attesting again")
            return Step.VERIFY
        from agent.attest_client import ServerTarget, attest

        try:
            target = ServerTarget.parse(self.config.server, self.config.trust_domain, self._bundle())
        except ValueError as exc:
            raise ConfigError(
                str(exc), hint="set server to HOST:PORT, e.g. attest.example.org:8081"
            ) from exc
        svid = attest(
            target,
            tcti=self.config.tcti,
            state_dir=Path(self.config.state_dir),
            ek_alg=self.config.ek_alg,
            require_ek_cert=self.config.require_ek_cert,
            timeout=self.config.timeout_s,
        )
        self._force_attest = False
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
        policy = load_pool(spec)
        self._policy = policy
        report = run_checks(policy, selected_kubernetes=state.kubernetes_version, image_info=self.image_info)
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
            log.info("the SVID expires within reattest_before_s: attesting again first")
            return Step.ATTEST
        from agent.join_client import begin_join_async, request_join_async
        from agent.tpm.quote import make_evidence

        bundle = self._bundle()
        asked = asyncio.run(
            begin_join_async(
                self.config.join_address,
                trust_domain=self.config.trust_domain,
                bundle_pem=bundle,
                svid_cert=self.svids.cert_path,
                svid_key=self.svids.key_path,
                pool=self.config.pool,
                timeout=self.config.timeout_s,
            )
        )
        evidence = None
        if asked is not None:
            # The pool checks measured boot: a quote over its nonce, by the AK the server activated.
            evidence = make_evidence(
                self.config.tcti, self.svids.load_ak(), asked, Path(self.config.event_log)
            )
        self._grant = asyncio.run(
            request_join_async(
                self.config.join_address,
                trust_domain=self.config.trust_domain,
                bundle_pem=bundle,
                svid_cert=self.svids.cert_path,
                svid_key=self.svids.key_path,
                pool=self.config.pool,
                node_name=self.config.effective_node_name,
                report=self._report,
                evidence=evidence,
                timeout=self.config.timeout_s,
            )
        )
        return Step.KUBEADM_JOIN

    def _kubeadm_join(self, state: State) -> Step:
        from agent.join_client import JoinGrant, token_id
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
        public_id = token_id(grant.token)
        self._kubernetes_version(state, grant.kubernetes_version)
        self._undo_unfinished_join()
        path = Path(self.config.join_config)
        ensure_private_dir(path.parent, what="folder of the join configuration")
        write_join_config(path, doc)
        unfinished = self._unfinished_marker
        write_atomic(
            unfinished,
            b"kubeadm join started; a failure after preflight may leave a partial join\n",
            mode=0o600,
        )
        try:
            kubeadm_join(path, kubeadm=self.config.kubeadm)  # a KubeadmError asks for a new token
        except KubeadmFailedError as exc:
            if exc.failure is not None and exc.failure.node_untouched:
                unfinished.unlink(missing_ok=True)  # it stopped in preflight: nothing to undo
            raise
        except KubeadmError:
            unfinished.unlink(missing_ok=True)  # kubeadm never ran (missing, not executable, no file)
            raise
        unfinished.unlink(missing_ok=True)
        self.report_joined(public_id)
        return Step.JOINED

    def _kubernetes_version(self, state: State, answer: str) -> None:
        """Make the answer's Kubernetes version the installed one (agent.kubeversion), or refuse it."""
        from agent import kubeversion
        from agent.errors import KubernetesVersionError

        image = kubeversion.carried(self.image_info)
        if image is None:
            log.info(
                "the image says nothing of the Kubernetes versions it carries: the installed kubelet runs"
            )
            return
        version = kubeversion.select(answer, image)
        predicted = kubeversion.predict(
            image,
            selected=state.kubernetes_version,
            control_plane=getattr(self._policy, "control_plane_version", None) or "",
        )
        if version != predicted:
            # The verification judged another version: judge this one under the same skew rule before installing.
            problem = self._skew_problem(version, image)
            if problem:
                raise KubernetesVersionError(
                    f"the join answer asks for Kubernetes {version}, which the pool's skew policy refuses for this "
                    f"node: {problem}: nothing was installed",
                    hint="make the pool's kubernetes_version and its profile's node.control_plane_version agree",
                )
        if state.kubernetes_version != version:
            state.kubernetes_version = version
            self.states.save(state)
        kubeversion.activate(version, image)

    def _skew_problem(self, version: str, image: object) -> str:
        """Why ``node.kubelet`` would fail with ``version`` running (empty: it passes)."""
        from agent.kubeversion import Carried
        from protocol.policy import PoolPolicy, assess
        from protocol.report import JsonValue, Observation, Status

        if not isinstance(self._policy, PoolPolicy) or not isinstance(image, Carried):
            return ""
        carried: list[JsonValue] = list(image.versions)
        observed = Observation(
            "node.kubelet",
            "`kubelet --version`",
            {
                "version": version,
                "raw": f"Kubernetes v{version}",
                "error": None,
                "will_run": version,
                "carried": carried,
            },
        )
        checks, _ = assess([observed], self._policy)
        check = next(c for c in checks if c.name == "node.kubelet")
        return check.reason if check.status is Status.FAIL else ""

    @property
    def _unfinished_marker(self) -> Path:
        return Path(self.config.state_dir) / UNFINISHED_JOIN_MARKER

    def _undo_unfinished_join(self) -> None:
        """``kubeadm reset -f`` when an earlier kubeadm join of this agent may have left a partial join."""
        from agent.kubeadm import kubeadm_reset

        if not self._unfinished_marker.exists():
            return
        if self.kubelet_conf.exists():  # never undo a join that finished
            self._unfinished_marker.unlink(missing_ok=True)
            return
        log.warning("an earlier kubeadm join on this node did not finish: undoing it before trying again")
        kubeadm_reset(kubeadm=self.config.kubeadm, cri_socket=self.config.cri_socket)
        self._unfinished_marker.unlink(missing_ok=True)

    def report_joined(self, public_id: str) -> None:
        """Tell the broker the token was used, so it revokes it now; never undoes the join."""
        from agent.join_client import report_joined_async

        for attempt in range(REPORT_ATTEMPTS):
            try:
                revoked = asyncio.run(
                    report_joined_async(
                        self.config.join_address,
                        trust_domain=self.config.trust_domain,
                        bundle_pem=self._bundle(),
                        svid_cert=self.svids.cert_path,
                        svid_key=self.svids.key_path,
                        token_id=public_id,
                        node_name=self.config.effective_node_name,
                        timeout=min(self.config.timeout_s, REPORT_TIMEOUT_S),
                    )
                )
            except AgentError as exc:
                log.warning(
                    "could not report the join to the broker (attempt %d of %d, %s): %s",
                    attempt + 1,
                    REPORT_ATTEMPTS,
                    exc.reason,
                    exc.message,
                )
                if exc.permanent:
                    break
            except Exception:  # the join succeeded: nothing here may undo it
                log.exception("reporting the join to the broker failed unexpectedly")
                break
            else:
                log.info(
                    "reported the join to the broker: token %s %s",
                    public_id,
                    "revoked" if revoked else "was already gone",
                )
                return
            if attempt + 1 < REPORT_ATTEMPTS:
                self.sleep(backoff(attempt, self.config.retry_initial_s, self.config.retry_max_s, self.rng))
        log.warning(
            "the broker was not told of the join: token %s stays valid until it expires (its TTL)", public_id
        )
