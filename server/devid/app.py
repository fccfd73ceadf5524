"""The DevID parts of a running nodeserver, assembled from the ``devid`` section (server.app uses this).

:meth:`DevidParts.open` loads or creates the DevID CA in ``data_dir`` and the DevID trust anchors
(the CA itself unless ``trust_own_ca: false``, plus ``trusted_ca_files``); :meth:`attestors` gives
the ``tpm_devid`` attestor for AgentService; :meth:`register` serves DevId/Enrol when ``enrol`` is on.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from cryptography import x509

from protocol._gen.nodetrust.devid.v1 import devid_pb2
from server.boundary import Boundary, HandlerRegistry, register
from server.config import ServerConfig
from server.devid.attestor import TpmDevidAttestor
from server.devid.ca import DevidCa
from server.devid.chain import load_roots
from server.devid.enrol_service import DevidEnrolService
from server.devid.settings import SECTION, DevidSettings
from server.errors import ConfigError
from server.node_attestor import NodeAttestor
from server.store import Store
from server.tpm_attestor import EkTrustLike


@dataclass
class DevidParts:
    config: ServerConfig
    settings: DevidSettings
    ca: DevidCa
    roots: tuple[x509.Certificate, ...]
    ek_trust: EkTrustLike
    store: Store
    executor: Executor | None

    @classmethod
    def open(
        cls, config: ServerConfig, ek_trust: EkTrustLike, store: Store, executor: Executor | None
    ) -> DevidParts:
        settings = config.extra.get(SECTION) or DevidSettings()
        if not isinstance(settings, DevidSettings):  # pragma: no cover - config_from_mapping builds it
            raise ConfigError(f"{SECTION}: not a DevID section")
        ca = DevidCa.load_or_create(config.data_dir, config.trust_domain, ttl=settings.ca_ttl)
        roots: list[x509.Certificate] = [ca.cert] if settings.trust_own_ca else []
        for path in settings.trusted_ca_files:
            try:
                found = load_roots([path.read_bytes()])
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{SECTION}.trusted_ca_files: cannot read {path}: {exc}") from exc
            if not found:
                raise ConfigError(f"{SECTION}.trusted_ca_files: {path} holds no PEM certificate")
            roots.extend(found)
        return cls(config, settings, ca, tuple(roots), ek_trust, store, executor)

    def attestors(self) -> dict[str, NodeAttestor]:
        if not self.roots:
            return {}  # no DevID could ever be trusted: the attestor is not offered
        attestor = TpmDevidAttestor(self.config.trust_domain, self.ek_trust, lambda: self.roots)
        return {attestor.name: attestor}

    def register(self, server: HandlerRegistry, boundary: Boundary) -> None:
        if not self.settings.enrol:
            register(server, boundary, devid_pb2.DESCRIPTOR.services_by_name["DevId"], {})
            return
        service = DevidEnrolService(
            trust_domain=self.config.trust_domain,
            ca=self.ca,
            ek_trust=self.ek_trust,
            store=self.store,
            certificate_ttl=self.settings.certificate_ttl,
            challenge_timeout=self.config.challenge_timeout.total_seconds(),
            first_message_timeout=self.config.first_message_timeout.total_seconds(),
            executor=self.executor,
            require_join=self.settings.require_join,
        )
        register(server, boundary, devid_pb2.DESCRIPTOR.services_by_name["DevId"], service.methods())
