"""The server's EK trust decision: hash allowlist, manufacturer CA chain, or both.

Use::

    trust = EkTrust.load(EkTrustConfig(ca_dir=Path("/etc/nodeserver/ek-ca"), hash_dir=None))
    verdict = trust.verify(attestation_data.ek)
    verdict.raise_if_denied()          # EkNotTrustedError(reason=verdict.reason_code)

:meth:`EkTrust.verify` never raises for anything an agent can send: it returns
an :class:`EkVerdict`, denied with a stable ``reason_code`` and a human
``reason`` that names what failed and what to do. :meth:`EkVerdict.raise_if_denied`
turns a denial into :class:`server.errors.EkNotTrustedError` (an
``AttestationDeniedError``, so gRPC ``PERMISSION_DENIED``) for callers that
prefer exceptions. Configuration problems raise :class:`server.errors.ConfigError`
from :meth:`EkTrust.load`.

Modes (``mode``): ``hash`` (the EK public-key hash is a file name in ``hash_dir``),
``ca`` (the EK certificate chains to ``ca_dir``), ``ca_or_hash`` (either; the
default when both directories are set, as upstream) and ``ca_and_hash`` (both,
spire-tpm-plugin#16). Whenever the CA path looks at a certificate, its public
key must equal the PUBLIC KEY block the agent sent (upstream does not check).
See docs/ek-trust.md.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from protocol.der import DerError
from protocol.tpm_payload import EkData
from server.ek.cadir import CaDirectory
from server.ek.certificate import Certificate, parse_certificate
from server.ek.config import EkTrustConfig, validate
from server.ek.hashes import HashAllowlist
from server.ek.keys import parse_spki
from server.ek.profile import security_problem, tcg_profile_issues
from server.ek.store import CHAIN_INCOMPLETE, CaStore, ChainCandidates, SkippedFile, select_path
from server.errors import EkNotTrustedError

log = logging.getLogger(__name__)


OK = "ok"
HASH_NOT_LISTED = "ek_hash_not_listed"
NOT_TRUSTED = "ek_not_trusted"
CERT_MISSING = "ek_cert_missing"
CERT_UNPARSABLE = "ek_cert_unparsable"
KEY_MISMATCH = "ek_cert_key_mismatch"
CERT_PROFILE = "ek_cert_profile"


@dataclass
class EkVerdict:
    """The trust decision for one EK. ``reason_code`` is ``"ok"`` when trusted.

    Not frozen, so it satisfies the servicer's ``EkVerdictLike`` protocol (plain
    attributes); every call returns a fresh instance, nothing shares it.
    """

    trusted: bool
    method: str  # "hash" | "ca" | "ca+hash" when trusted, "" when denied
    reason: str
    reason_code: str
    chain: tuple[str, ...] = ()  # subjects, EK certificate first, trust anchor last
    ek_hash: str = ""
    tpm: str = ""  # manufacturer/model/version from the certificate's TCG SAN
    quirks: tuple[str, ...] = ()  # lenient-parsing deviations seen in the chain
    warnings: tuple[str, ...] = ()  # TCG profile deviations (tcg_profile: warn)

    def raise_if_denied(self) -> None:
        if not self.trusted:
            raise EkNotTrustedError(self.reason, reason=self.reason_code)


@dataclass(frozen=True)
class _CaOutcome:
    ok: bool
    code: str
    reason: str
    chain: tuple[str, ...] = ()
    tpm: str = ""
    quirks: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass
class _LeafEntry:
    """What is known about one EK certificate against one CA snapshot (the cached part of verify)."""

    cert: Certificate | None
    failure: tuple[str, str] | None  # (code, reason) independent of time and of the PUBLIC KEY block
    candidates: ChainCandidates | None = None
    warnings: tuple[str, ...] = ()
    key_matches: dict[bytes, bool] = field(default_factory=dict)


class EkTrust:
    """Decides whether an agent's EK is trusted. Thread-safe; build it with :meth:`load`."""

    def __init__(
        self,
        config: EkTrustConfig,
        mode: str,
        ca: CaDirectory | None,
        hashes: HashAllowlist | None,
        clock: Callable[[], datetime],
    ) -> None:
        self.config = config
        self.mode = mode
        self._ca = ca
        self._hashes = hashes
        self._clock = clock
        self._policy = config.chain_policy()
        self._cache: OrderedDict[tuple[bytes, int], _LeafEntry] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._next_check = time.monotonic() + config.recheck_interval_s
        self.cache_hits = 0
        self.cache_misses = 0
        self._warned: set[object] = set()

    @classmethod
    def load(cls, config: EkTrustConfig, *, clock: Callable[[], datetime] | None = None) -> EkTrust:
        """Validate ``config`` and read the directories; raises ConfigError (fail closed)."""
        mode = validate(config)
        hashes: HashAllowlist | None = None
        if config.hash_dir is not None and mode != "ca":
            hashes = HashAllowlist(config.hash_dir)
            hashes.refresh(force=True)
        ca: CaDirectory | None = None
        if config.ca_dir is not None and mode != "hash":
            ca = CaDirectory(config.ca_dir, lenient=config.lenient_parsing)
        log.info(
            "EK trust: mode %s; ca_dir %s (%s certificates); hash_dir %s (%s hashes)",
            mode,
            config.ca_dir,
            len(ca.store) if ca is not None else "-",
            config.hash_dir,
            len(hashes) if hashes is not None else "-",
        )
        return cls(config, mode, ca, hashes, clock or _utcnow)

    # -- introspection ---------------------------------------------------------------------------

    @property
    def skipped_files(self) -> tuple[SkippedFile, ...]:
        """CA-directory files that were skipped (wholly or in part) at the last load."""
        return self._ca.store.skipped if self._ca is not None else ()

    @property
    def ca_certificate_count(self) -> int:
        return len(self._ca.store) if self._ca is not None else 0

    @property
    def hash_count(self) -> int:
        return len(self._hashes) if self._hashes is not None else 0

    @property
    def generation(self) -> int:
        """Changes whenever the CA snapshot is replaced."""
        return self._ca.store.generation if self._ca is not None else 0

    def reload(self) -> None:
        """Re-read both directories now (e.g. on SIGHUP)."""
        if self._hashes is not None:
            self._hashes.refresh(force=True)
        if self._ca is not None and self._ca.refresh(force=True):
            self._clear_cache()

    # -- the decision ------------------------------------------------------------------------------

    def verify(self, ek: EkData, now: datetime | None = None) -> EkVerdict:
        """Decide whether ``ek`` is trusted at ``now`` (default: the clock given to :meth:`load`)."""
        self._maybe_refresh()
        when = now if now is not None else self._clock()
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        ek_hash = ek.pub_hash
        listed = self._hashes.contains(ek_hash) if self._hashes is not None else False
        if self.mode == "hash":
            if listed:
                return EkVerdict(
                    True, "hash", f"EK public-key hash {ek_hash} is listed in hash_dir", OK, ek_hash=ek_hash
                )
            return self._denied(HASH_NOT_LISTED, self._not_listed(ek_hash), ek_hash)
        if ek.certificate_der is None:
            if self.mode == "ca_or_hash" and listed:
                return EkVerdict(
                    True, "hash", f"EK public-key hash {ek_hash} is listed in hash_dir", OK, ek_hash=ek_hash
                )
            if self.mode == "ca_or_hash":
                return self._denied(
                    NOT_TRUSTED, f"the agent sent no EK certificate and {self._not_listed(ek_hash)}", ek_hash
                )
            return self._denied(CERT_MISSING, _NO_CERTIFICATE, ek_hash)
        ca = self._check_ca(ek.certificate_der, ek.public_key_der, when) if self._ca is not None else _NO_CA
        if self.mode == "ca_and_hash" and ca.ok and not listed:
            return self._denied(
                HASH_NOT_LISTED,
                f"mode ca_and_hash needs both: the certificate is valid but {self._not_listed(ek_hash)}",
                ek_hash,
            )
        if ca.ok:
            method = "ca+hash" if listed else "ca"
            return EkVerdict(True, method, ca.reason, OK, ca.chain, ek_hash, ca.tpm, ca.quirks, ca.warnings)
        if self.mode == "ca_or_hash" and listed and ca.code != KEY_MISMATCH:
            reason = f"EK public-key hash {ek_hash} is listed in hash_dir (certificate: {ca.reason})"
            return EkVerdict(True, "hash", reason, OK, (), ek_hash, ca.tpm, ca.quirks, ca.warnings)
        reason = ca.reason
        if self._hashes is not None and not listed:
            reason += f"; and {self._not_listed(ek_hash)}"
        return EkVerdict(False, "", reason, ca.code, (), ek_hash, ca.tpm, ca.quirks, ca.warnings)

    def _denied(self, code: str, reason: str, ek_hash: str) -> EkVerdict:
        return EkVerdict(False, "", reason, code, ek_hash=ek_hash)

    def _not_listed(self, ek_hash: str) -> str:
        directory = self.config.hash_dir
        if self._hashes is None or directory is None:
            return f"there is no hash_dir to list its hash {ek_hash} in"
        return (
            f"EK public-key hash {ek_hash} is not listed in hash_dir {directory}: "
            f"to trust it, create {directory / ek_hash}"
        )

    def _check_ca(self, cert_der: bytes, spki_der: bytes, now: datetime) -> _CaOutcome:
        store = self._ca.store if self._ca is not None else None
        if store is None:
            return _NO_CA
        entry = self._entry(cert_der, store)
        cert = entry.cert
        if cert is None:
            code, reason = entry.failure or (CERT_UNPARSABLE, "EK certificate cannot be parsed")
            return _CaOutcome(False, code, reason)
        tpm = _tpm_text(cert)
        quirks = tuple(sorted(cert.quirks))
        if not _key_matches(entry, cert, spki_der):
            return _CaOutcome(
                False, KEY_MISMATCH, _key_mismatch_reason(cert, spki_der), tpm=tpm, quirks=quirks
            )
        if entry.failure is not None or entry.candidates is None:
            code, reason = entry.failure or (CERT_UNPARSABLE, "EK certificate cannot be used")
            return _CaOutcome(False, code, reason, tpm=tpm, quirks=quirks, warnings=entry.warnings)
        path, time_failure = select_path(entry.candidates.paths, now)
        if path is None:
            failure = time_failure or entry.candidates.failure
            code, reason = (
                (failure.code, failure.message) if failure else (CHAIN_INCOMPLETE, "no certificate path")
            )
            return _CaOutcome(False, code, reason, tpm=tpm, quirks=quirks, warnings=entry.warnings)
        anchor = path[-1]
        chain_quirks = tuple(sorted({q for c in path for q in c.quirks}))
        reason = f"EK certificate chains to '{anchor.display}' ({store.where(anchor)}) in ca_dir"
        chain = tuple(c.display for c in path)
        return _CaOutcome(True, OK, reason, chain, tpm, chain_quirks, entry.warnings)

    def _entry(self, cert_der: bytes, store: CaStore) -> _LeafEntry:
        key = (hashlib.sha256(cert_der).digest(), store.generation)
        size = self.config.cache_size
        if size:
            with self._cache_lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
                    self.cache_hits += 1
                    return entry
        entry = self._build_entry(cert_der, store)
        if size:
            with self._cache_lock:
                self.cache_misses += 1
                self._cache[key] = entry
                while len(self._cache) > size:
                    self._cache.popitem(last=False)
        return entry

    def _build_entry(self, cert_der: bytes, store: CaStore) -> _LeafEntry:
        try:
            cert = parse_certificate(cert_der)
        except DerError as exc:
            return _LeafEntry(None, (CERT_UNPARSABLE, f"EK certificate cannot be parsed: {exc}"))
        if cert.quirks and not self.config.lenient_parsing:
            reason = (
                f"EK certificate (serial {cert.serial_hex}) needs lenient parsing "
                f"({', '.join(sorted(cert.quirks))}) and lenient_parsing is false"
            )
            return _LeafEntry(None, (CERT_UNPARSABLE, reason))
        problem = security_problem(cert, self._policy)
        if problem is not None:
            return _LeafEntry(
                cert, (CERT_PROFILE, f"{problem} [issuer '{cert.issuer.text}', serial {cert.serial_hex}]")
            )
        warnings: tuple[str, ...] = ()
        if self.config.tcg_profile != "ignore":
            warnings = tcg_profile_issues(cert)
            if warnings and self.config.tcg_profile == "enforce":
                reason = (
                    f"EK certificate (issuer '{cert.issuer.text}', serial {cert.serial_hex}) does not "
                    f"follow the TCG EK profile: {'; '.join(warnings)} (tcg_profile: warn accepts it)"
                )
                return _LeafEntry(cert, (CERT_PROFILE, reason), warnings=warnings)
            if warnings and self._first_time((cert.issuer.key, warnings)):
                log.warning(
                    "EK certificates of '%s' deviate from the TCG EK profile (first: serial %s): %s; "
                    "accepted (tcg_profile: warn); logged once per issuer and deviation",
                    cert.issuer.text,
                    cert.serial_hex,
                    "; ".join(warnings),
                )
        return _LeafEntry(cert, None, store.build_paths(cert, self._policy), warnings)

    def _first_time(self, key: object) -> bool:
        if key in self._warned or len(self._warned) >= _MAX_WARNED:
            return False
        self._warned.add(key)
        return True

    # -- reloading ---------------------------------------------------------------------------------

    def _maybe_refresh(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.config.recheck_interval_s
        if self._hashes is not None:
            self._hashes.refresh()
        if self._ca is not None and self._ca.refresh():
            self._clear_cache()

    def _clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()


_MAX_WARNED = 1024
_NO_CERTIFICATE = (
    "the agent sent no EK certificate (its TPM has none in NV, as with Intel PTT and AMD fTPM): "
    "list the node's EK hash in hash_dir (mode ca_or_hash) to trust it"
)


_NO_CA = _CaOutcome(False, NOT_TRUSTED, "no ca_dir is configured")


def _key_matches(entry: _LeafEntry, cert: Certificate, spki_der: bytes) -> bool:
    """Whether the certificate's key is the PUBLIC KEY block's (byte-equal, else compared semantically)."""
    cert_key = cert.public_key
    if spki_der == cert_key.der:
        return True
    known = entry.key_matches.get(spki_der)
    if known is None:
        try:
            known = cert_key.same_key(parse_spki(spki_der, set()))
        except DerError:
            known = False
        if len(entry.key_matches) < 8:
            entry.key_matches[spki_der] = known
    return known


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _tpm_text(cert: Certificate) -> str:
    san = cert.san
    if san is None or not (san.manufacturer or san.model or san.version):
        return ""
    return f"manufacturer {san.manufacturer} model {san.model} version {san.version}".strip()


def _key_mismatch_reason(cert: Certificate, spki_der: bytes) -> str:
    if cert.public_key.kind == "unsupported":
        return (
            f"the EK certificate's public key ({cert.public_key.description}, certificate serial "
            f"{cert.serial_hex}) is of a type the server does not support (RSA and ECC P-256/384/521 are)"
        )
    try:
        sent = parse_spki(spki_der, set()).description
    except DerError:
        sent = "an unparsable key"
    return (
        f"the EK certificate's public key ({cert.public_key.description}, certificate serial "
        f"{cert.serial_hex}) differs from the EK PUBLIC KEY block the agent sent ({sent}): "
        "the certificate does not belong to this EK; check the agent's EK template and NV index "
        "(swtpm_setup --allow-signing causes this)"
    )
