"""Prometheus metrics, in a registry of their own (no global state), served over HTTP."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass
class Metrics:
    registry: CollectorRegistry
    attestations: Counter
    attestation_seconds: Histogram
    agents_known: Gauge
    joins: Counter
    join_seconds: Histogram
    tokens_live: Gauge
    requests: Counter
    peers_inflight: Gauge

    @classmethod
    def create(cls) -> Metrics:
        reg = CollectorRegistry(auto_describe=True)
        return cls(
            registry=reg,
            attestations=Counter(
                "nodeserver_attestations",
                "Attestation attempts by result and reason.",
                ["result", "reason"],
                registry=reg,
            ),
            attestation_seconds=Histogram(
                "nodeserver_attestation_duration_seconds",
                "Attestation latency from the first message to the result, by result.",
                ["result"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            agents_known=Gauge("nodeserver_agents_known", "Agents in the store.", registry=reg),
            joins=Counter(
                "nodeserver_joins", "Join requests by result and reason.", ["result", "reason"], registry=reg
            ),
            join_seconds=Histogram(
                "nodeserver_join_duration_seconds",
                "Join request latency.",
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            tokens_live=Gauge(
                "nodeserver_bootstrap_tokens_live", "Unexpired bootstrap tokens issued.", registry=reg
            ),
            requests=Counter(
                "nodeserver_requests",
                "Audited RPC attempts of every method by result and reason slug (protocol.reasons).",
                ["method", "result", "reason"],
                registry=reg,
            ),
            peers_inflight=Gauge(
                "nodeserver_peers_inflight", "Client addresses with requests in flight.", registry=reg
            ),
        )

    def serve(self, host: str, port: int) -> Any:
        """Start the /metrics HTTP endpoint in a daemon thread; returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, server.server_port)
        return server
