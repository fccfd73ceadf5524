"""``nodeagent reattest``: a joined node proves again, before its SVID expires, who it is and what it booted.

``nodeagent run`` ends once the node has joined; ``nodeagent-reattest.timer`` starts this every
few minutes instead (``agent/systemd/``). Each run:

1. does nothing on a node that has not joined (``nodeagent run`` owns that), nor while the SVID
   has more than ``reattest_before_s`` left (``--force`` re-attests at once);
2. attests again with the TPM (a fresh AK, credential-activated by the server and kept, a new
   SVID: SPIRE's re-attestation on renewal);
3. asks the broker (``Join.BeginJoin``) whether the pool checks measured boot; if it does, quotes
   the PCRs it names over its nonce with the new AK, and sends the quote and the event log
   (``Join.Recheck``). The server compares them with the releases the pool accepts: a node whose
   measurements changed is refused (``boot_not_accepted``), audited and counted there, and banned
   when the pool's ``measured_boot.on_change`` says so.

A server that does not serve ``Join.Recheck`` yet answers UNIMPLEMENTED: the node has then
re-attested only, which the outcome says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.errors import ConfigError, RefusalError
from agent.files import FileTooLargeError, read_bounded
from agent.state import StateStore
from agent.svid import SvidStore

log = logging.getLogger(__name__)
MAX_BUNDLE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Outcome:
    action: str  # not_joined | not_due | reattested | rechecked
    detail: str
    spiffe_id: str = ""
    svid_expires_at: int = 0
    release: str = ""  # the release the server matched the boot with

    def to_json(self) -> dict[str, object]:
        return {
            "action": self.action,
            "detail": self.detail,
            "spiffe_id": self.spiffe_id,
            "svid_expires_at": self.svid_expires_at,
            "release": self.release,
        }


@dataclass(frozen=True)
class _Mtls:
    config: AgentConfig
    bundle: bytes
    svids: SvidStore

    def kwargs(self) -> dict[str, Any]:
        return {
            "trust_domain": self.config.trust_domain,
            "bundle_pem": self.bundle,
            "svid_cert": self.svids.cert_path,
            "svid_key": self.svids.key_path,
            "timeout": self.config.timeout_s,
        }


def _bundle(config: AgentConfig) -> bytes:
    try:
        return read_bounded(Path(config.bundle), MAX_BUNDLE_BYTES)
    except (OSError, FileTooLargeError) as exc:
        raise ConfigError(
            f"cannot read the trust bundle {config.bundle}: {exc}",
            hint="install the server's bundle (nodeserver bundle) there, or set bundle",
        ) from exc


def reattest(config: AgentConfig, *, force: bool = False, clock: float | None = None) -> Outcome:
    """One re-attestation and re-check; refusals raise :class:`agent.errors.AgentError` as the table says."""
    now = time.time() if clock is None else clock
    state_dir = Path(config.state_dir)
    if not StateStore(state_dir).joined():
        return Outcome("not_joined", "this node has not joined: `nodeagent run` attests and joins it")
    missing = config.missing_for_join()
    if missing:
        raise ConfigError(
            f"missing setting(s): {', '.join(missing)}",
            hint="the same settings as `nodeagent run` (/etc/nodeagent/config.yaml, nodeagent.<key>= or NODEAGENT_*)",
        )
    svids = SvidStore(state_dir)
    loaded = svids.load()
    left = loaded[0].not_valid_after_utc.timestamp() - now if loaded is not None else 0.0
    if not force and left > config.reattest_before_s:
        return Outcome(
            "not_due",
            f"the SVID is valid for {left:.0f} s more; re-attesting within {config.reattest_before_s:.0f} s of expiry",
        )
    from agent.attest_client import ServerTarget, attest

    bundle = _bundle(config)
    try:
        target = ServerTarget.parse(config.server, config.trust_domain, bundle)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="set server to HOST:PORT, e.g. attest.example.org:8081") from exc
    svid = attest(
        target,
        tcti=config.tcti,
        state_dir=state_dir,
        ek_alg=config.ek_alg,
        require_ek_cert=config.require_ek_cert,
        timeout=config.timeout_s,
    )
    log.info("re-attested as %s; SVID valid until %s", svid.spiffe_id, svid.expires.isoformat())
    done = Outcome("reattested", "re-attested", svid.spiffe_id, svid.expires_at)
    from agent.join_client import begin_join_async, recheck_async
    from agent.tpm.quote import make_evidence

    mtls = _Mtls(config, bundle, svids)
    asked = asyncio.run(begin_join_async(config.join_address, pool=config.pool, **mtls.kwargs()))
    if asked is None:
        return Outcome("reattested", f"re-attested; pool {config.pool} does not check measured boot",
                       svid.spiffe_id, svid.expires_at)  # fmt: skip
    evidence = make_evidence(config.tcti, svids.load_ak(), asked, Path(config.event_log))
    try:
        release = asyncio.run(
            recheck_async(
                config.join_address,
                pool=config.pool,
                node_name=config.effective_node_name,
                evidence=evidence,
                **mtls.kwargs(),
            )
        )
    except RefusalError as exc:
        if exc.code == "UNIMPLEMENTED":
            log.warning(
                "the broker does not re-check measured boot (Join.Recheck is not served): re-attested only"
            )
            return Outcome("reattested", "re-attested; the broker does not serve Join.Recheck (upgrade nodeserver)",
                           done.spiffe_id, done.svid_expires_at)  # fmt: skip
        raise
    return Outcome(
        "rechecked",
        f"re-attested; the boot still matches release {release}",
        done.spiffe_id,
        done.svid_expires_at,
        release,
    )
