"""The optional stage of ``nodeagent run`` after the join: a DevID, then the image's SPIRE agent.

    joined -> devid_enrol -> spire_agent -> done

Configured by ``devid_enrol`` and ``spire_agent_unit`` (docs/settings.md); with neither, there is no
stage and ``nodeagent run`` ends at ``joined`` as before.

* ``devid_enrol``: the DevID files in ``devid_dir`` (default ``<state_dir>/devid``) are used as they
  are when they are fit (:func:`agent.devid_client.inspect`: present, the certificate for the key in
  ``devid.pub.blob``, valid for more than ``devid_renew_before_s``); otherwise the agent enrols a new
  DevID with nodeserver (:func:`agent.devid_client.enrol`, DevId/Enrol on the ``server`` port). A
  refusal that says the server no longer knows this node (``not_attested``) makes the agent attest
  with its EK again, once a run, and enrol again: never a new join.
* ``spire_agent``: ``systemctl start --no-block <spire_agent_unit>`` through the agent's subprocess
  chokepoint (:func:`agent.proc.run`); ``restart`` instead when this stage replaced a DevID that
  existed, so that a running spire-agent reads the new one. ``--no-block`` because the agent runs
  inside nodeagent.service's start job: the SPIRE agent's unit must not wait for it.

Every step is persisted (``State.after_join``) before the next one, and while the stage has work left
the ``after-join-pending`` marker exists in the state folder, so that nodeagent.service (whose
``ConditionPathExists=|`` lines admit a joined node with that marker) runs again after a crash, a
failure or a reboot, and resumes here. A failure is retried with the lifecycle's backoff until
``deadline_s``, is kept in ``State.after_join.last_error`` (``nodeagent status`` shows it next to the
join's success) and leaves the join alone: the ``joined`` marker stays, kubeadm is never run again.
A permanent failure (a ban, a missing unit) stops the run with its exit status, like the join's.

On a node where the stage is done, ``nodeagent run`` runs it again only when the DevID is no longer
fit (expiring, gone) or ``spire_agent_unit`` changed: ``nodeagent run`` by hand renews a DevID.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

from agent.config import AgentConfig
from agent.devid_client import DevidCheck, DevidFiles, inspect
from agent.errors import Action, AgentError, ConfigError, RefusalError, UnitMissingError, UnitStartError
from agent.lifecycle import backoff
from agent.proc import CommandError, Failure, run
from agent.sdnotify import status as notify
from agent.state import AfterJoin, AfterJoinStep, LastError, State, StateStore

log = logging.getLogger(__name__)

SYSTEMCTL_TIMEOUT_S = 60.0
# systemctl's exit statuses for a unit that is not there or cannot be loaded (systemd's exit-status.h:
# EXIT_NOTINSTALLED for BUS_ERROR_NO_SUCH_UNIT, EXIT_NOTCONFIGURED for BUS_ERROR_LOAD_FAILED).
SYSTEMCTL_NO_SUCH_UNIT = (5, 6)


def start_unit(unit: str, *, restart: bool = False) -> None:
    """``systemctl start --no-block UNIT`` (``restart`` with ``restart``); decided from the exit status only."""
    verb = "restart" if restart else "start"
    argv = ["systemctl", verb, "--no-block", unit]
    try:
        run(argv, timeout=SYSTEMCTL_TIMEOUT_S)
    except CommandError as exc:
        if exc.failure in (Failure.MISSING, Failure.NOT_RUNNABLE):
            raise UnitMissingError(
                f"cannot start {unit}: {exc.message}",
                hint="the agent starts units with systemctl: run it on the node image, or clear spire_agent_unit",
            ) from exc
        if exc.failure is Failure.EXIT and exc.returncode in SYSTEMCTL_NO_SUCH_UNIT:
            raise UnitMissingError(
                f"systemd has no loadable unit {unit}: {exc.message}",
                hint="set spire_agent_unit to the image's SPIRE agent unit (`systemctl list-unit-files 'spire*'`), "
                "or clear it",
            ) from exc
        raise UnitStartError(
            f"systemctl {verb} {unit} failed: {exc.message}",
            hint=f"see `systemctl status {unit}` and the journal; the agent retries",
        ) from exc
    log.info("asked systemd to %s %s", verb, unit)


class AfterJoinStage:
    """Runs the stage for one ``nodeagent run``; the lifecycle gives it its clock, sleep and EK attestation."""

    def __init__(
        self,
        config: AgentConfig,
        states: StateStore,
        *,
        sleep: Callable[[float], None],
        clock: Callable[[], float],
        rng: random.Random,
        bundle: Callable[[], bytes],
        attest_again: Callable[[State], None],
        fault_hook: Callable[[str], None],
    ) -> None:
        self.config = config
        self.states = states
        self.sleep = sleep
        self.clock = clock
        self.rng = rng
        self._bundle = bundle
        self._attest_again = attest_again
        self._fault_hook = fault_hook
        self._attest_first = False  # the server forgot this node: attest with the EK before enrolling
        self._attested_again = False  # once a run

    @property
    def files(self) -> DevidFiles:
        return DevidFiles(Path(self.config.devid_path))

    def due(self, state: State) -> bool:
        """Whether this run has work: the stage is configured and not done, or done with a DevID no longer fit."""
        if not self.config.after_join_wanted:
            return False
        after = state.after_join
        if after is None or after.step is not AfterJoinStep.DONE:
            return True
        if after.spire_agent_unit != self.config.spire_agent_unit:
            return True
        return self.config.devid_enrol and (not after.devid_id or not self._check().valid)

    def _check(self) -> DevidCheck:
        return inspect(
            self.files,
            trust_domain=self.config.trust_domain,
            now=self.clock(),
            renew_before_s=self.config.devid_renew_before_s,
        )

    # -- the driver --------------------------------------------------------------------------------
    def run(self, state: State) -> None:
        """Run the stage to ``done``; raise the :class:`AgentError` of a permanent failure or one past the deadline."""
        after = state.after_join
        if after is None:
            after = state.after_join = AfterJoin()
        if after.step is AfterJoinStep.DONE:
            after.step, after.done_at = AfterJoinStep.DEVID_ENROL, 0.0
        self.states.mark_after_join_pending()
        self.states.save(state)
        deadline = self.clock() + self.config.deadline_s
        steps: dict[AfterJoinStep, Callable[[State, AfterJoin], AfterJoinStep]] = {
            AfterJoinStep.DEVID_ENROL: self._devid_enrol,
            AfterJoinStep.SPIRE_AGENT: self._spire_agent,
        }
        while after.step is not AfterJoinStep.DONE:
            step = after.step
            notify(f"joined; {step}: running (attempt {after.attempts + 1})")
            try:
                next_step = steps[step](state, after)
            except AgentError as exc:
                self._failed(state, after, step, exc, deadline)
                continue
            state.history.append({"at": self.clock(), "step": str(step), "ok": True})
            after.step = next_step
            after.attempts = 0
            after.last_error = None
            if next_step is AfterJoinStep.DONE:
                after.done_at = self.clock()
            self.states.save(state)
            self._fault_hook(str(step))
        self.states.clear_after_join_pending()
        notify("joined; " + _summary(after))

    def _failed(
        self, state: State, after: AfterJoin, step: AfterJoinStep, exc: AgentError, deadline: float
    ) -> None:
        """Record a failure of the stage, then re-raise it (permanent, past the deadline) or wait and go on."""
        after.attempts += 1
        after.last_error = LastError.of(str(step), exc, self.clock())
        state.history.append(
            {"at": self.clock(), "step": str(step), "error": exc.message, "reason": exc.reason}
        )
        self.states.save(state)
        log.warning(
            "after the join, %s failed (attempt %d, %s): %s; the join stands",
            step,
            after.attempts,
            exc.reason,
            exc.message,
        )
        if exc.action is Action.ATTEST_AGAIN and not self._attested_again:
            self._attested_again = self._attest_first = True
            notify(f"joined; {step}: {exc.message}; attesting again")
            return
        if exc.permanent:
            notify(f"joined; {step}: stopped: {exc.message}")
            raise exc
        delay = backoff(after.attempts - 1, self.config.retry_initial_s, self.config.retry_max_s, self.rng)
        retry_after = exc.retry_after_s if isinstance(exc, RefusalError) else None
        if retry_after is not None:
            delay = max(delay, retry_after)
        if self.clock() + delay > deadline:
            notify(f"joined; {step}: giving up for now: {exc.message}")
            raise exc
        notify(f"joined; {step}: {exc.message}; retrying in {delay:.0f} s")
        self.sleep(delay)
        if exc.action is Action.ATTEST_AGAIN:
            self._attest_first = True

    # -- steps -------------------------------------------------------------------------------------
    def _devid_enrol(self, state: State, after: AfterJoin) -> AfterJoinStep:
        if not self.config.devid_enrol:
            return AfterJoinStep.SPIRE_AGENT
        files = self.files
        check = self._check()
        if check.valid:
            log.info("the DevID in %s is valid until %d: not enrolling", files.directory, check.expires_at)
            after.devid_id, after.devid_expires_at = check.agent_id, check.expires_at
            return AfterJoinStep.SPIRE_AGENT
        log.info("enrolling a DevID (%s: %s)", check.problem, check.detail)
        if self._attest_first:
            self._attest_again(state)
            self._attest_first = False
        from agent.attest_client import ServerTarget
        from agent.devid_client import enrol

        try:
            target = ServerTarget.parse(self.config.server, self.config.trust_domain, self._bundle())
        except ValueError as exc:
            raise ConfigError(
                str(exc), hint="set server to HOST:PORT, e.g. attest.example.org:8081"
            ) from exc
        replacing = files.cert_path.exists()  # spire-agent may be running with the old one
        done = enrol(target, tcti=self.config.tcti, files=files, timeout=self.config.timeout_s)
        after.devid_id, after.devid_expires_at = done.agent_id, done.expires_at
        after.devid_enrolled_at = self.clock()
        after.devid_replaced = after.devid_replaced or replacing
        return AfterJoinStep.SPIRE_AGENT

    def _spire_agent(self, state: State, after: AfterJoin) -> AfterJoinStep:
        unit = self.config.spire_agent_unit
        if unit:
            start_unit(unit, restart=after.devid_replaced)
            after.spire_agent_started_at = self.clock()
        after.spire_agent_unit = unit
        after.devid_replaced = False
        return AfterJoinStep.DONE


def _summary(after: AfterJoin) -> str:
    parts = []
    if after.devid_id:
        parts.append(f"DevID {after.devid_id}")
    if after.spire_agent_unit:
        parts.append(f"{after.spire_agent_unit} started")
    return ", ".join(parts) or "nothing after the join"
