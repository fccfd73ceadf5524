"""The AttestAgent client: one TPM attestation over one gRPC stream.

Speaks ``/spire.api.server.agent.v1.Agent/AttestAgent`` exactly like a SPIRE
agent with the ``tpm`` plugin, so it works against our server and against a
real SPIRE server with spire-tpm-plugin. The transport is grpclib over a
:class:`agent.tls.SpiffeTLSContext`, which authenticates the server as
``spiffe://<td>/spire/server`` against the bootstrap bundle.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from agent.errors import AttestationRefusedError, ServerNotTrustedError, ServerUnavailableError, TpmError
from agent.svid import Svid, SvidStore, make_csr, new_key
from agent.tls import SpiffeTLSContext
from agent.tpm.attestor import TpmAttestor
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.types import attestation_pb2
from protocol.errors import ProtocolError
from protocol.spiffe import server_id
from protocol.tpm_payload import (
    ATTESTOR_TYPE,
    decode_challenge,
    encode_attestation_data,
    encode_challenge_response,
)

log = logging.getLogger(__name__)

ATTEST_METHOD = "/spire.api.server.agent.v1.Agent/AttestAgent"
# gRPC status codes after which retrying the same evidence cannot help.
PERMANENT_STATUSES = {
    "INVALID_ARGUMENT",
    "PERMISSION_DENIED",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "UNIMPLEMENTED",
}


@dataclass(frozen=True)
class ServerTarget:
    host: str
    port: int
    trust_domain: str
    bundle_pem: bytes

    @classmethod
    def parse(cls, address: str, trust_domain: str, bundle_pem: bytes) -> ServerTarget:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"server address {address!r} must be HOST:PORT")
        return cls(host.strip("[]"), int(port), trust_domain, bundle_pem)


def _hint_for(status: str, message: str) -> str:
    if "banned" in message:
        return "an operator banned this node: `nodeserver agents unban <SPIFFE ID>` lifts it"
    if "could not validate EK" in message or "ek_" in message or "EK" in message:
        return (
            "the server does not trust this TPM's EK: add the manufacturer CA to the server's ek_trust.ca_dir, "
            "or add the EK hash (nodeagent attest --print-ek-hash) to ek_trust.hash_dir"
        )
    if status == "DEADLINE_EXCEEDED":
        return "the TPM or the network was too slow; check the TPM and retry"
    return "see the server's audit log for this attempt"


async def attest_async(
    target: ServerTarget,
    attestor: TpmAttestor,
    store: SvidStore,
    *,
    timeout: float = 60.0,
) -> Svid:
    """Attest with the TPM, store the new key and SVID, and return the SVID."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    expected = server_id(target.trust_domain)
    try:
        tls = SpiffeTLSContext(target.bundle_pem, [expected])
    except ValueError as exc:
        raise ServerNotTrustedError(
            str(exc), hint="point --bundle at the output of `nodeserver bundle`"
        ) from exc
    key = new_key()
    store.write_key(key)
    csr = make_csr(key)
    payload = encode_attestation_data(attestor.attestation_data())
    channel = Channel(target.host, target.port, ssl=tls)
    try:
        async with channel.request(
            ATTEST_METHOD,
            Cardinality.STREAM_STREAM,
            agent_pb2.AttestAgentRequest,
            agent_pb2.AttestAgentResponse,
            timeout=timeout,
        ) as stream:
            await stream.send_message(
                agent_pb2.AttestAgentRequest(
                    params=agent_pb2.AttestAgentRequest.Params(
                        data=attestation_pb2.AttestationData(type=ATTESTOR_TYPE, payload=payload),
                        params=agent_pb2.AgentX509SVIDParams(csr=csr),
                    )
                )
            )
            reply = await stream.recv_message()
            if reply is None or reply.WhichOneof("step") != "challenge":
                raise AttestationRefusedError(
                    "the server did not send the tpm challenge",
                    hint="check that the server runs the tpm attestor",
                )
            try:
                credential = decode_challenge(reply.challenge)
            except ProtocolError as exc:
                raise AttestationRefusedError(f"the server's challenge is malformed: {exc}") from exc
            secret = attestor.activate(credential)
            # Half-close with the answer: the server ends the stream right after the result.
            await stream.send_message(
                agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
            )
            result = await stream.recv_message()
            if result is None or result.WhichOneof("step") != "result":
                raise AttestationRefusedError("the server answered the challenge without a result")
            svid_msg = result.result.svid
            if not svid_msg.cert_chain:
                raise AttestationRefusedError("the server returned an empty SVID")
            svid = Svid(
                spiffe_id=f"spiffe://{svid_msg.id.trust_domain}{svid_msg.id.path}",
                cert_chain_der=tuple(svid_msg.cert_chain),
                expires_at=svid_msg.expires_at,
                reattestable=result.result.reattestable,
            )
    except GRPCError as exc:
        store.discard_pending()
        status = exc.status.name
        message = exc.message or status
        raise AttestationRefusedError(
            f"attestation refused by the server ({status}): {message}",
            hint=_hint_for(status, message),
            code=status,
            permanent=status in PERMANENT_STATUSES,
        ) from exc
    except ssl.SSLCertVerificationError as exc:
        store.discard_pending()
        raise ServerNotTrustedError(
            f"the server at {target.host}:{target.port} is not trusted: {getattr(exc, 'verify_message', None) or exc.args[0]}",
            hint=f"check --bundle (it must hold the CA of {target.trust_domain}) and --trust-domain",
        ) from exc
    except (TimeoutError, OSError, StreamTerminatedError) as exc:
        store.discard_pending()
        raise ServerUnavailableError(
            f"cannot reach the server at {target.host}:{target.port}: {exc or type(exc).__name__}",
            hint="check the address, that nodeserver runs, and the network; the agent retries on its own",
        ) from exc
    except (TpmError, AttestationRefusedError):
        store.discard_pending()
        raise
    finally:
        channel.close()
    store.commit(svid, target.bundle_pem)
    log.info("attested as %s; SVID valid until %s", svid.spiffe_id, svid.expires.isoformat())
    return svid


def attest(
    target: ServerTarget,
    *,
    tcti: str,
    state_dir: Path,
    ek_alg: str = "rsa",
    require_ek_cert: bool = False,
    timeout: float = 60.0,
) -> Svid:
    """Blocking wrapper: open the TPM, attest, close the TPM (all handles flushed)."""
    with TpmAttestor(tcti, ek_alg=ek_alg, require_ek_cert=require_ek_cert) as tpm:
        return asyncio.run(attest_async(target, tpm, SvidStore(state_dir), timeout=timeout))
