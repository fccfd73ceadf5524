"""Progress on the console: bytes done, rate and time left, for every long step.

On a terminal one line is redrawn; elsewhere (a serial console logged by a BMC, a test) a line is
printed every :data:`EVERY_S` seconds and at the end, so a log shows the rate without flooding.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

EVERY_S = 5.0


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(
        self, what: str, total: int, *, stream: TextIO | None = None, every_s: float = EVERY_S
    ) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.25 if self.tty else every_s
        self.started = time.monotonic()
        self._last = self.started

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.started, 1e-6)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"{self.what}: {human(self.done)} of {human(self.total)} ({pct:5.1f}%), "
            f"{human(rate)}/s, {duration(left)} left"
        )

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._emit(self.line(now), final=False)

    def set(self, done: int) -> None:
        self.update(done - self.done)

    def finish(self) -> float:
        """Print the closing line; returns the seconds the step took."""
        now = time.monotonic()
        elapsed = now - self.started
        rate = self.done / max(elapsed, 1e-6)
        self._emit(f"{self.what}: {human(self.done)} in {duration(elapsed)} ({human(rate)}/s)", final=True)
        return elapsed

    def _emit(self, text: str, *, final: bool) -> None:
        try:
            if self.tty:
                self.stream.write("\r\033[K" + text + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a console that went away must not stop the write
