"""The trust domain's certificate authority: agent X509-SVIDs and the server's own TLS SVID.

Key material lives in the server's data directory (0700), keys 0600, written
atomically. The CA is created on first start and loaded afterwards; the server
SVID (URI SAN ``spiffe://<td>/spire/server``, no DNS SANs unless configured) is
re-issued whenever less than half of its lifetime remains.

Agent SVIDs are issued from the agent's CSR after its signature is verified;
only the public key is taken from it, like SPIRE.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocol.files import write_atomic
from protocol.spiffe import SpiffeId, server_id
from server.errors import ConfigError, InvalidRequestError

log = logging.getLogger(__name__)

CA_KEY = "ca.key"
CA_CERT = "ca.pem"
SERVER_KEY = "server.key"
SERVER_CERT = "server.pem"
_MAX_CSR_BYTES = 16 * 1024


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path} is not an EC private key")
    return key


@dataclass(frozen=True)
class IssuedSvid:
    cert: x509.Certificate
    chain_der: tuple[bytes, ...]  # leaf first
    spiffe_id: SpiffeId
    serial: int
    expires_at: int  # Unix seconds


def prepare_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` 0700, or check the one that is there; never change a folder we did not make.

    An existing folder that other users can write to is refused (they could swap the CA key or the
    store); one they can only read is used with a warning (the secrets in it are 0600 themselves).
    """
    if not data_dir.exists():
        try:
            data_dir.parent.mkdir(parents=True, exist_ok=True)
            data_dir.mkdir(mode=0o700)
            os.chmod(data_dir, 0o700)  # exactly 0700 whatever the umask: we created it
        except FileExistsError:
            pass  # created meanwhile by another process: checked below like any existing folder
        except OSError as exc:
            raise ConfigError(f"data_dir {data_dir}: cannot create it ({exc.strerror})") from exc
        else:
            return
    try:
        st = os.stat(data_dir)
    except OSError as exc:
        raise ConfigError(f"data_dir {data_dir}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"data_dir {data_dir} exists and is not a folder")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"data_dir {data_dir} belongs to uid {st.st_uid}, not to this nodeserver (uid {os.geteuid()}); "
            "give it a folder of its own (mkdir -m 700)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ConfigError(
            f"data_dir {data_dir} is writable by other users (mode {mode:04o}); nodeserver does not change "
            f"folders it did not create: run `chmod go-w {data_dir}` or point data_dir at a private folder"
        )
    if mode & 0o044:
        log.warning(
            "data_dir %s is readable by other users (mode %04o); 0700 is recommended", data_dir, mode
        )


class CertificateAuthority:
    """The trust domain's CA (ECDSA P-256) with its server SVID."""

    def __init__(self, trust_domain: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.trust_domain = trust_domain
        self._key = key
        self.cert = cert
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        self._server_lock = threading.Lock()

    # -- creation and loading ---------------------------------------------
    @classmethod
    def load_or_create(
        cls, data_dir: Path, trust_domain: str, *, ca_ttl: dt.timedelta
    ) -> CertificateAuthority:
        prepare_data_dir(data_dir)
        key_path, cert_path = data_dir / CA_KEY, data_dir / CA_CERT
        if key_path.exists() and cert_path.exists():
            key = _load_key(key_path)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            if cert.public_key().public_numbers() != key.public_key().public_numbers():  # type: ignore[union-attr]
                raise ConfigError(
                    f"{cert_path} does not match {key_path}; restore both from the same backup"
                )
            uris = _uri_sans(cert)
            if uris != [f"spiffe://{trust_domain}"]:
                raise ConfigError(
                    f"the CA in {data_dir} belongs to trust domain {uris}, not spiffe://{trust_domain}; "
                    "use another data_dir for another trust domain"
                )
            if cert.not_valid_after_utc <= _now():
                raise ConfigError(
                    f"the CA certificate {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}"
                )
            log.info("loaded CA for %s from %s", trust_domain, data_dir)
            return cls(trust_domain, key, cert)
        if key_path.exists() or cert_path.exists():
            raise ConfigError(
                f"{data_dir} holds only one of {CA_KEY} and {CA_CERT}; restore both or remove both"
            )
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodetrust"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"{trust_domain} CA"),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + ca_ttl)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        write_atomic(key_path, _key_pem(key))
        write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        log.warning("created a new CA for trust domain %s in %s", trust_domain, data_dir)
        return cls(trust_domain, key, cert)

    def bundle_pem(self) -> bytes:
        """The trust bundle agents need (``nodeserver bundle``)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    # -- issuance ------------------------------------------------------------
    def _issue(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey,
        spiffe_id: SpiffeId,
        ttl: dt.timedelta,
        *,
        dns_names: tuple[str, ...] = (),
    ) -> IssuedSvid:
        now = _now()
        not_after = min(now + ttl, self.cert.not_valid_after_utc)
        serial = x509.random_serial_number()
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(str(spiffe_id))]
        sans += [x509.DNSName(n) for n in dns_names]
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SPIRE"),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(serial)
            .not_valid_before(now - dt.timedelta(seconds=30))
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski), critical=False
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        leaf = cert.public_bytes(serialization.Encoding.DER)
        return IssuedSvid(
            cert=cert,
            chain_der=(leaf,),
            spiffe_id=spiffe_id,
            serial=serial,
            expires_at=int(not_after.timestamp()),
        )

    @staticmethod
    def verify_csr(csr_der: bytes) -> ec.EllipticCurvePublicKey | rsa.RSAPublicKey:
        """Parse a DER CSR, verify its signature and return its public key (the only thing used)."""
        if len(csr_der) > _MAX_CSR_BYTES:
            raise InvalidRequestError(
                f"CSR of {len(csr_der)} bytes exceeds {_MAX_CSR_BYTES}", reason="bad_csr"
            )
        try:
            csr = x509.load_der_x509_csr(csr_der)
        except ValueError as exc:
            raise InvalidRequestError("the CSR is not a DER PKCS#10 request", reason="bad_csr") from exc
        try:
            valid = csr.is_signature_valid
            key = csr.public_key()
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the CSR cannot be checked: {exc}", reason="bad_csr") from exc
        if not valid:
            raise InvalidRequestError("the CSR signature does not verify", reason="bad_csr_signature")
        if isinstance(key, ec.EllipticCurvePublicKey):
            if key.curve.name not in ("secp256r1", "secp384r1"):
                raise InvalidRequestError(
                    f"CSR key on curve {key.curve.name}; use P-256 or P-384", reason="bad_csr"
                )
            return key
        if isinstance(key, rsa.RSAPublicKey):
            if key.key_size < 2048:
                raise InvalidRequestError(
                    f"CSR RSA key of {key.key_size} bits; use at least 2048", reason="bad_csr"
                )
            return key
        raise InvalidRequestError(f"CSR key type {type(key).__name__} is not supported", reason="bad_csr")

    def issue_agent_svid(
        self, key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey, spiffe_id: SpiffeId, ttl: dt.timedelta
    ) -> IssuedSvid:
        return self._issue(key, spiffe_id, ttl)

    def sign_agent_csr(self, csr_der: bytes, spiffe_id: SpiffeId, ttl: dt.timedelta) -> IssuedSvid:
        """Issue an agent X509-SVID for the public key of a CSR whose signature verifies."""
        return self._issue(self.verify_csr(csr_der), spiffe_id, ttl)

    def issue_server_svid(
        self, key: ec.EllipticCurvePrivateKey, ttl: dt.timedelta, dns_names: tuple[str, ...] = ()
    ) -> IssuedSvid:
        return self._issue(key.public_key(), server_id(self.trust_domain), ttl, dns_names=dns_names)


class ServerSvid:
    """The server's own TLS key and SVID, kept in the data directory and renewed at half-life."""

    def __init__(
        self, ca: CertificateAuthority, data_dir: Path, ttl: dt.timedelta, dns_names: tuple[str, ...]
    ) -> None:
        self._ca = ca
        self._dir = data_dir
        self._ttl = ttl
        self._dns = dns_names
        self._lock = threading.Lock()
        self.key_pem = b""
        self.chain_pem = b""
        self.not_after = _now()
        self.not_before = _now()
        self.generation = 0
        self._load_or_issue()

    def _load_or_issue(self) -> None:
        key_path, cert_path = self._dir / SERVER_KEY, self._dir / SERVER_CERT
        if key_path.exists() and cert_path.exists():
            try:
                key = _load_key(key_path)
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                if (
                    cert.issuer == self._ca.cert.subject
                    and cert.public_key().public_numbers() == key.public_key().public_numbers()  # type: ignore[union-attr]
                    and _uri_sans(cert) == [str(server_id(self._ca.trust_domain))]
                    and sorted(_dns_sans(cert)) == sorted(self._dns)
                    and not self._needs_renewal(cert)
                ):
                    self._set(key, cert)
                    return
            except (ValueError, ConfigError):
                log.warning("the stored server SVID is unusable; issuing a new one", exc_info=True)
        self.renew()

    def _needs_renewal(self, cert: x509.Certificate) -> bool:
        life = cert.not_valid_after_utc - cert.not_valid_before_utc
        return _now() >= cert.not_valid_before_utc + life / 2

    def _set(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key_pem = _key_pem(key)
        self.chain_pem = cert.public_bytes(serialization.Encoding.PEM)
        self.not_after = cert.not_valid_after_utc
        self.not_before = cert.not_valid_before_utc
        self.generation += 1

    def renew(self) -> None:
        with self._lock:
            key = ec.generate_private_key(ec.SECP256R1())
            svid = self._ca.issue_server_svid(key, self._ttl, self._dns)
            write_atomic(self._dir / SERVER_KEY, _key_pem(key))
            write_atomic(
                self._dir / SERVER_CERT, svid.cert.public_bytes(serialization.Encoding.PEM), mode=0o644
            )
            self._set(key, svid.cert)
            log.info("issued the server SVID %s, valid until %s", svid.spiffe_id, self.not_after.isoformat())

    def renew_if_due(self) -> bool:
        life = self.not_after - self.not_before
        if _now() >= self.not_before + life / 2:
            self.renew()
            return True
        return False


def _uri_sans(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.UniformResourceIdentifier)


def _dns_sans(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.DNSName)
