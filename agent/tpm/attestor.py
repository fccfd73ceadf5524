"""The ``tpm`` attestor on the node: EK, AK, CertifyCreation and ActivateCredential.

One :class:`TpmAttestor` is one attestation: open it, call
:meth:`TpmAttestor.attestation_data` for the payload, then
:meth:`TpmAttestor.activate` with the server's challenge, then close it (or use
it as a context manager). Every transient object and session it created is
flushed on close, whatever happened, so hundreds of attestations in a row leave
nothing behind in the TPM.

TPM layout (go-attestation's, so a node can move between this agent and the Go
spire-agent): the SRK is the persistent RSA-2048 storage key at 0x81000001,
created and persisted when absent; the AK is a fresh RSA-2048 RSASSA/SHA-256
restricted signing key under it, certified by itself with TPM2_CertifyCreation;
the EK is re-created from the TCG default template (with the NV template and
nonce when the manufacturer provisioned them) and used for activation under a
PolicySecret(endorsement) session. Unlike go-attestation the EK is not
persisted: nothing outside the SRK is left in the TPM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.errors import (
    AkUnusableError,
    ConfigError,
    EkCertificateError,
    TpmError,
    TpmUnavailableError,
    TpmUnusableError,
)
from agent.tpm import rc as rc_codes
from agent.tpm.akblob import AkBlob
from agent.tpm.ekcert import clean_nv_certificate, same_public_key
from protocol import tpm2
from protocol.credential import Credential
from protocol.tpm_payload import AttestationData, AttestationParameters, EkData

log = logging.getLogger(__name__)

SRK_HANDLE = 0x81000001
EK_CERT_INDEX = {"rsa": 0x01C00002, "ecc": 0x01C0000A}
EK_TEMPLATE_NAME = {"rsa": "EK-RSA2048", "ecc": "EK-ECC256"}
DEFAULT_TCTI = "device:/dev/tpmrm0"

# go-attestation templates (attest/wrapped_tpm20.go).
SRK_ATTRIBUTES = 0x00030472  # fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|noDA|restricted|decrypt
AK_ATTRIBUTES = 0x00050472  # fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|noDA|restricted|sign

T = TypeVar("T")


@dataclass(frozen=True)
class EkInfo:
    public: bytes  # TPMT_PUBLIC
    spki_der: bytes
    certificate_der: bytes | None
    alg: str

    @property
    def ek_data(self) -> EkData:
        return EkData(public_key_der=self.spki_der, certificate_der=self.certificate_der)


class TpmAttestor:
    """One attestation against one TPM; see the module docstring."""

    def __init__(
        self, tcti: str = DEFAULT_TCTI, *, ek_alg: str = "rsa", require_ek_cert: bool = False
    ) -> None:
        if ek_alg not in EK_TEMPLATE_NAME:
            raise ConfigError(f"unknown EK algorithm {ek_alg!r}", hint="set ek_alg to rsa or ecc")
        self.tcti = tcti
        self.ek_alg = ek_alg
        self.require_ek_cert = require_ek_cert
        self._ctx: Any = None
        self._transient: list[Any] = []  # ESYS_TRs to flush, in creation order
        self._closeable: list[Any] = []  # ESYS_TRs of persistent objects to tr_close
        self._ek_handle: Any = None
        self._ek: EkInfo | None = None
        self._ak_handle: Any = None
        self._ak_name: bytes = b""
        self.ak_blob: AkBlob | None = None  # the AK made by make_ak, to keep for later quotes

    # -- life cycle ---------------------------------------------------------
    def __enter__(self) -> TpmAttestor:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        # The TSS logs every missing optional NV index (nonce, template) as an error; keep it quiet
        # unless the operator asked for TSS logs.
        os.environ.setdefault("TSS2_LOG", "all+NONE")
        from tpm2_pytss import ESAPI, TSS2_Exception

        try:
            self._ctx = ESAPI(self.tcti)
        except TSS2_Exception as exc:
            raise TpmUnavailableError(
                f"cannot open the TPM at {self.tcti!r}: {rc_codes.describe(int(exc.rc))[0]}",
                hint="check that the TPM exists (ls /dev/tpmrm*), that this user may use it (group tss), "
                "or pass --tcti (e.g. swtpm:host=127.0.0.1,port=2321)",
            ) from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise TpmUnavailableError(
                f"cannot open the TPM at {self.tcti!r}: {exc}",
                hint="check the --tcti value and that libtss2-tcti-* for it is installed",
            ) from exc

    def close(self) -> None:
        if self._ctx is None:
            return
        from tpm2_pytss import TSS2_Exception

        for handle in reversed(self._transient):
            try:
                self._ctx.flush_context(handle)
            except TSS2_Exception as exc:
                log.warning("could not flush a transient TPM object: rc 0x%08x", int(exc.rc))
        for handle in self._closeable:
            try:
                self._ctx.tr_close(handle)
            except TSS2_Exception:
                log.debug("tr_close failed", exc_info=True)
        self._transient.clear()
        self._closeable.clear()
        try:
            self._ctx.close()
        finally:
            self._ctx = None
            self._ek_handle = self._ak_handle = None

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        from tpm2_pytss import TSS2_Exception

        if self._ctx is None:
            raise TpmError("the TPM is not open", hint="use TpmAttestor as a context manager")
        try:
            return fn(*args, **kwargs)
        except TSS2_Exception as exc:
            raise _tpm_error(what, int(exc.rc)) from exc

    def _flush(self, handle: Any) -> None:
        if handle in self._transient:
            self._transient.remove(handle)
            self._call("flushing a transient object", self._ctx.flush_context, handle)

    # -- EK -----------------------------------------------------------------
    def read_ek(self) -> EkInfo:
        """Create the EK from its template (NV template and nonce honoured) and read its certificate."""
        if self._ek is not None:
            return self._ek
        from tpm2_pytss.types import TPM2B_SENSITIVE_CREATE
        from tpm2_pytss.utils import NVReadEK, create_ek_template

        ctx = self._ctx
        # NVReadEK lists the NV indices when it is built: a TPM command of its own.
        nv_read = self._call("listing the TPM's NV indices", NVReadEK, ctx)
        cert_raw, template = self._call(
            "reading the EK template and certificate from NV",
            create_ek_template,
            EK_TEMPLATE_NAME[self.ek_alg],
            nv_read,
        )
        from tpm2_pytss.constants import ESYS_TR

        handle, pub, _, _, _ = self._call(
            "creating the EK (TPM2_CreatePrimary in the endorsement hierarchy)",
            ctx.create_primary,
            TPM2B_SENSITIVE_CREATE(),
            template,
            ESYS_TR.ENDORSEMENT,
        )
        self._transient.append(handle)
        self._ek_handle = handle
        public = bytes(pub.publicArea.marshal())
        parsed = tpm2.parse_public(public)
        spki = tpm2.spki_der(parsed)
        cert = clean_nv_certificate(bytes(cert_raw)) if cert_raw else None
        if cert is None and self.require_ek_cert:
            raise EkCertificateError(
                f"no EK certificate in NV index 0x{EK_CERT_INDEX[self.ek_alg]:08x}",
                hint="this TPM has no provisioned EK certificate (common on Intel PTT and AMD fTPM): "
                "trust it on the server by EK hash (nodeagent attest --print-ek-hash), or set "
                "require_ek_cert: false",
            )
        if cert is not None and not same_public_key(cert, spki):
            raise EkCertificateError(
                "the EK certificate in NV does not match the TPM's EK public key",
                hint="the certificate belongs to another key (wrong template, or swtpm set up with "
                "--allow-signing); re-provision the EK certificate or use hash trust",
            )
        self._ek = EkInfo(public=public, spki_der=spki, certificate_der=cert, alg=self.ek_alg)
        log.info("EK %s read; certificate %s", self.ek_alg.upper(), "present" if cert else "absent")
        return self._ek

    # -- SRK and AK ---------------------------------------------------------
    def _srk(self) -> Any:
        from tpm2_pytss import TSS2_Exception
        from tpm2_pytss.constants import ESYS_TR

        ctx = self._ctx
        try:
            handle = ctx.tr_from_tpmpublic(SRK_HANDLE)
            self._closeable.append(handle)
            return handle
        except TSS2_Exception as exc:
            if rc_codes.error_number(int(exc.rc)) != rc_codes.HANDLE:  # not "handle does not exist"
                raise _tpm_error(f"reading the SRK at 0x{SRK_HANDLE:08x}", int(exc.rc)) from exc
        log.info("no SRK at 0x%08x; creating and persisting one", SRK_HANDLE)
        transient, _, _, _, _ = self._call(
            "creating the SRK", ctx.create_primary, None, _srk_template(), ESYS_TR.OWNER
        )
        self._transient.append(transient)
        persistent = self._call(
            f"persisting the SRK at 0x{SRK_HANDLE:08x}",
            ctx.evict_control,
            ESYS_TR.OWNER,
            transient,
            SRK_HANDLE,
        )
        self._closeable.append(persistent)
        self._flush(transient)
        return persistent

    def make_ak(self) -> AttestationParameters:
        """Create and load a fresh AK under the SRK and certify its creation with itself."""
        from tpm2_pytss.constants import TPM2_ALG
        from tpm2_pytss.types import TPMT_SIG_SCHEME

        ctx = self._ctx
        srk = self._srk()
        priv, pub, creation_data, creation_hash, ticket = self._call(
            "creating the AK (TPM2_Create under the SRK)", ctx.create, srk, None, _ak_template()
        )
        ak = self._call("loading the AK", ctx.load, srk, priv, pub)
        self._transient.append(ak)
        scheme = TPMT_SIG_SCHEME(scheme=TPM2_ALG.RSASSA)
        scheme.details.any.hashAlg = TPM2_ALG.SHA256
        attest, signature = self._call(
            "certifying the AK's creation (TPM2_CertifyCreation)",
            ctx.certify_creation,
            ak,
            ak,
            b"",
            creation_hash,
            scheme,
            ticket,
        )
        public = bytes(pub.publicArea.marshal())
        self._ak_handle = ak
        self._ak_name = tpm2.parse_public(public).name()
        self.ak_blob = AkBlob(public=bytes(pub.marshal()), private=bytes(priv.marshal()))
        return AttestationParameters(
            public=public,
            create_data=bytes(creation_data.creationData.marshal()),
            create_attestation=bytes(attest),
            create_signature=bytes(signature.marshal()),
        )

    def attestation_data(self) -> AttestationData:
        """The whole ``tpm`` payload: EK and freshly certified AK parameters."""
        ek = self.read_ek()
        return AttestationData(ek=ek.ek_data, ak=self.make_ak())

    def load_ak(self, blob: AkBlob) -> None:
        """Load a kept AK under the SRK (for a quote); it is flushed on close like every transient."""
        from tpm2_pytss import TSS2_Exception
        from tpm2_pytss.types import TPM2B_PRIVATE, TPM2B_PUBLIC

        public = _unmarshal_exact(TPM2B_PUBLIC, blob.public, "kept AK public", who="ak.json")
        private = _unmarshal_exact(TPM2B_PRIVATE, blob.private, "kept AK private", who="ak.json")
        srk = self._srk()
        try:
            ak = self._ctx.load(srk, private, public)
        except TSS2_Exception as exc:
            advice = rc_codes.advise(int(exc.rc))
            if advice.permanent:
                raise _tpm_error("loading the kept AK", int(exc.rc)) from exc
            # Integrity or key-size errors: the AK was wrapped by another SRK (the TPM was cleared, or the
            # state folder belongs to another machine). A new attestation makes a new AK.
            raise AkUnusableError(
                f"the AK kept in the state folder cannot be loaded into this TPM: {advice.cause}",
                hint="the TPM was cleared or the state folder is another machine's: the agent attests again",
            ) from exc
        self._transient.append(ak)
        self._ak_handle = ak
        self._ak_name = blob.name()

    def quote(self, bank: str, pcrs: tuple[int, ...], nonce: bytes) -> tuple[bytes, bytes]:
        """TPM2_Quote of ``pcrs`` in ``bank`` over ``nonce`` with the loaded AK: (TPMS_ATTEST, TPMT_SIGNATURE)."""
        if self._ak_handle is None:
            raise TpmError(
                "quote() called before an AK was made or loaded", hint="this is a bug in the caller"
            )
        from tpm2_pytss.types import TPM2B_DATA, TPML_PCR_SELECTION

        selection = TPML_PCR_SELECTION.parse(f"{bank}:{','.join(str(p) for p in pcrs)}")
        quoted, signature = self._call(
            f"quoting PCRs {','.join(str(p) for p in pcrs)} of the {bank} bank (TPM2_Quote)",
            self._ctx.quote,
            self._ak_handle,
            selection,
            TPM2B_DATA(nonce),
        )
        return bytes(quoted), bytes(signature.marshal())

    # -- activation ---------------------------------------------------------
    def activate(self, credential: Credential) -> bytes:
        """Answer the server's challenge: TPM2_ActivateCredential with the AK and the EK."""
        if self._ak_handle is None or self._ek_handle is None:
            raise TpmError("activate() called before attestation_data()", hint="this is a bug in the caller")
        from tpm2_pytss.constants import ESYS_TR, TPM2_ALG, TPM2_SE
        from tpm2_pytss.types import TPM2B_ENCRYPTED_SECRET, TPM2B_ID_OBJECT, TPMT_SYM_DEF

        ctx = self._ctx
        blob = _unmarshal_exact(TPM2B_ID_OBJECT, credential.credential_blob, "EC.Credential")
        secret = _unmarshal_exact(TPM2B_ENCRYPTED_SECRET, credential.encrypted_secret, "EC.Secret")
        session = self._call(
            "starting the EK policy session",
            ctx.start_auth_session,
            ESYS_TR.NONE,
            ESYS_TR.NONE,
            TPM2_SE.POLICY,
            TPMT_SYM_DEF(algorithm=TPM2_ALG.NULL),
            TPM2_ALG.SHA256,
        )
        self._transient.append(session)
        try:
            self._call("PolicySecret(endorsement)", ctx.policy_secret, ESYS_TR.ENDORSEMENT, session)
            cert_info = self._call(
                "TPM2_ActivateCredential",
                ctx.activate_credential,
                self._ak_handle,
                self._ek_handle,
                blob,
                secret,
                session1=ESYS_TR.PASSWORD,
                session2=session,
            )
        finally:
            self._flush(session)
        return bytes(cert_info)


def _tpm_error(what: str, rc: int) -> TpmError:
    """A failed TPM command: permanent (a person must act) or worth a retry, as the code says."""
    advice = rc_codes.advise(rc)
    cls = TpmUnusableError if advice.permanent else TpmError
    return cls(f"{what} failed: {advice.cause}", hint=advice.fix)


def _unmarshal_exact(cls: Any, data: bytes, what: str, *, who: str = "the server's") -> Any:
    hint = "remove ak.json and attest again" if who == "ak.json" else "check the server version"
    try:
        obj, used = cls.unmarshal(data)
    except Exception as exc:
        raise TpmError(f"{who} {what} is malformed: {exc}", hint=hint) from exc
    if used != len(data):
        raise TpmError(f"{who} {what} has {len(data) - used} trailing bytes", hint=hint)
    return obj


def _srk_template() -> Any:
    from tpm2_pytss.constants import TPM2_ALG, TPMA_OBJECT
    from tpm2_pytss.types import TPM2B_PUBLIC, TPMT_PUBLIC

    tmpl = TPMT_PUBLIC(
        type=TPM2_ALG.RSA, nameAlg=TPM2_ALG.SHA256, objectAttributes=TPMA_OBJECT(SRK_ATTRIBUTES)
    )
    tmpl.parameters.rsaDetail.symmetric.algorithm = TPM2_ALG.AES
    tmpl.parameters.rsaDetail.symmetric.keyBits.aes = 128
    tmpl.parameters.rsaDetail.symmetric.mode.aes = TPM2_ALG.CFB
    tmpl.parameters.rsaDetail.scheme.scheme = TPM2_ALG.NULL
    tmpl.parameters.rsaDetail.keyBits = 2048
    tmpl.parameters.rsaDetail.exponent = 0
    tmpl.unique.rsa = b"\x00" * 256
    return TPM2B_PUBLIC(publicArea=tmpl)


def _ak_template() -> Any:
    from tpm2_pytss.constants import TPM2_ALG, TPMA_OBJECT
    from tpm2_pytss.types import TPM2B_PUBLIC, TPMT_PUBLIC

    tmpl = TPMT_PUBLIC(
        type=TPM2_ALG.RSA, nameAlg=TPM2_ALG.SHA256, objectAttributes=TPMA_OBJECT(AK_ATTRIBUTES)
    )
    tmpl.parameters.rsaDetail.symmetric.algorithm = TPM2_ALG.NULL
    tmpl.parameters.rsaDetail.scheme.scheme = TPM2_ALG.RSASSA
    tmpl.parameters.rsaDetail.scheme.details.anySig.hashAlg = TPM2_ALG.SHA256
    tmpl.parameters.rsaDetail.keyBits = 2048
    tmpl.parameters.rsaDetail.exponent = 0
    return TPM2B_PUBLIC(publicArea=tmpl)
