"""Ctrl-C and SIGTERM: they stop a build in any phase, and its clean-up runs to the end.

:func:`stop_on_signals` (the commands ``imagebuilder build`` and ``imagebuilder test`` run inside it)
installs one handler for SIGINT and SIGTERM, whatever the process inherited. That matters: a
process started in the background by a non-interactive shell (``make test &``, ``nohup``, many CI
runners) inherits SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler at all,
so a Ctrl-C or ``kill -INT`` would be lost and the build would run on, publish and exit 0.

* The first signal raises :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, wherever
  the build is: the ``with`` blocks and ``finally`` clauses on the way out remove the VM, stop the
  host processes, delete the work directory and the unpublished folder. The command exits 130.
* Further signals while that clean-up runs are logged and ignored: a second Ctrl-C must not leave a
  domain defined or a work directory half-deleted. (SIGKILL still stops the builder; the next build
  on the host removes the domain it left, :func:`imagebuilder.vm.remove_orphans`.)
* :func:`deferred` holds signals back for a step that must not stop halfway (a clean-up); one that
  arrived meanwhile is raised when the step ends.
* :func:`commit` runs the step that decides the outcome (the rename that publishes the folder): a
  signal that arrived before it stops the build instead; one that arrives during or after it is too
  late to undo anything and is ignored (the build is published and exits 0).

Without :func:`stop_on_signals` (a library caller) these helpers just run the step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


class Interrupted(KeyboardInterrupt):
    """The build was stopped by a signal (SIGINT or SIGTERM); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class _State:
    stopping: bool = False  # an Interrupted was raised: clean-up is running
    done: bool = False  # the outcome is decided (published): nothing to stop any more
    deferring: int = 0
    pending: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            log.warning(
                "%s: already stopping; the clean-up runs to its end (SIGKILL leaves the VM behind)", name
            )
            return
        if self.done:
            log.warning("%s: too late, the build is already published", name)
            return
        if self.deferring:
            if self.pending is None:
                log.warning("%s: stopping once the current step is done", name)
                self.pending = signum
            return
        self.stopping = True
        raise Interrupted(signum)

    def raise_pending(self) -> None:
        if self.pending is not None and not self.done and not self.stopping:
            signum, self.pending = self.pending, None
            self.stopping = True
            raise Interrupted(signum)


_active: list[_State] = []  # innermost last; empty: no handler of ours is installed


def _current() -> _State | None:
    return _active[-1] if _active else None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM stop what runs inside (main thread only); the previous handlers come back after."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    state = _State()
    _active.append(state)
    try:
        for sig in SIGNALS:
            signal.signal(sig, state.handle)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _active.remove(state)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Signals wait until the block is done (then the first of them is raised, unless an error already
    propagates or the build is published)."""
    state = _current()
    if state is None:
        yield
        return
    state.deferring += 1
    try:
        yield
    finally:
        state.deferring -= 1
    if state.deferring == 0:
        state.raise_pending()


def commit(action: Callable[[], T]) -> T:
    """Run the step that publishes: a signal that came before it stops the build; from then on, the
    build is done and signals are ignored."""
    state = _current()
    if state is None:
        return action()
    state.deferring += 1
    try:
        state.raise_pending()
        result = action()
        state.done = True
        return result
    finally:
        state.deferring -= 1
