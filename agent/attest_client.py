"""The AttestAgent client: one TPM attestation over one gRPC stream.

Speaks ``/spire.api.server.agent.v1.Agent/AttestAgent`` exactly like a SPIRE
agent with the ``tpm`` plugin, so it works against our server and against a
real SPIRE server with spire-tpm-plugin. The transport is grpclib over a
:class:`agent.tls.SpiffeTLSContext`, which authenticates the server as
``spiffe://<td>/spire/server`` against the bootstrap bundle.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from agent.errors import (
    AttestationRefusedError,
    RefusedForNowError,
    ServerNotTrustedError,
    ServerUnavailableError,
)
from agent.refusals import DetailsCodec, Rpc, from_grpc_error
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


@dataclass(frozen=True)
class ServerTarget:
    host: str
    port: int
    trust_domain: str
    bundle_pem: bytes

    @classmethod
    def parse(cls, address: str, trust_domain: str, bundle_pem: bytes) -> ServerTarget:
        host, port = host_port(address)
        return cls(host, port, trust_domain, bundle_pem)


_PORT_RE = re.compile(r"[0-9]{1,5}")
_HOST_RE = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*")


def host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); ValueError names what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not _PORT_RE.fullmatch(port) or not 0 < int(port) < 65536 or not _HOST_RE.fullmatch(host):
        raise ValueError(f"server address {address!r} must be HOST:PORT with a port of 1..65535")
    return host.strip("[]"), int(port)


async def attest_async(
    target: ServerTarget,
    attestor: TpmAttestor,
    store: SvidStore,
    *,
    timeout: float = 60.0,
) -> Svid:
    """Attest with the TPM, store the new key and SVID, and return the SVID."""
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
    try:
        svid = await _exchange(target, tls, attestor, csr, timeout)
        if attestor.ak_blob is not None:
            # The AK the server just credential-activated and recorded: later quotes are signed by it.
            store.write_ak(attestor.ak_blob)
    except BaseException:
        store.discard_pending()  # the new key never became an SVID's key
        raise
    store.commit(svid, target.bundle_pem)
    log.info("attested as %s; SVID valid until %s", svid.spiffe_id, svid.expires.isoformat())
    return svid


async def _exchange(
    target: ServerTarget, tls: SpiffeTLSContext, attestor: TpmAttestor, csr: bytes, timeout: float
) -> Svid:
    """The AttestAgent stream; transport and server errors become :class:`AgentError` subclasses."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    payload = encode_attestation_data(attestor.attestation_data())
    channel = Channel(target.host, target.port, ssl=tls, status_details_codec=DetailsCodec())
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
                raise AttestationRefusedError(
                    f"the server's challenge is malformed: {exc}",
                    hint="the server's tpm attestor speaks another version of the protocol",
                ) from exc
            secret = attestor.activate(credential)
            # Half-close with the answer: the server ends the stream right after the result.
            await stream.send_message(
                agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(secret)), end=True
            )
            result = await stream.recv_message()
            if result is None or result.WhichOneof("step") != "result":
                raise RefusedForNowError(
                    "the server answered the challenge without a result",
                    hint="see the server's log for this attempt; the agent retries",
                )
            svid_msg = result.result.svid
            if not svid_msg.cert_chain:
                raise AttestationRefusedError(
                    "the server returned an empty SVID", hint="see the server's log"
                )
            svid = Svid(
                spiffe_id=f"spiffe://{svid_msg.id.trust_domain}{svid_msg.id.path}",
                cert_chain_der=tuple(svid_msg.cert_chain),
                expires_at=svid_msg.expires_at,
                reattestable=result.result.reattestable,
            )
    except GRPCError as exc:
        raise from_grpc_error(Rpc.ATTEST, exc) from exc
    except binascii.Error as exc:  # grpclib could not even base64-decode the status details
        raise RefusedForNowError(
            f"the server at {target.host}:{target.port} sent an unreadable status trailer: {exc}",
            hint="a proxy between the agent and the server may mangle gRPC trailers; the agent retries",
        ) from exc
    except ssl.SSLCertVerificationError as exc:
        raise ServerNotTrustedError(
            f"the server at {target.host}:{target.port} is not trusted: {getattr(exc, 'verify_message', None) or exc.args[0]}",
            hint=f"check --bundle (it must hold the CA of {target.trust_domain}) and --trust-domain",
        ) from exc
    except (TimeoutError, OSError, StreamTerminatedError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the server at {target.host}:{target.port}: {exc or type(exc).__name__}",
            hint="check the address, that nodeserver runs, and the network; the agent retries on its own",
        ) from exc
    finally:
        channel.close()
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
