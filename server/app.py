"""Assemble and run the server: CA, store, EK trust, gRPC (TLS), health, metrics, audit.

:class:`ServerApp` owns every resource it opens and closes them in
:meth:`ServerApp.stop`. Ports given as 0 are picked by the OS and reported in
:attr:`ServerApp.ports` (tests and the demo use this).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.server.bundle.v1 import bundle_pb2
from protocol._gen.spire.api.server.entry.v1 import entry_pb2
from protocol._gen.spire.api.server.svid.v1 import svid_pb2
from server.attest_service import AgentService
from server.audit import AuditLog
from server.boundary import Boundary, register
from server.bundle_service import BundleService
from server.ca import SERVER_CERT, SERVER_KEY, CertificateAuthority, ServerSvid
from server.commit import GroupCommit
from server.config import ServerConfig
from server.devid.app import DevidParts
from server.entry_service import EntryService
from server.errors import ConfigError
from server.health import HealthServer
from server.limits import PeerLimits, connection_cap, raise_open_file_limit
from server.metrics import Metrics
from server.store import Store
from server.svid_service import SvidService
from server.tpm_attestor import EkTrustLike, TpmNodeAttestor
from server.wire.h2 import Limits
from server.wire.server import ServerTls, WireServer

log = logging.getLogger(__name__)

AGENT_SERVICE = "spire.api.server.agent.v1.Agent"
# What one request message may be: the boundary refuses, with an audit line, anything larger
# (a tpm payload is a few KB; max_payload_bytes bounds it further). gRPC core refuses, without
# reading it into Python, anything over TRANSPORT_MAX_MESSAGE_BYTES.
MAX_MESSAGE_BYTES = 1024 * 1024
TRANSPORT_MAX_MESSAGE_BYTES = 4 * MAX_MESSAGE_BYTES
MAX_CONCURRENT_RPCS = 4096
IDLE_CONNECTION_S = 60.0


def grpc_options(
    *, max_connections: int = 0, max_streams_per_connection: int = 16, handshake_timeout_s: float = 10.0
) -> list[tuple[str, Any]]:
    """The channel arguments of every gRPC server we run (bench/attest.py measures with these too)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", TRANSPORT_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.enable_channelz", 0),
        # Shed connections that carry no RPC for a minute (an agent makes one or two calls).
        ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
        # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: one connection cannot hold the server's RPC slots.
        ("grpc.max_concurrent_streams", max_streams_per_connection),
        # A connection that has not finished its TLS handshake by then is closed.
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
    ]
    if max_connections > 0:
        # Checked before the handshake: silent connections cannot exhaust the file descriptors.
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options


def server_credentials(svid: ServerSvid, *, client_ca: bytes | None = None) -> grpc.ServerCredentials:
    """TLS with the server SVID; each new connection picks up a renewed SVID (checked at half-life)."""
    generation = svid.generation

    def config() -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(svid.key_pem, svid.chain_pem)], root_certificates=client_ca
        )

    def fetch() -> Any:
        nonlocal generation
        svid.renew_if_due()
        if svid.generation != generation:
            generation = svid.generation
            return config()
        return None

    return grpc.dynamic_ssl_server_credentials(
        config(), fetch, require_client_authentication=client_ca is not None
    )


def server_tls(svid: ServerSvid, data_dir: Path) -> ServerTls:
    """The wire transport's TLS: the same server SVID, from the files ServerSvid keeps."""
    return ServerTls(svid, data_dir / SERVER_KEY, data_dir / SERVER_CERT)


def open_ek_trust(config: ServerConfig) -> EkTrustLike:
    from server.ek_trust import EkTrust

    settings = config.ek_trust
    if settings is None or (settings.ca_dir is None and settings.hash_dir is None):
        raise ConfigError(
            "ek_trust: set ca_dir (manufacturer CA certificates) and/or hash_dir (allowed EK hashes); "
            "see docs/ek-trust.md"
        )
    trust: EkTrustLike = EkTrust.load(settings)
    return trust


def open_store_for(config: ServerConfig) -> Store:
    from server.store import open_store

    store = open_store(config.store_dsn)
    store.migrate()
    return store


@dataclass
class Ports:
    attest: int = 0
    join: int = 0
    metrics: int = 0


@dataclass
class ServerApp:
    config: ServerConfig
    ek_trust: EkTrustLike | None = None
    store: Store | None = None
    ports: Ports = field(default_factory=Ports)

    def __post_init__(self) -> None:
        self._servers: list[grpc.aio.Server | WireServer] = []
        self._metrics_server: Any = None
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="nodeserver-io")
        self._owns_store = self.store is None
        self._tasks: list[asyncio.Task[None]] = []
        self.ca: CertificateAuthority | None = None
        self.devid: DevidParts | None = None
        self.join_service: Any = None
        self.audit: AuditLog | None = None
        self.metrics = Metrics.create()
        self._started = False
        self.max_connections = 0
        self._group_commit: GroupCommit | None = None

    async def start(self) -> None:
        cfg = self.config
        self.ca = CertificateAuthority.load_or_create(cfg.data_dir, cfg.trust_domain, ca_ttl=cfg.ca_ttl)
        svid = ServerSvid(self.ca, cfg.data_dir, cfg.server_svid_ttl, cfg.server_dns_names)
        if self.ek_trust is None:
            self.ek_trust = open_ek_trust(cfg)
        if self.store is None:
            self.store = open_store_for(cfg)
        self.audit = AuditLog(
            cfg.audit_path,
            max_bytes=cfg.audit_max_bytes,
            backups=cfg.audit_backups,
            min_free_bytes=cfg.min_free_bytes,
        )
        open_files = raise_open_file_limit()
        self.max_connections = connection_cap(cfg.max_connections, open_files)
        self.limits = PeerLimits(
            max_inflight=cfg.peer_max_inflight,
            rate_per_s=cfg.attest_rate_per_ip,
            burst=cfg.attest_burst_per_ip,
        )
        self.boundary = Boundary(
            audit=self.audit, metrics=self.metrics, limits=self.limits, max_message_bytes=MAX_MESSAGE_BYTES
        )
        self.devid = DevidParts.open(cfg, self.ek_trust, self.store, self._executor)
        self._group_commit = GroupCommit(self.store)
        agent_service = AgentService(
            ca=self.ca,
            store=self.store,
            attestors={"tpm": TpmNodeAttestor(cfg.trust_domain, self.ek_trust), **self.devid.attestors()},
            svid_ttl=cfg.agent_svid_ttl,
            challenge_timeout=cfg.challenge_timeout.total_seconds(),
            first_message_timeout=cfg.first_message_timeout.total_seconds(),
            max_payload_bytes=cfg.max_payload_bytes,
            commit=self._group_commit,
        )
        options = grpc_options(
            max_connections=self.max_connections,
            max_streams_per_connection=cfg.max_streams_per_connection,
            handshake_timeout_s=cfg.handshake_timeout.total_seconds(),
        )
        server = self._attest_server(options)
        register(
            server, self.boundary, agent_pb2.DESCRIPTOR.services_by_name["Agent"], agent_service.methods()
        )
        register(
            server,
            self.boundary,
            bundle_pb2.DESCRIPTOR.services_by_name["Bundle"],
            BundleService(self.ca).methods(),
        )
        # What a spire-agent calls after attesting (no registration entries here: empty answers).
        entries = EntryService(first_message_timeout=cfg.first_message_timeout.total_seconds())
        register(server, self.boundary, entry_pb2.DESCRIPTOR.services_by_name["Entry"], entries.methods())
        register(
            server, self.boundary, svid_pb2.DESCRIPTOR.services_by_name["SVID"], SvidService().methods()
        )
        self.devid.register(server, self.boundary)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        host, port = cfg.listen
        credentials: Any = (
            server_tls(svid, cfg.data_dir) if isinstance(server, WireServer) else server_credentials(svid)
        )
        bound = server.add_secure_port(f"{_bracket(host)}:{port}", credentials)
        if bound == 0:
            raise ConfigError(f"listen: cannot bind {host}:{port} (in use, or not an address of this host)")
        self.ports.attest = bound
        await server.start()
        self._servers.append(server)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(AGENT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._start_join(svid, options)
        if cfg.metrics_listen is not None:
            mhost, mport = cfg.metrics_listen
            try:
                self._metrics_server = HealthServer.start(mhost, mport, self.metrics.registry, self.ready)
            except OSError as exc:
                raise ConfigError(f"metrics_listen: cannot bind {mhost}:{mport}: {exc.strerror}") from exc
            self.ports.metrics = self._metrics_server.port
        self._tasks.append(asyncio.create_task(self._refresh_gauges()))
        self._started = True
        log.info(
            "nodeserver for %s listening on %s:%d (at most %d connections, %d streams each, %d requests in "
            "flight per address)",
            cfg.trust_domain,
            host,
            self.ports.attest,
            self.max_connections,
            cfg.max_streams_per_connection,
            cfg.peer_max_inflight,
        )

    def _attest_server(self, options: list[tuple[str, Any]]) -> grpc.aio.Server | WireServer:
        """The attestation port's server: nodeserver's own transport (server/wire), or grpc.aio."""
        cfg = self.config
        if cfg.transport == "grpc":
            return grpc.aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        limits = Limits(
            max_streams=cfg.max_streams_per_connection,
            max_message=TRANSPORT_MAX_MESSAGE_BYTES,
            idle_s=IDLE_CONNECTION_S,
        )
        return WireServer(
            limits=limits,
            max_connections=self.max_connections,
            handshake_timeout=cfg.handshake_timeout.total_seconds(),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            max_send_message=MAX_MESSAGE_BYTES,
        )

    def ready(self) -> tuple[bool, str]:
        """Readiness for /ready: serving, the store answers, the audit log can be written."""
        if not self._started or not self._servers:
            return False, "starting"
        if self.audit is None or not self.audit.healthy():
            return False, "the audit log cannot be written (disk nearly full)"
        try:
            if self.store is not None:
                self.store.count_agents()
        except Exception as exc:
            return False, f"the store does not answer: {type(exc).__name__}"
        return True, "ready"

    async def _start_join(self, svid: ServerSvid, options: list[tuple[str, Any]]) -> None:
        """Serve the Join API (mutual TLS with agent SVIDs) when pools are configured."""
        from protocol._gen.nodetrust.join.v1 import join_pb2
        from server.join_service import JoinService
        from server.pools import join_settings
        from server.tokens.backend import open_backend

        cfg = self.config
        settings = join_settings(cfg.extra, base_dir=cfg.base_dir)
        if settings is None:
            if cfg.join_listen is not None:
                raise ConfigError("join_listen is set but no pools are configured")
            return
        if cfg.join_listen is None:
            raise ConfigError("pools are configured but join_listen is not: set join_listen: 0.0.0.0:8082")
        if self.ca is None or self.store is None or self.audit is None:
            raise ConfigError("the join broker starts after the CA, the store and the audit log")
        backend = open_backend(settings.token_backend, base_dir=cfg.base_dir)
        backend.check()
        self.join_service = JoinService(
            trust_domain=cfg.trust_domain,
            settings=settings,
            store=self.store,
            backend=backend,
            executor=self._executor,
        )
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        register(
            server, self.boundary, join_pb2.DESCRIPTOR.services_by_name["Join"], self.join_service.methods()
        )
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        host, port = cfg.join_listen
        bound = server.add_secure_port(
            f"{_bracket(host)}:{port}", server_credentials(svid, client_ca=self.ca.bundle_pem())
        )
        if bound == 0:
            raise ConfigError(f"join_listen: cannot bind {host}:{port}")
        self.ports.join = bound
        await server.start()
        self._servers.append(server)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set("nodetrust.join.v1.Join", health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._sweep_tokens()))
        log.info("join broker for pools %s listening on %s:%d", ", ".join(settings.pools), host, bound)

    async def _sweep_tokens(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(30)
            if self.join_service is None:
                return
            try:
                swept = await loop.run_in_executor(self._executor, self.join_service.sweep)
                if swept:
                    log.info("removed %d revoked or expired bootstrap token(s)", swept)
            except Exception:
                log.warning("could not sweep bootstrap tokens", exc_info=True)

    async def _refresh_gauges(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self.store is None:
                    return
                count = await loop.run_in_executor(self._executor, self.store.count_agents)
                self.metrics.agents_known.set(count)
                self.metrics.peers_inflight.set(self.limits.tracked()[0])
            except Exception:
                log.warning("could not refresh the agents gauge", exc_info=True)
            await asyncio.sleep(5)

    async def wait(self) -> None:
        await asyncio.gather(*(s.wait_for_termination() for s in self._servers))

    async def stop(self, grace: float = 2.0) -> None:
        for task in self._tasks:
            task.cancel()
        for server in self._servers:
            await server.stop(grace)
        self._servers.clear()
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        if self._group_commit is not None:
            self._group_commit.close()
            self._group_commit = None
        if self.audit is not None:
            self.audit.close()
        if self.store is not None and self._owns_store:
            self.store.close()
        self._executor.shutdown(wait=False)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
