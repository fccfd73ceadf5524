"""Plain-HTTP ``/metrics``, ``/live`` and ``/ready`` on ``metrics_listen``.

SPIRE offers the same two probes (``health_checks``): kubelet's gRPC probe cannot speak TLS,
and the gRPC health service sits behind the server's TLS. ``/live`` answers 200 while the
process serves HTTP at all; ``/ready`` answers 200 only while the gRPC servers run, the store
answers and the audit log can be written, else 503 with the reason. Bodies are short text;
nothing here reveals more than the metrics already do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"
    timeout = 10  # a client that sends nothing is dropped

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/live":
            self._send(200, b"live\n")
        elif path == "/ready":
            ok, why = self.server.ready()
            self._send(200 if ok else 503, (why + "\n").encode())
        else:
            self._send(404, b"not found: try /metrics, /live or /ready\n")

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics endpoint: %s", format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    ready: Readiness


@dataclass
class HealthServer:
    httpd: _Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry, ready: Readiness) -> HealthServer:
        httpd = _Server((host, port), _Handler)
        httpd.registry = registry
        httpd.ready = ready
        thread = threading.Thread(target=httpd.serve_forever, name="nodeserver-metrics", daemon=True)
        thread.start()
        log.info("metrics and probes on http://%s:%d/{metrics,live,ready}", host, httpd.server_address[1])
        return cls(httpd, thread)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
