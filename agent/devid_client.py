"""DevIDs on the node: enrolment with nodeserver, and attestation with SPIRE's ``tpm_devid``.

:func:`enrol` creates a DevID key in the TPM under SPIRE's storage-key template, proves it to
nodeserver's DevId/Enrol (TPM2_Certify by a fresh AK, credential activation with the EK, a signature
over the server's nonce) and writes what spire-agent's ``tpm_devid`` reads (:class:`DevidFiles`):
``devid_cert_path`` (PEM, leaf first), ``devid_priv_path`` and ``devid_pub_path`` (the TPM blobs
without size prefixes), and the DevID CA beside them for spire-server's ``devid_ca_path``.

:func:`attest_devid` speaks ``/spire.api.server.agent.v1.Agent/AttestAgent`` with ``tpm_devid``
exactly like spire-agent v1.13.3 (protocol.tpm_devid), to a real spire-server or to nodeserver.
Both run over grpclib with :class:`agent.tls.SpiffeTLSContext` (the server is
``spiffe://<td>/spire/server``, checked against the bootstrap bundle).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.attest_client import ServerTarget
from agent.errors import (
    AttestationRefusedError,
    ConfigError,
    RefusedForNowError,
    ServerNotTrustedError,
    ServerUnavailableError,
)
from agent.refusals import DetailsCodec, Rpc, from_grpc_error
from agent.svid import Svid, SvidStore, make_csr, new_key
from agent.tls import SpiffeTLSContext
from agent.tpm.devid import DevidBlobs, DevidTpm
from protocol import tpm2
from protocol._gen.nodetrust.devid.v1 import devid_pb2
from protocol._gen.spire.api.server.agent.v1 import agent_pb2
from protocol._gen.spire.api.types import attestation_pb2
from protocol.errors import ProtocolError, SpiffeIdError
from protocol.files import write_atomic
from protocol.spiffe import server_id, tpm_devid_agent_id
from protocol.tpm_devid import (
    ATTESTOR_TYPE,
    AttestationRequest,
    ChallengeResponse,
    decode_challenge,
    encode_attestation_request,
    encode_challenge_response,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
ATTEST_METHOD = "/spire.api.server.agent.v1.Agent/AttestAgent"
ENROL_METHOD = "/nodetrust.devid.v1.DevId/Enrol"
MAX_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class DevidFiles:
    """The DevID files in ``directory``, named as in docs/attestation.md's spire-agent configuration."""

    directory: Path

    @property
    def cert_path(self) -> Path:  # devid_cert_path
        return self.directory / "devid.crt.pem"

    @property
    def priv_path(self) -> Path:  # devid_priv_path
        return self.directory / "devid.priv.blob"

    @property
    def pub_path(self) -> Path:  # devid_pub_path
        return self.directory / "devid.pub.blob"

    @property
    def ca_path(self) -> Path:  # spire-server's devid_ca_path
        return self.directory / "devid-ca.pem"

    def exists(self) -> bool:
        return all(p.exists() for p in (self.cert_path, self.priv_path, self.pub_path))

    def write(self, blobs: DevidBlobs, chain_der: list[bytes], ca_der: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = b"".join(_pem(d) for d in chain_der)
        # The private blob is wrapped by the TPM's storage key (useless elsewhere); keep it 0600 anyway.
        write_atomic(self.priv_path, blobs.private, 0o600)
        write_atomic(self.pub_path, blobs.public, 0o644)
        write_atomic(self.cert_path, pem, 0o644)
        if ca_der:
            write_atomic(self.ca_path, _pem(ca_der), 0o644)

    def read(self) -> tuple[DevidBlobs, tuple[bytes, ...]]:
        try:
            blobs = DevidBlobs(public=_read(self.pub_path), private=_read(self.priv_path))
            chain = tuple(
                c.public_bytes(serialization.Encoding.DER)
                for c in x509.load_pem_x509_certificates(_read(self.cert_path))
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot read the DevID files in {self.directory}: {exc.strerror}",
                hint="enrol first: nodeagent devid enrol",
            ) from exc
        except ValueError as exc:
            raise ConfigError(
                f"{self.cert_path} holds no PEM certificate: {exc}", hint="enrol again"
            ) from exc
        if not chain:
            raise ConfigError(f"{self.cert_path} holds no certificate", hint="enrol again")
        return blobs, chain


class DevidProblem(StrEnum):
    """Why the DevID files in a folder are not fit for spire-agent (so the agent enrols a new one)."""

    MISSING = "missing"  # a file is absent
    UNREADABLE = "unreadable"  # a file cannot be read, or holds no certificate or TPM public area
    KEY_MISMATCH = "key_mismatch"  # the certificate is not for the key in devid.pub.blob
    EXPIRING = "expiring"  # the certificate has expired or expires within the margin


@dataclass(frozen=True)
class DevidCheck:
    """What :func:`inspect` found: ``problem`` None when the files are fit for use."""

    problem: DevidProblem | None
    detail: str = ""
    agent_id: str = ""  # spiffe://<td>/spire/agent/tpm_devid/<SHA-1 of the leaf DER>; "" when unknown
    expires_at: int = 0

    @property
    def valid(self) -> bool:
        return self.problem is None


def inspect(files: DevidFiles, *, trust_domain: str, now: float, renew_before_s: float) -> DevidCheck:
    """Whether ``files`` hold a DevID spire-agent can use for more than ``renew_before_s`` from ``now``.

    Checked: the three files exist, the certificate file starts with a PEM certificate, the TPM public
    area parses and is the certificate's key, and the certificate is valid past ``now + renew_before_s``.
    Not checked: that the private blob loads in this TPM (only the TPM can say; a DevID copied from
    another machine fails at spire-agent's attestation, and ``nodeagent devid attest`` shows it).
    """
    if not files.exists():
        absent = [p.name for p in (files.cert_path, files.priv_path, files.pub_path) if not p.exists()]
        return DevidCheck(DevidProblem.MISSING, f"{files.directory} has no {', '.join(absent)}")
    try:
        leaf = x509.load_pem_x509_certificates(_read(files.cert_path))[0]
        key_spki = tpm2.spki_der(tpm2.parse_public(_read(files.pub_path)))
    except OSError as exc:
        return DevidCheck(DevidProblem.UNREADABLE, f"cannot read the DevID files: {exc.strerror}")
    except (ValueError, IndexError) as exc:  # no PEM certificate, a bad TPMT_PUBLIC, too large
        return DevidCheck(DevidProblem.UNREADABLE, f"the DevID files cannot be used: {exc}")
    leaf_der = leaf.public_bytes(serialization.Encoding.DER)
    try:
        agent_id = str(tpm_devid_agent_id(trust_domain, leaf_der)) if trust_domain else ""
    except SpiffeIdError:
        agent_id = ""
    expires_at = int(leaf.not_valid_after_utc.timestamp())
    cert_spki = leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if cert_spki != key_spki:
        return DevidCheck(
            DevidProblem.KEY_MISMATCH,
            f"{files.cert_path.name} is not the certificate of the key in {files.pub_path.name}",
            agent_id,
            expires_at,
        )
    if expires_at - now <= renew_before_s:
        left = expires_at - now
        when = "has expired" if left <= 0 else f"expires in {left / 86400:.1f} days"
        return DevidCheck(DevidProblem.EXPIRING, f"the DevID certificate {when}", agent_id, expires_at)
    return DevidCheck(None, "valid", agent_id, expires_at)


def _read(path: Path) -> bytes:
    with path.open("rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return data


def _pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Enrolled:
    agent_id: str  # what SPIRE's tpm_devid will name this node
    expires_at: int
    files: DevidFiles


def _tls(target: ServerTarget) -> SpiffeTLSContext:
    try:
        return SpiffeTLSContext(target.bundle_pem, [server_id(target.trust_domain)])
    except ValueError as exc:
        raise ServerNotTrustedError(str(exc), hint="point --bundle at the server's trust bundle") from exc


async def _stream(  # noqa: PLR0917 - one call shape for both streams
    target: ServerTarget,
    method: str,
    request_cls: Any,
    response_cls: Any,
    script: Callable[[Any], Awaitable[T]],
    rpc: Rpc,
    timeout: float,
) -> T:
    """One bidirectional stream; transport and server errors become :class:`AgentError` subclasses."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    channel = Channel(target.host, target.port, ssl=_tls(target), status_details_codec=DetailsCodec())
    try:
        async with channel.request(
            method, Cardinality.STREAM_STREAM, request_cls, response_cls, timeout=timeout
        ) as stream:
            return await script(stream)
    except GRPCError as exc:
        raise from_grpc_error(rpc, exc) from exc
    except ssl.SSLCertVerificationError as exc:
        raise ServerNotTrustedError(
            f"the server at {target.host}:{target.port} is not trusted: {exc}",
            hint=f"check --bundle (the CA of {target.trust_domain}) and --trust-domain",
        ) from exc
    except (TimeoutError, OSError, StreamTerminatedError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the server at {target.host}:{target.port}: {exc or type(exc).__name__}",
            hint="check the address and that the server runs",
        ) from exc
    finally:
        channel.close()


# -- enrolment ---------------------------------------------------------------------------------------
def enrol(
    target: ServerTarget, *, tcti: str, files: DevidFiles, alg: str = "rsa", timeout: float = 60.0
) -> Enrolled:
    """Create a DevID key, have nodeserver certify it, and write the files (blocking)."""
    with DevidTpm(tcti) as tpm:
        blobs = tpm.create_devid(alg)
        tpm.load_devid(blobs)
        ak_public = tpm.make_ak()
        ek_cert, ek_public = tpm.read_ek()
        certify_info, certify_signature = tpm.certify_devid()
        params = devid_pb2.EnrolRequest.Params(
            ek_certificate=ek_cert,
            ek_public=ek_public,
            ak_public=ak_public,
            devid_public=blobs.public,
            certify_info=certify_info,
            certify_signature=certify_signature,
        )

        async def script(stream: Any) -> devid_pb2.EnrolResponse.Result:
            await stream.send_message(devid_pb2.EnrolRequest(params=params))
            reply = await stream.recv_message()
            if reply is None or reply.WhichOneof("step") != "challenge":
                raise AttestationRefusedError("the server sent no enrolment challenge", hint="see its log")
            ch = reply.challenge
            proof = devid_pb2.EnrolRequest.Proof(
                activated=tpm.activate(ch.credential, ch.secret), devid_signature=tpm.sign(ch.devid_nonce)
            )
            await stream.send_message(devid_pb2.EnrolRequest(proof=proof), end=True)
            result = await stream.recv_message()
            if (
                result is None
                or result.WhichOneof("step") != "result"
                or not result.result.certificate_chain
            ):
                raise RefusedForNowError("the server answered the proof without a certificate", hint="retry")
            r: devid_pb2.EnrolResponse.Result = result.result
            return r

        result = asyncio.run(
            _stream(
                target,
                ENROL_METHOD,
                devid_pb2.EnrolRequest,
                devid_pb2.EnrolResponse,
                script,
                Rpc.ATTEST,
                timeout,
            )
        )
    files.write(blobs, list(result.certificate_chain), result.ca_certificate)
    log.info("enrolled a DevID (%s); SPIRE's tpm_devid names this node %s", blobs.alg, result.agent_id)
    return Enrolled(agent_id=result.agent_id, expires_at=result.expires_at, files=files)


# -- tpm_devid attestation ---------------------------------------------------------------------------
def attest_devid(
    target: ServerTarget, *, tcti: str, files: DevidFiles, state_dir: Path, timeout: float = 60.0
) -> Svid:
    """AttestAgent with ``tpm_devid`` (as spire-agent), storing the SVID and its key in ``state_dir``."""
    blobs, chain = files.read()
    store = SvidStore(state_dir)
    key = new_key()
    store.write_key(key)
    try:
        with DevidTpm(tcti) as tpm:
            tpm.load_devid(blobs)
            ak_public = tpm.make_ak()
            ek_cert, ek_public = tpm.read_ek()
            certified, signature = tpm.certify_devid()
            payload = encode_attestation_request(
                AttestationRequest(
                    devid_cert=chain,
                    devid_pub=blobs.public,
                    ek_cert=ek_cert,
                    ek_pub=ek_public,
                    ak_pub=ak_public,
                    certified_devid=certified,
                    certification_signature=signature,
                )
            )
            csr = make_csr(key)

            async def script(stream: Any) -> Svid:
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
                        "the server did not send the tpm_devid challenge",
                        hint="check that the server runs the tpm_devid attestor",
                    )
                try:
                    ch = decode_challenge(reply.challenge)
                except ProtocolError as exc:
                    raise AttestationRefusedError(
                        f"the server's challenge is malformed: {exc}", hint="check the server"
                    ) from exc
                answer = ChallengeResponse(
                    signature=tpm.sign(ch.nonce), cert_info=tpm.activate(ch.credential, ch.secret)
                )
                await stream.send_message(
                    agent_pb2.AttestAgentRequest(challenge_response=encode_challenge_response(answer)),
                    end=True,
                )
                result = await stream.recv_message()
                if (
                    result is None
                    or result.WhichOneof("step") != "result"
                    or not result.result.svid.cert_chain
                ):
                    raise RefusedForNowError("the server answered without an SVID", hint="see its log")
                s = result.result.svid
                return Svid(
                    spiffe_id=f"spiffe://{s.id.trust_domain}{s.id.path}",
                    cert_chain_der=tuple(s.cert_chain),
                    expires_at=s.expires_at,
                    reattestable=result.result.reattestable,
                )

            svid = asyncio.run(
                _stream(
                    target,
                    ATTEST_METHOD,
                    agent_pb2.AttestAgentRequest,
                    agent_pb2.AttestAgentResponse,
                    script,
                    Rpc.ATTEST,
                    timeout,
                )
            )
    except BaseException:
        store.discard_pending()
        raise
    store.commit(svid, target.bundle_pem)
    log.info("attested with tpm_devid as %s", svid.spiffe_id)
    return svid
