"""Fetching over HTTP and HTTPS only, every body bounded before it is read.

* Only ``http://`` and ``https://`` URLs are fetched. ``file://``, other schemes and device paths
  (``/dev/sda``: no scheme at all) are refused before any connection (CVE-2025-44021 was a
  ``file://`` source in Ironic).
* Redirects are followed (at most :data:`MAX_REDIRECTS`) only to ``http``/``https``, and never
  from ``https`` down to ``http``.
* A body is read up to a limit the caller gives: the signed size of an artifact, or a small cap
  for a signature or a manifest. A ``Content-Length`` above the limit is refused before the body
  is read; a body that keeps coming past it is cut off and refused; one that ends early is refused
  as truncated.
* A transient failure (a refused, reset or timed-out connection, HTTP 408/429/5xx, a body cut
  short) is retried :attr:`Fetcher.attempts` times with a pause; a stream resumes with ``Range``
  where the server supports it, and every byte still goes through the caller's digest.

No proxy is read from the environment: the boot environment talks to the release server only.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import struct
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from imager.errors import ImagerError, Reason

log = logging.getLogger(__name__)

USER_AGENT = "nodetrust-imager/0.1"
MAX_REDIRECTS = 5
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def check_url(url: str, *, what: str = "source") -> urllib.parse.SplitResult:
    """``url`` split, if it is an http(s) URL with a host and no credentials; ImagerError otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        shown = url if len(url) <= 120 else url[:117] + "..."
        kind = f"a {parts.scheme}:// URL" if parts.scheme else "not a URL (a local path or device?)"
        raise ImagerError(
            Reason.scheme_refused,
            f"{what} {shown!r} is {kind}; the imager fetches over http:// and https:// only",
            hint="serve the release folder over HTTP(S) and pass its URL (nodeimager.release=http://...)",
        )
    if not parts.hostname:
        raise ImagerError(Reason.scheme_refused, f"{what} {url!r} has no host", hint="give a full URL")
    if parts.username is not None or parts.password is not None:
        raise ImagerError(
            Reason.scheme_refused,
            f"{what} {parts.scheme}://{parts.hostname}/...: credentials in a URL are refused (they end up in logs)",
            hint="authenticate the release server by TLS, not by a password in the URL",
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ImagerError(Reason.scheme_refused, f"{what} {url!r} has an invalid port") from None
    return parts


def join(base: str, name: str) -> str:
    """The URL of file ``name`` in the folder ``base``."""
    return urllib.parse.urljoin(base if base.endswith("/") else base + "/", urllib.parse.quote(name))


class Sink(Protocol):
    """Where a stream goes: :meth:`buffer` is the (non-empty) memory to read into next, and
    :meth:`filled` says how many bytes of it were read."""

    def buffer(self) -> memoryview: ...

    def filled(self, n: int) -> None: ...


class _Transient(ImagerError):
    """A failure worth another attempt."""


@dataclass
class Fetcher:
    timeout_s: float = 30.0
    attempts: int = 3
    pause_s: float = 2.0
    cafile: str | None = None
    user_agent: str = USER_AGENT
    _context: ssl.SSLContext | None = field(default=None, repr=False)

    def _ssl(self) -> ssl.SSLContext:
        if self._context is None:
            self._context = ssl.create_default_context(cafile=self.cafile)
            self._context.minimum_version = ssl.TLSVersion.TLSv1_2
        return self._context

    def _connect(self, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        host, port = parts.hostname or "", parts.port
        if parts.scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=self._ssl())
        return http.client.HTTPConnection(host, port, timeout=self.timeout_s)

    def _open(
        self, url: str, *, name: str, offset: int = 0
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str, socket.socket | None]:
        """GET ``url`` following allowed redirects: the connection, the response, the final URL and the socket."""
        current = url
        parts = check_url(current, what=name)
        for _ in range(MAX_REDIRECTS + 1):
            conn = self._connect(parts)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            headers = {"User-Agent": self.user_agent, "Accept-Encoding": "identity"}
            if offset:
                headers["Range"] = f"bytes={offset}-"
            try:
                conn.request("GET", target, headers=headers)
                sock = conn.sock  # getresponse() drops it from conn when the server will close
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _Transient(
                    Reason.network,
                    f"{name}: GET {current}: {_describe(exc)}",
                    hint="check the release server is up and reachable from this network (DHCP, routes, firewall)",
                ) from None
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location") or ""
                response.close()
                conn.close()
                following = urllib.parse.urljoin(current, location)
                new = urllib.parse.urlsplit(following)
                if new.scheme not in ("http", "https") or (parts.scheme == "https" and new.scheme == "http"):
                    raise ImagerError(
                        Reason.redirect_refused,
                        f"{name}: {current} redirects to {following[:120]!r}; only redirects to http(s), and never "
                        "from https to http, are followed",
                        hint="serve the release where the boot script points, or fix the server's redirect",
                    )
                parts = check_url(following, what=name)
                current = following
                continue
            return conn, response, current, sock
        raise ImagerError(Reason.redirect_refused, f"{name}: more than {MAX_REDIRECTS} redirects from {url}")

    def _status(self, response: http.client.HTTPResponse, url: str, name: str, *, ranged: bool) -> None:
        if response.status == 200 or (ranged and response.status == 206):
            return
        message = f"{name}: GET {url}: HTTP {response.status} {response.reason}"
        kind = _Transient if response.status in TRANSIENT_STATUS else ImagerError
        raise kind(
            Reason.http_error,
            message,
            hint="check that the release folder is published completely at that URL"
            if response.status == 404
            else "check the release server's log",
        )

    def _retrying(self, action: Callable[[], None]) -> None:
        pause = self.pause_s
        for attempt in range(1, self.attempts + 1):
            try:
                action()
                return
            except _Transient as exc:
                if attempt == self.attempts:
                    raise ImagerError(exc.reason, exc.message, hint=exc.hint) from None
                log.warning(
                    "%s (attempt %d of %d; again in %.0f s)", exc.message, attempt, self.attempts, pause
                )
                time.sleep(pause)
                pause *= 2

    def get_small(self, url: str, *, name: str, limit: int) -> bytes:
        """The whole body of ``url``, at most ``limit`` bytes (more is refused)."""
        result: list[bytes] = []

        def attempt() -> None:
            result.clear()
            conn, response, final, _sock = self._open(url, name=name)
            try:
                self._status(response, final, name, ranged=False)
                _check_length(response, limit, name, final)
                try:
                    data = response.read(limit + 1)
                except (OSError, http.client.HTTPException) as exc:
                    raise _Transient(Reason.network, f"{name}: reading {final}: {_describe(exc)}") from None
                if len(data) > limit:
                    raise ImagerError(
                        Reason.body_too_large,
                        f"{name}: {final} sends more than {limit} bytes",
                        hint="this is not the file the release names; check the release server",
                    )
                result.append(data)
            finally:
                response.close()
                conn.close()

        self._retrying(attempt)
        return result[0]

    def stream(self, url: str, *, name: str, size: int, sink: Sink) -> None:
        """Feed exactly ``size`` bytes of ``url`` to ``sink`` in order, resuming after a transient break.

        The body is read straight into the sink's buffers (no copy). More than ``size`` bytes
        (announced or sent) is refused as ``body-too-large``; a server that ends the body early,
        again and again, is refused as ``truncated``.
        """
        done = [0]

        def attempt() -> None:
            offset = done[0]
            conn, response, final, sock = self._open(url, name=name, offset=offset)
            try:
                self._status(response, final, name, ranged=offset > 0)
                if offset and response.status == 200:
                    raise ImagerError(
                        Reason.network,
                        f"{name}: {final} ignores Range; cannot resume at byte {offset}",
                        hint="run the imager again (it starts from the first byte)",
                    )
                _check_length(response, size - offset, name, final)
                read = _direct_reader(sock, response, size - offset, self.timeout_s) or response.readinto
                while done[0] < size:
                    view = sink.buffer()
                    want = min(len(view), size - done[0])
                    try:
                        got = read(view[:want])
                    except (OSError, http.client.HTTPException) as exc:
                        raise _Transient(
                            Reason.network,
                            f"{name}: reading {final} broke off at byte {done[0]}: {_describe(exc)}",
                        ) from None
                    if not got:
                        raise _Transient(
                            Reason.truncated,
                            f"{name}: {final} ended at byte {done[0]} of the {size} the release signs",
                            hint="the file on the server is shorter than the signed one: republish the release",
                        )
                    sink.filled(got)
                    done[0] += got
                if read == response.readinto and response.read(1):  # direct: Content-Length framed it
                    raise ImagerError(
                        Reason.body_too_large,
                        f"{name}: {final} sends more than the {size} bytes the release signs",
                        hint="the file on the server is not the signed one: republish the release",
                    )
            finally:
                response.close()
                conn.close()

        self._retrying(attempt)


def _direct_reader(
    sock: socket.socket | None, response: http.client.HTTPResponse, length: int, timeout_s: float
) -> Callable[[memoryview], int] | None:
    """A faster reader of a plain-HTTP body of exactly ``length`` announced bytes; None: use ``response``.

    ``http.client`` reads through a buffered file in many short ``recv`` calls; here, once the bytes it
    has already buffered are taken, each call asks the kernel for the whole buffer (``MSG_WAITALL`` on
    a blocking socket), one wake-up per buffer instead of one per segment: about 1.4x the throughput on
    the loopback (``bench/imager.py``). A stall still ends the read: ``SO_RCVTIMEO`` makes a receive
    that gets no byte for ``timeout_s`` fail (``EAGAIN``), as the socket timeout does on the other path.
    Content-Length framing means nothing past ``length`` belongs to this body. TLS and bodies without a
    Content-Length (chunked, or ended by closing) keep ``response.readinto``.
    """
    announced = response.getheader("Content-Length")
    if (
        type(sock) is not socket.socket
        or response.chunked
        or announced is None
        or not announced.strip().isdigit()
        or int(announced) != length
    ):
        return None
    fp = response.fp
    seconds = max(1, int(timeout_s))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))
    buffered = [len(fp.peek(1)) if length else 0]  # what http.client already read past the headers

    def read(view: memoryview) -> int:
        if buffered[0]:
            got = fp.readinto(view[: buffered[0]])
            buffered[0] -= got
            return got
        try:
            return sock.recv_into(view, len(view), socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO ran out with no byte received
            raise TimeoutError("timed out") from None

    return read


def _check_length(response: http.client.HTTPResponse, limit: int, name: str, url: str) -> None:
    length = response.getheader("Content-Length")
    if length is None:
        return
    try:
        announced = int(length)
    except ValueError:
        raise ImagerError(Reason.http_error, f"{name}: {url} sends Content-Length {length[:40]!r}") from None
    if announced > limit:
        raise ImagerError(
            Reason.body_too_large,
            f"{name}: {url} announces {announced} bytes, more than the {limit} expected",
            hint="the file on the server is not the signed one: republish the release",
        )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({exc.verify_message})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
