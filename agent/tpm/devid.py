"""A DevID key in the TPM, the way SPIRE's built-in ``tpm_devid`` attestor uses it.

:class:`DevidTpm` is one session with the TPM (open it, use it, close it: every transient object
and session it made is flushed). It does what spire-agent v1.13.3's ``tpmutil.Session`` does, with
the same templates, so a key made here is loaded by spire-agent and the other way round:

* the parent is the "SRK" SPIRE re-creates for every attestation: ``TPM2_CreatePrimary`` in the
  owner hierarchy from go-tpm-tools' SRK template with the unique field emptied (RSA-2048 for an
  RSA DevID and for the AK, NIST P-256 for an ECC DevID); nothing is persisted;
* :meth:`create_devid` makes an ordinary signing child of it (sign, fixedTPM, fixedParent,
  sensitiveDataOrigin, userWithAuth; RSASSA-SHA256 or ECDSA-SHA256) and returns the blobs that
  spire-agent reads: ``devid_pub_path`` is the TPMT_PUBLIC and ``devid_priv_path`` the contents of
  the TPM2B_PRIVATE, both without their size prefix;
* :meth:`make_ak` makes a fresh AK from go-tpm-tools' RSA AK template (restricted signing),
  :meth:`certify_devid` has it TPM2_Certify the DevID key with no qualifying data, :meth:`read_ek`
  re-creates the EK from the TCG RSA template and reads its certificate from NV 0x01C00002,
  :meth:`sign` signs a nonce with the DevID key (SHA-256), :meth:`activate` runs
  TPM2_ActivateCredential (AK by password, EK by a PolicySecret(endorsement) session).

The TPM has 3 transient object slots and no resource manager behind swtpm's socket: at most the
DevID, the AK and the EK are loaded at once (each SRK is flushed as soon as its child is loaded).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.errors import EkCertificateError, TpmError, TpmUnavailableError, TpmUnusableError
from agent.tpm import rc as rc_codes
from agent.tpm.ekcert import clean_nv_certificate, same_public_key
from protocol import tpm2
from protocol.errors import TpmStructureError

log = logging.getLogger(__name__)
T = TypeVar("T")

EK_CERT_INDEX = 0x01C00002
SRK_ATTRIBUTES = 0x00030472  # fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|noDA|restricted|decrypt
DEVID_ATTRIBUTES = 0x00040072  # sign|fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth
AK_ATTRIBUTES = 0x00050072  # sign|restricted|fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth
KEY_ALGS = ("rsa", "ecc")


@dataclass(frozen=True)
class DevidBlobs:
    public: bytes  # TPMT_PUBLIC (devid_pub_path)
    private: bytes  # TPM2B_PRIVATE contents (devid_priv_path)

    @property
    def alg(self) -> str:
        return "rsa" if tpm2.parse_public(self.public).type == tpm2.Alg.RSA else "ecc"


def _tpm_error(what: str, rc: int) -> TpmError:
    advice = rc_codes.advise(rc)
    cls = TpmUnusableError if advice.permanent else TpmError
    return cls(f"{what} failed: {advice.cause}", hint=advice.fix)


def srk_template(alg: str) -> Any:
    """go-tpm-tools' SRKTemplateHigh{RSA,ECC} with the unique field emptied, as SPIRE uses it."""
    from tpm2_pytss.constants import TPM2_ALG, TPM2_ECC, TPMA_OBJECT
    from tpm2_pytss.types import TPM2B_PUBLIC, TPMT_PUBLIC

    kind = TPM2_ALG.RSA if alg == "rsa" else TPM2_ALG.ECC
    tmpl = TPMT_PUBLIC(type=kind, nameAlg=TPM2_ALG.SHA256, objectAttributes=TPMA_OBJECT(SRK_ATTRIBUTES))
    if alg == "rsa":
        p = tmpl.parameters.rsaDetail
        p.symmetric.algorithm = TPM2_ALG.AES
        p.symmetric.keyBits.aes = 128
        p.symmetric.mode.aes = TPM2_ALG.CFB
        p.scheme.scheme = TPM2_ALG.NULL
        p.keyBits = 2048
        p.exponent = 0
    else:
        e = tmpl.parameters.eccDetail
        e.symmetric.algorithm = TPM2_ALG.AES
        e.symmetric.keyBits.aes = 128
        e.symmetric.mode.aes = TPM2_ALG.CFB
        e.scheme.scheme = TPM2_ALG.NULL
        e.curveID = TPM2_ECC.NIST_P256
        e.kdf.scheme = TPM2_ALG.NULL
    return TPM2B_PUBLIC(publicArea=tmpl)


def devid_template(alg: str) -> Any:
    """SPIRE's test provisioning (TCG DevID spec 7.3.4.1): an ordinary SHA-256 signing key."""
    from tpm2_pytss.constants import TPM2_ALG, TPM2_ECC, TPMA_OBJECT
    from tpm2_pytss.types import TPM2B_PUBLIC, TPMT_PUBLIC

    kind = TPM2_ALG.RSA if alg == "rsa" else TPM2_ALG.ECC
    tmpl = TPMT_PUBLIC(type=kind, nameAlg=TPM2_ALG.SHA256, objectAttributes=TPMA_OBJECT(DEVID_ATTRIBUTES))
    if alg == "rsa":
        p = tmpl.parameters.rsaDetail
        p.symmetric.algorithm = TPM2_ALG.NULL
        p.scheme.scheme = TPM2_ALG.RSASSA
        p.scheme.details.anySig.hashAlg = TPM2_ALG.SHA256
        p.keyBits = 2048
        p.exponent = 0
    else:
        e = tmpl.parameters.eccDetail
        e.symmetric.algorithm = TPM2_ALG.NULL
        e.scheme.scheme = TPM2_ALG.ECDSA
        e.scheme.details.anySig.hashAlg = TPM2_ALG.SHA256
        e.curveID = TPM2_ECC.NIST_P256
        e.kdf.scheme = TPM2_ALG.NULL
    return TPM2B_PUBLIC(publicArea=tmpl)


def ak_template() -> Any:
    """go-tpm-tools' AKTemplateRSA: RSA-2048, RSASSA-SHA256, restricted signing."""
    from tpm2_pytss.constants import TPM2_ALG, TPMA_OBJECT
    from tpm2_pytss.types import TPM2B_PUBLIC, TPMT_PUBLIC

    tmpl = TPMT_PUBLIC(
        type=TPM2_ALG.RSA, nameAlg=TPM2_ALG.SHA256, objectAttributes=TPMA_OBJECT(AK_ATTRIBUTES)
    )
    p = tmpl.parameters.rsaDetail
    p.symmetric.algorithm = TPM2_ALG.NULL
    p.scheme.scheme = TPM2_ALG.RSASSA
    p.scheme.details.anySig.hashAlg = TPM2_ALG.SHA256
    p.keyBits = 2048
    p.exponent = 0
    return TPM2B_PUBLIC(publicArea=tmpl)


class DevidTpm:
    """One session with the TPM for DevID work; see the module docstring."""

    def __init__(self, tcti: str) -> None:
        self.tcti = tcti
        self._ctx: Any = None
        self._transient: list[Any] = []
        self._devid: Any = None
        self._devid_alg = ""
        self._devid_public = b""
        self._ak: Any = None
        self._ak_public = b""
        self._ek: Any = None

    def __enter__(self) -> DevidTpm:
        os.environ.setdefault("TSS2_LOG", "all+NONE")
        from tpm2_pytss import ESAPI, TSS2_Exception

        try:
            self._ctx = ESAPI(self.tcti)
        except TSS2_Exception as exc:
            raise TpmUnavailableError(
                f"cannot open the TPM at {self.tcti!r}: {rc_codes.describe(int(exc.rc))[0]}",
                hint="check the TPM device or the --tcti value (e.g. swtpm:path=/run/swtpm/tpm.sock)",
            ) from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise TpmUnavailableError(
                f"cannot open the TPM at {self.tcti!r}: {exc}", hint="check --tcti"
            ) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctx is None:
            return
        from tpm2_pytss import TSS2_Exception

        for handle in reversed(self._transient):
            try:
                self._ctx.flush_context(handle)
            except TSS2_Exception as err:
                log.warning("could not flush a transient TPM object: rc 0x%08x", int(err.rc))
        self._transient.clear()
        try:
            self._ctx.close()
        finally:
            self._ctx = None

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        from tpm2_pytss import TSS2_Exception

        if self._ctx is None:
            raise TpmError("the TPM is not open", hint="use DevidTpm as a context manager")
        try:
            return fn(*args, **kwargs)
        except TSS2_Exception as exc:
            raise _tpm_error(what, int(exc.rc)) from exc

    def _flush(self, handle: Any) -> None:
        if handle in self._transient:
            self._transient.remove(handle)
            self._call("flushing a transient object", self._ctx.flush_context, handle)

    def _srk(self, alg: str) -> Any:
        from tpm2_pytss.constants import ESYS_TR

        handle, _, _, _, _ = self._call(
            f"creating the {alg.upper()} storage key (TPM2_CreatePrimary, owner hierarchy)",
            self._ctx.create_primary,
            None,
            srk_template(alg),
            ESYS_TR.OWNER,
        )
        self._transient.append(handle)
        return handle

    # -- the DevID key ---------------------------------------------------------
    def create_devid(self, alg: str = "rsa") -> DevidBlobs:
        """A new DevID key under SPIRE's storage key (not loaded; load it with :meth:`load_devid`)."""
        if alg not in KEY_ALGS:
            raise TpmError(f"unknown DevID key algorithm {alg!r}", hint="use rsa or ecc")
        srk = self._srk(alg)
        try:
            priv, pub, _, _, _ = self._call(
                "creating the DevID key (TPM2_Create)", self._ctx.create, srk, None, devid_template(alg)
            )
        finally:
            self._flush(srk)
        return DevidBlobs(public=bytes(pub.publicArea.marshal()), private=bytes(priv.marshal())[2:])

    def load_devid(self, blobs: DevidBlobs) -> None:
        from tpm2_pytss.types import TPM2B_PRIVATE, TPM2B_PUBLIC

        try:
            pub = tpm2.parse_public(blobs.public)
        except TpmStructureError as exc:
            raise TpmError(f"the DevID public blob is not a TPMT_PUBLIC: {exc}", hint="enrol again") from exc
        alg = "rsa" if pub.type == tpm2.Alg.RSA else "ecc"
        public, _ = TPM2B_PUBLIC.unmarshal(tpm2.tpm2b(blobs.public))
        private, _ = TPM2B_PRIVATE.unmarshal(tpm2.tpm2b(blobs.private))
        srk = self._srk(alg)
        try:
            handle = self._call(
                "loading the DevID key (TPM2_Load); a TPM cleared since enrolment, or another machine's blobs",
                self._ctx.load,
                srk,
                private,
                public,
            )
        finally:
            self._flush(srk)
        self._transient.append(handle)
        self._devid, self._devid_alg, self._devid_public = handle, alg, blobs.public

    # -- AK, EK, certification, proofs -------------------------------------------
    def make_ak(self) -> bytes:
        """A fresh AK (TPMT_PUBLIC), loaded."""
        srk = self._srk("rsa")
        try:
            priv, pub, _, _, _ = self._call(
                "creating the AK (TPM2_Create)", self._ctx.create, srk, None, ak_template()
            )
            handle = self._call("loading the AK", self._ctx.load, srk, priv, pub)
        finally:
            self._flush(srk)
        self._transient.append(handle)
        self._ak, self._ak_public = handle, bytes(pub.publicArea.marshal())
        return self._ak_public

    def read_ek(self) -> tuple[bytes, bytes]:
        """(EK certificate DER, EK TPMT_PUBLIC): the RSA EK re-created from its template."""
        from tpm2_pytss.constants import ESYS_TR
        from tpm2_pytss.types import TPM2B_SENSITIVE_CREATE
        from tpm2_pytss.utils import NVReadEK, create_ek_template

        nv_read = self._call("listing the TPM's NV indices", NVReadEK, self._ctx)
        cert_raw, template = self._call(
            "reading the RSA EK template and certificate from NV", create_ek_template, "EK-RSA2048", nv_read
        )
        cert = clean_nv_certificate(bytes(cert_raw)) if cert_raw else None
        if cert is None:
            raise EkCertificateError(
                f"no EK certificate in NV index 0x{EK_CERT_INDEX:08x}",
                hint="SPIRE's tpm_devid needs the RSA EK certificate the TPM manufacturer provisioned",
            )
        handle, pub, _, _, _ = self._call(
            "creating the EK (TPM2_CreatePrimary, endorsement hierarchy)",
            self._ctx.create_primary,
            TPM2B_SENSITIVE_CREATE(),
            template,
            ESYS_TR.ENDORSEMENT,
        )
        self._transient.append(handle)
        self._ek = handle
        public = bytes(pub.publicArea.marshal())
        if not same_public_key(cert, tpm2.spki_der(tpm2.parse_public(public))):
            raise EkCertificateError(
                "the EK certificate in NV does not match the TPM's RSA EK",
                hint="re-provision the EK certificate (swtpm: do not use --allow-signing)",
            )
        return cert, public

    def certify_devid(self) -> tuple[bytes, bytes]:
        """TPM2_Certify(DevID by the AK, no qualifying data): (TPMS_ATTEST, TPMT_SIGNATURE)."""
        from tpm2_pytss.constants import TPM2_ALG
        from tpm2_pytss.types import TPMT_SIG_SCHEME

        if self._devid is None or self._ak is None:
            raise TpmError("certify_devid() before load_devid() and make_ak()", hint="a bug in the caller")
        scheme = TPMT_SIG_SCHEME(scheme=TPM2_ALG.RSASSA)
        scheme.details.any.hashAlg = TPM2_ALG.SHA256
        attest, signature = self._call(
            "certifying the DevID key with the AK (TPM2_Certify)",
            self._ctx.certify,
            self._devid,
            self._ak,
            b"",
            scheme,
        )
        return bytes(attest), bytes(signature.marshal())

    def sign(self, data: bytes) -> bytes:
        """The DevID key's SHA-256 signature: PKCS#1 v1.5 bytes (RSA) or a DER ECDSA-Sig-Value (ECC)."""
        import hashlib

        from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
        from tpm2_pytss.constants import TPM2_ALG, TPM2_RH, TPM2_ST
        from tpm2_pytss.types import TPMT_SIG_SCHEME, TPMT_TK_HASHCHECK

        if self._devid is None:
            raise TpmError("sign() before load_devid()", hint="a bug in the caller")
        scheme = TPMT_SIG_SCHEME(scheme=TPM2_ALG.RSASSA if self._devid_alg == "rsa" else TPM2_ALG.ECDSA)
        scheme.details.any.hashAlg = TPM2_ALG.SHA256
        ticket = TPMT_TK_HASHCHECK(tag=TPM2_ST.HASHCHECK, hierarchy=TPM2_RH.NULL)
        sig = self._call(
            "signing with the DevID key (TPM2_Sign)",
            self._ctx.sign,
            self._devid,
            hashlib.sha256(data).digest(),
            scheme,
            ticket,
        )
        if self._devid_alg == "rsa":
            return bytes(sig.signature.rsassa.sig)
        r = int.from_bytes(bytes(sig.signature.ecdsa.signatureR), "big")
        s = int.from_bytes(bytes(sig.signature.ecdsa.signatureS), "big")
        return encode_dss_signature(r, s)

    def activate(self, credential: bytes, secret: bytes) -> bytes:
        """TPM2_ActivateCredential with the AK and the EK; the blobs come without their size prefix."""
        from tpm2_pytss.constants import ESYS_TR, TPM2_ALG, TPM2_SE
        from tpm2_pytss.types import TPM2B_ENCRYPTED_SECRET, TPM2B_ID_OBJECT, TPMT_SYM_DEF

        if self._ak is None or self._ek is None:
            raise TpmError("activate() before make_ak() and read_ek()", hint="a bug in the caller")
        try:
            blob, _ = TPM2B_ID_OBJECT.unmarshal(tpm2.tpm2b(credential))
            enc, _ = TPM2B_ENCRYPTED_SECRET.unmarshal(tpm2.tpm2b(secret))
        except Exception as exc:
            raise TpmError(
                f"the server's credential is malformed: {exc}", hint="check the server version"
            ) from exc
        session = self._call(
            "starting the EK policy session",
            self._ctx.start_auth_session,
            ESYS_TR.NONE,
            ESYS_TR.NONE,
            TPM2_SE.POLICY,
            TPMT_SYM_DEF(algorithm=TPM2_ALG.NULL),
            TPM2_ALG.SHA256,
        )
        self._transient.append(session)
        try:
            self._call("PolicySecret(endorsement)", self._ctx.policy_secret, ESYS_TR.ENDORSEMENT, session)
            out = self._call(
                "TPM2_ActivateCredential",
                self._ctx.activate_credential,
                self._ak,
                self._ek,
                blob,
                enc,
                session1=ESYS_TR.PASSWORD,
                session2=session,
            )
        finally:
            self._flush(session)
        return bytes(out)
