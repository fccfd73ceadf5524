"""What one stranger can hold: per-address limits, the open-file limit, and the transport caps.

The attestation port is the front door of a data centre: anyone who can reach it can open
connections and streams before proving anything. The server bounds what each of them costs:

* gRPC core caps the streams per connection (HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``), the
  connections in all (``grpc.max_allowed_incoming_connections``, checked before the TLS
  handshake) and the time a connection may take to finish its handshake;
* :class:`PeerLimits` caps the requests in flight from one address and the attestations it may
  start per second (a token bucket), before any byte of a request is parsed;
* :func:`raise_open_file_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard limit at start, so
  the connection cap, not the file limit, is what a flood meets.

IPv6 addresses are grouped by their /64 (one host usually holds a whole /64), IPv4 by address.
The tables are bounded: an address with nothing in flight is forgotten, and at most
:data:`MAX_TRACKED` rate buckets are kept (the least recently used is dropped).
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_TRACKED = 65536
# File descriptors kept back for the store, the audit log, the CA files and the metrics server.
FD_RESERVE = 256


def peer_key(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), grouped.

    Anything unparsable (a UNIX socket peer, an empty string) is its own key, so it is limited
    like one address.
    """
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]") if rest.startswith("[") else rest
        host = host.split("%", 1)[0]
        try:
            addr = ipaddress.IPv6Address(host)
        except ValueError:
            return peer[:128]
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return peer[:128]


@dataclass
class _Bucket:
    tokens: float
    updated: float


class PeerLimits:
    """Thread-safe per-address admission: in-flight requests and an attestation rate.

    ``admit`` returns None when the request may go ahead (call ``release`` when it ends), or the
    reason slug of the refusal (``peer_limit`` or ``rate_limited``) and the seconds after which a
    retry may succeed.
    """

    def __init__(
        self,
        *,
        max_inflight: int,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def admit(self, key: str, *, rated: bool) -> tuple[str, float] | None:
        with self._lock:
            if self._inflight.get(key, 0) >= self.max_inflight:
                return ("peer_limit", 1.0)
            if rated and self.rate_per_s > 0:
                now = self._clock()
                bucket = self._buckets.pop(key, None)
                if bucket is None:
                    bucket = _Bucket(float(self.burst), now)
                else:
                    bucket.tokens = min(
                        float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate_per_s
                    )
                    bucket.updated = now
                self._buckets[key] = bucket
                while len(self._buckets) > MAX_TRACKED:
                    self._buckets.popitem(last=False)
                if bucket.tokens < 1.0:
                    return ("rate_limited", (1.0 - bucket.tokens) / self.rate_per_s)
                bucket.tokens -= 1.0
            self._inflight[key] = self._inflight.get(key, 0) + 1
            return None

    def release(self, key: str) -> None:
        with self._lock:
            left = self._inflight.get(key, 0) - 1
            if left > 0:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)

    def inflight(self, key: str) -> int:
        with self._lock:
            return self._inflight.get(key, 0)

    def tracked(self) -> tuple[int, int]:
        """(addresses with requests in flight, rate buckets kept): for metrics and tests."""
        with self._lock:
            return len(self._inflight), len(self._buckets)


def raise_open_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_cap(configured: int, open_files: int) -> int:
    """The connection limit: the configured one, or what the open-file limit leaves room for."""
    room = max(64, open_files - FD_RESERVE)
    if configured <= 0:
        return room
    if configured > room:
        log.warning(
            "max_connections %d exceeds what the open-file limit (%d) allows; using %d "
            "(raise LimitNOFILE= in the unit to allow more)",
            configured,
            open_files,
            room,
        )
        return room
    return configured
