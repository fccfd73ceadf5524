"""Downloads: HTTP(S) with ``Range`` resume, ``file://`` copies, and a progress display.

:func:`download` appends to a partial file: when the partial already holds bytes, an
HTTP request asks for the rest (``Range: bytes=N-``); a server that answers 200
instead of 206 restarts the file. A transient failure (a timeout, a reset or refused
connection, HTTP 408/429/5xx, a body cut short) is retried with a doubling pause
(:class:`Retry`, three attempts by default), resuming where the last attempt stopped; a
definite answer (404, 403, ...) is not. Digests are not checked here: :mod:`imagebuilder.cache`
owns verification. Progress goes to stderr as a bar when stderr is a terminal, as a
log line every 10 seconds otherwise.
"""

from __future__ import annotations

import logging
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, TextIO, TypeVar

from imagebuilder.errors import FetchError

log = logging.getLogger(__name__)

USER_AGENT = "nodetrust-imagebuilder/0.1 (+https://nodetrust.dev)"
CHUNK = 1 << 20
LOG_EVERY_S = 10.0
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
T = TypeVar("T")


@dataclass(frozen=True)
class Retry:
    """How hard one URL is tried before the next mirror (or the error) is reached."""

    attempts: int = 3
    backoff_s: float = 1.0  # the pause before the second attempt; it doubles after each one
    timeout_s: float = 60.0  # per connection and per read

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise ValueError(f"invalid retry policy {self}")


DEFAULT_RETRY = Retry()


class _Transient(FetchError):
    """A failure worth another attempt at the same URL."""


def _with_retries(retry: Retry, attempt: Callable[[], T]) -> T:
    pause = retry.backoff_s
    for number in range(1, retry.attempts + 1):
        try:
            return attempt()
        except _Transient as exc:
            if number == retry.attempts:
                raise FetchError(exc.message, hint=exc.hint) from exc
            log.warning(
                "%s (attempt %d of %d; retrying in %.0f s)", exc.message, number, retry.attempts, pause
            )
            time.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def _http_failure(name: str, url: str, exc: Exception) -> FetchError:
    if isinstance(exc, urllib.error.HTTPError):
        kind = _Transient if exc.code in TRANSIENT_HTTP else FetchError
        return kind(f"{name}: GET {url}: HTTP {exc.code} {exc.reason}")
    return _Transient(f"{name}: GET {url}: {getattr(exc, 'reason', exc)}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class Progress:
    """A progress bar on a terminal, periodic log lines otherwise."""

    def __init__(
        self, name: str, total: int | None, *, start: int = 0, stream: TextIO | None = None
    ) -> None:
        self.name = name
        self.total = total
        self.done = start
        self.started = time.monotonic()
        self.start_bytes = start
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0 if self.tty else self.started

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and now - self._last >= 0.2:
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self.tty and now - self._last >= LOG_EVERY_S:
            self._last = now
            log.info("%s", self._line(now))

    def _line(self, now: float) -> str:
        rate = (self.done - self.start_bytes) / max(now - self.started, 1e-3)
        if self.total:
            pct = 100.0 * self.done / self.total
            width = 30
            filled = int(width * min(pct, 100.0) / 100)
            bar = "#" * filled + "-" * (width - filled)
            return (
                f"{self.name} [{bar}] {pct:5.1f}% {_human(self.done)}/{_human(self.total)} {_human(rate)}/s"
            )
        return f"{self.name} {_human(self.done)} {_human(rate)}/s"

    def finish(self) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + self._line(now) + "\n")
            self.stream.flush()
        elif now - self.started >= LOG_EVERY_S / 5:
            log.info("%s (done)", self._line(now))
        else:
            log.debug("%s (done)", self._line(now))


def _copy(source: BinaryIO | IO[bytes], sink: BinaryIO | IO[bytes], progress: Progress) -> None:
    while chunk := source.read(CHUNK):
        sink.write(chunk)
        progress.update(len(chunk))


def download(
    url: str, partial: Path, *, name: str, retry: Retry = DEFAULT_RETRY, resume: bool = True
) -> None:
    """Bring ``partial`` to the full content of ``url``, resuming from its current size.

    ``resume=False`` starts every attempt from the first byte: for content no digest pins, where
    two attempts could splice two versions of the file into one.
    """
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("file", "http", "https"):
        raise FetchError(f"{name}: unsupported URL scheme in {url}", hint="use http://, https:// or file://")

    def attempt() -> None:
        if not resume:
            partial.unlink(missing_ok=True)
        if scheme == "file":
            _download_file(url, partial, name=name)
        else:
            _download_http(url, partial, name=name, timeout=retry.timeout_s)

    if scheme == "file":
        attempt()  # a local copy: nothing transient to retry
    else:
        _with_retries(retry, attempt)


def _download_file(url: str, partial: Path, *, name: str) -> None:
    source = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
    try:
        total = source.stat().st_size
        have = partial.stat().st_size if partial.exists() else 0
        if have > total:
            partial.unlink()
            have = 0
        with source.open("rb") as src, partial.open("ab") as dst:
            src.seek(have)
            progress = Progress(name, total, start=have)
            _copy(src, dst, progress)
            progress.finish()
    except OSError as exc:
        raise FetchError(f"{name}: cannot read {source}: {exc.strerror}") from exc


def _download_http(url: str, partial: Path, *, name: str, timeout: float) -> None:
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - scheme checked by download()
    try:
        response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:
            # Range not satisfiable: the partial is already complete (or longer than the file)
            log.debug("%s: server says the partial download (%d bytes) is complete", name, have)
            return
        raise _http_failure(name, url, exc) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise _http_failure(name, url, exc) from exc
    with response:
        status = response.status
        length = response.headers.get("Content-Length")
        if have and status == 206:
            mode = "ab"
            total = have + int(length) if length else None
            log.info("%s: resuming at %s", name, _human(have))
        else:
            mode = "wb"
            have = 0
            total = int(length) if length else None
        progress = Progress(name, total, start=have)
        try:
            with partial.open(mode) as dst:
                _copy(response, dst, progress)
        except (OSError, urllib.error.URLError) as exc:
            raise _Transient(
                f"{name}: download from {url} broke off: {exc}",
                hint="run the command again: the download resumes where it stopped",
            ) from exc
        progress.finish()
    if total is not None and partial.stat().st_size != total:
        raise _Transient(
            f"{name}: download from {url} ended at {partial.stat().st_size} of {total} bytes",
            hint="run the command again: the download resumes where it stopped",
        )


def fetch_small(url: str, *, name: str, limit: int = 64 * 2**20, retry: Retry = DEFAULT_RETRY) -> bytes:
    """Read a small document (checksum file, signature, apt index) into memory, uncached."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme == "file":
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        try:
            return path.read_bytes()
        except OSError as exc:
            raise FetchError(f"{name}: cannot read {path}: {exc.strerror}") from exc
    if scheme not in ("http", "https"):
        raise FetchError(f"{name}: unsupported URL scheme in {url}")
    data = _with_retries(retry, lambda: _get_small(url, name=name, limit=limit, timeout=retry.timeout_s))
    if len(data) > limit:
        raise FetchError(f"{name}: {url} is larger than {_human(limit)}")
    return data


def _get_small(url: str, *, name: str, limit: int, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            data: bytes = response.read(limit + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise _http_failure(name, url, exc) from exc
    return data
