"""The manufacturer CA directory: loading, indexing by subject, and chain building.

Every regular file (dotfiles aside) is read as PEM (any number of CERTIFICATE
blocks) or, without PEM markers, as one DER certificate. A file that yields no
usable certificate is skipped with a warning and listed in
:attr:`CaStore.skipped`; one bad vendor file never blocks the others.

Chain building starts at the EK certificate and looks issuers up by normalised
subject name, trying the one whose subjectKeyIdentifier equals the child's
authorityKeyIdentifier first. Every link's signature is verified over the
original TBS bytes. A self-signed certificate ends a path at a root; with
``intermediates_as_anchors`` (the upstream behaviour, default) every other
certificate in the directory is a trust anchor too, but paths that reach a
self-signed root are preferred. Time validity is checked separately
(:func:`select_path`) so the candidate paths can be cached independently of the
clock.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from protocol.der import DerError
from server.ek.certificate import (
    EXT_AIA,
    EXT_AKI,
    EXT_BASIC_CONSTRAINTS,
    EXT_CERT_POLICIES,
    EXT_CRL_DP,
    EXT_EKU,
    EXT_KEY_USAGE,
    EXT_SAN,
    EXT_SKI,
    EXT_SUBJECT_DIR_ATTRS,
    KU_KEY_CERT_SIGN,
    Certificate,
    NameKey,
    parse_certificate,
)
from server.ek.keys import SignatureCheckError, verify_signature

log = logging.getLogger(__name__)

UNDERSTOOD_EXTENSIONS = frozenset(
    {
        EXT_BASIC_CONSTRAINTS,
        EXT_KEY_USAGE,
        EXT_SKI,
        EXT_AKI,
        EXT_EKU,
        EXT_SAN,
        EXT_CERT_POLICIES,
        EXT_SUBJECT_DIR_ATTRS,
        EXT_AIA,
        EXT_CRL_DP,
    }
)

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)
_CERT_PEM_TYPES = {b"CERTIFICATE", b"X509 CERTIFICATE", b"TRUSTED CERTIFICATE"}
_MAX_FILE_BYTES = 4 * 1024 * 1024
_MAX_PATHS = 8
_MAX_SIGNATURE_CHECKS = 48

# Failure codes (stable slugs, shared with EkVerdict.reason_code).
ISSUER_UNKNOWN = "ek_issuer_unknown"
CHAIN_INCOMPLETE = "ek_chain_incomplete"
SIGNATURE_INVALID = "ek_chain_signature_invalid"
ALGORITHM_UNSUPPORTED = "ek_signature_algorithm_unsupported"
CHAIN_INVALID = "ek_chain_invalid"
CERT_EXPIRED = "ek_cert_expired"
CERT_NOT_YET_VALID = "ek_cert_not_yet_valid"


@dataclass(frozen=True)
class SkippedFile:
    """A CA-directory file (or part of one) that could not be used, and why."""

    path: Path
    reason: str
    loaded: int = 0  # certificates that were still usable from the same file


@dataclass(frozen=True)
class ChainPolicy:
    intermediates_as_anchors: bool = True
    max_chain_depth: int = 5
    allow_sha1: bool = False
    ignore_critical_extensions: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ChainFailure:
    code: str
    message: str
    rank: int = 0  # which failure to report when several paths fail: higher wins, then deeper
    depth: int = 0


Path_ = tuple[Certificate, ...]


@dataclass(frozen=True)
class ChainCandidates:
    """Signature-valid paths (leaf first), best first; or why there is none."""

    paths: tuple[Path_, ...]
    failure: ChainFailure | None


class CaStore:
    """An immutable snapshot of the CA directory, with per-snapshot signature caches."""

    def __init__(
        self,
        directory: Path,
        certificates: Iterable[tuple[Certificate, Path]],
        skipped: Iterable[SkippedFile],
        generation: int,
    ) -> None:
        self.directory = directory
        self.generation = generation
        self.skipped = tuple(skipped)
        self.source: dict[bytes, Path] = {}
        self.by_subject: dict[NameKey, list[Certificate]] = {}
        for cert, path in certificates:
            if cert.sha256 in self.source:
                continue
            self.source[cert.sha256] = path
            self.by_subject.setdefault(cert.subject.key, []).append(cert)
        self._edges: dict[tuple[bytes, bytes, bool], SignatureCheckError | None] = {}
        self._roots: dict[bytes, bool] = {}

    def __len__(self) -> int:
        return len(self.source)

    @classmethod
    def load(cls, directory: Path, *, generation: int, lenient: bool) -> CaStore:
        loaded: list[tuple[Certificate, Path]] = []
        skipped: list[SkippedFile] = []
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except OSError as exc:
            log.error("EK CA directory %s cannot be read (%s): no EK certificate is trusted", directory, exc)
            return cls(
                directory, (), (SkippedFile(directory, f"cannot read the directory: {exc}"),), generation
            )
        lenient_used: list[str] = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            try:
                if not entry.is_file(follow_symlinks=True):
                    if entry.is_symlink() and not path.exists():
                        raise OSError("broken symbolic link")
                    log.debug("EK CA directory: ignoring %s (not a regular file)", path)
                    continue
                if entry.stat().st_size > _MAX_FILE_BYTES:
                    raise OSError(f"larger than {_MAX_FILE_BYTES} bytes")
                data = path.read_bytes()
            except OSError as exc:
                skipped.append(SkippedFile(path, f"cannot read: {exc}"))
                continue
            certs, problems = _certificates_in(data, lenient=lenient)
            for cert in certs:
                loaded.append((cert, path))
                if cert.quirks:
                    lenient_used.append(f"{entry.name} ({', '.join(sorted(cert.quirks))})")
            if problems:
                skipped.append(SkippedFile(path, "; ".join(problems), loaded=len(certs)))
        store = cls(directory, loaded, skipped, generation)
        for item in store.skipped:
            log.warning(
                "EK CA directory: skipping %s%s: %s",
                item.path,
                f" in part ({item.loaded} certificates loaded)" if item.loaded else "",
                item.reason,
            )
        if lenient_used:
            log.info("EK CA directory: parsed leniently: %s", "; ".join(lenient_used))
        if not store.source:
            log.warning(
                "EK CA directory %s holds no usable certificate: no EK certificate will be trusted",
                directory,
            )
        log.info(
            "EK CA directory %s: %d certificates from %d files, %d files skipped (generation %d)",
            directory,
            len(store),
            len({str(path) for path in store.source.values()}),
            len(store.skipped),
            generation,
        )
        return store

    def where(self, cert: Certificate) -> str:
        path = self.source.get(cert.sha256)
        return path.name if path is not None else "the agent"

    def issuers_of(self, child: Certificate) -> list[Certificate]:
        """Certificates named as the child's issuer: key-identifier matches first, mismatches last."""
        found = self.by_subject.get(child.issuer.key, [])
        aki = child.authority_key_id

        def order(cert: Certificate) -> int:
            if aki is None or cert.subject_key_id is None:
                return 1
            return 0 if cert.subject_key_id == aki else 2

        return sorted(found, key=order)

    def is_root(self, cert: Certificate) -> bool:
        """Self-signed: self-issued, and its signature verifies with its own key (any hash algorithm)."""
        cached = self._roots.get(cert.sha256)
        if cached is not None:
            return cached
        root = cert.self_issued
        if root:
            try:
                verify_signature(
                    cert.public_key, cert.signature_algorithm, cert.signature, cert.tbs, allow_sha1=True
                )
            except SignatureCheckError as exc:
                root = exc.unsupported and cert.authority_key_id in (None, cert.subject_key_id)
        self._roots[cert.sha256] = root
        return root

    def check_link(
        self, child: Certificate, issuer: Certificate, policy: ChainPolicy
    ) -> SignatureCheckError | None:
        """None if ``issuer`` signed ``child``; CA-to-CA results are cached for the snapshot's life."""
        key = (child.sha256, issuer.sha256, policy.allow_sha1)
        cacheable = child.sha256 in self.source
        if cacheable and key in self._edges:
            return self._edges[key]
        error: SignatureCheckError | None = None
        try:
            verify_signature(
                issuer.public_key,
                child.signature_algorithm,
                child.signature,
                child.tbs,
                allow_sha1=policy.allow_sha1,
            )
        except SignatureCheckError as exc:
            error = exc
        if cacheable:
            self._edges[key] = error
        return error

    def build_paths(self, leaf: Certificate, policy: ChainPolicy) -> ChainCandidates:
        """All signature-valid paths from ``leaf`` to a trust anchor (bounded), best first."""
        search = _Search(self, policy)
        search.extend((leaf,))
        full = sorted(search.full, key=len)
        partial = sorted(search.partial, key=len, reverse=True)
        paths = tuple(full + partial)
        if paths:
            return ChainCandidates(paths, None)
        failure = max(search.failures, key=lambda f: (f.rank, f.depth), default=None)
        if failure is None:  # pragma: no cover - a search without a path always records why
            failure = ChainFailure(CHAIN_INCOMPLETE, "no certificate path found")
        return ChainCandidates((), failure)

    def describe_missing_issuer(self, cert: Certificate, depth: int, policy: ChainPolicy) -> ChainFailure:
        hint = (
            f" (the certificate says its issuer can be fetched from {cert.ca_issuer_urls[0]})"
            if cert.ca_issuer_urls
            else ""
        )
        if depth == 0:
            return ChainFailure(
                ISSUER_UNKNOWN,
                f"EK certificate issuer '{cert.issuer.text}' not found in ca_dir {self.directory}: "
                f"add the manufacturer's CA certificates{hint} [EK serial {cert.serial_hex}]",
                rank=1,
            )
        anchors = (
            ""
            if policy.intermediates_as_anchors
            else " (intermediates_as_anchors is false, so it is not a trust anchor)"
        )
        return ChainFailure(
            CHAIN_INCOMPLETE,
            f"certificate chain stops at '{cert.display}' ({self.where(cert)}){anchors}: its issuer "
            f"'{cert.issuer.text}' is not in ca_dir {self.directory}; add that CA certificate{hint}",
            rank=1,
            depth=depth,
        )


class _Search:
    """Depth-first path enumeration with a budget of signature checks and paths."""

    def __init__(self, store: CaStore, policy: ChainPolicy) -> None:
        self.store = store
        self.policy = policy
        self.full: list[Path_] = []
        self.partial: list[Path_] = []
        self.failures: list[ChainFailure] = []
        self.budget = _MAX_SIGNATURE_CHECKS

    def extend(self, path: Path_) -> None:
        store, policy = self.store, self.policy
        child = path[-1]
        depth = len(path) - 1
        candidates = store.issuers_of(child)
        if not candidates:
            self.failures.append(store.describe_missing_issuer(child, depth, policy))
            return
        key_id_matched = False
        for issuer in candidates:
            if len(self.full) + len(self.partial) >= _MAX_PATHS or self.budget <= 0:
                return
            if any(issuer.sha256 == seen.sha256 for seen in path):
                continue
            mismatched = child.authority_key_id is not None and issuer.subject_key_id not in (
                None,
                child.authority_key_id,
            )
            if mismatched and key_id_matched:
                continue
            self.budget -= 1
            error = store.check_link(child, issuer, policy)
            if error is not None:
                self.failures.append(self._signature_failure(child, issuer, error, depth, mismatched))
                continue
            key_id_matched = key_id_matched or not mismatched
            problem = self._issuer_problem(issuer, path)
            if problem is not None:
                self.failures.append(ChainFailure(CHAIN_INVALID, problem, rank=3, depth=depth + 1))
                continue
            extended = (*path, issuer)
            if store.is_root(issuer):
                self.full.append(extended)
                continue
            if policy.intermediates_as_anchors:
                self.partial.append(extended)
            if depth + 1 >= policy.max_chain_depth:
                self.failures.append(
                    ChainFailure(
                        CHAIN_INVALID,
                        f"certificate chain is longer than max_chain_depth {policy.max_chain_depth} "
                        f"at '{issuer.display}' ({store.where(issuer)})",
                        rank=2,
                        depth=depth + 1,
                    )
                )
                continue
            self.extend(extended)

    def _signature_failure(
        self,
        child: Certificate,
        issuer: Certificate,
        error: SignatureCheckError,
        depth: int,
        mismatched: bool,
    ) -> ChainFailure:
        what = "EK certificate" if depth == 0 else "CA certificate"
        message = (
            f"{what} '{child.display}' (serial {child.serial_hex}) was not verified with the key of "
            f"'{issuer.display}' ({self.store.where(issuer)}): {error}"
        )
        if error.unsupported:
            return ChainFailure(ALGORITHM_UNSUPPORTED, message, rank=3, depth=depth)
        if mismatched:
            message += (
                f"; its authorityKeyIdentifier {_hex(child.authority_key_id)} names a different CA key than "
                f"{_hex(issuer.subject_key_id)}: add the manufacturer's CA with that key identifier"
            )
            return ChainFailure(
                ISSUER_UNKNOWN if depth == 0 else CHAIN_INCOMPLETE, message, rank=1, depth=depth
            )
        return ChainFailure(SIGNATURE_INVALID, message, rank=4, depth=depth)

    def _issuer_problem(self, issuer: Certificate, path: Path_) -> str | None:
        where = f"'{issuer.display}' ({self.store.where(issuer)})"
        if not issuer.is_ca and not (issuer.version < 3 and self.store.is_root(issuer)):
            return f"{where} signed '{path[-1].display}' but is not a CA (basicConstraints cA is not set)"
        if issuer.key_usage is not None and KU_KEY_CERT_SIGN not in issuer.key_usage:
            return f"{where} is not allowed to sign certificates (keyUsage lacks keyCertSign)"
        limit = issuer.basic_constraints.path_length if issuer.basic_constraints is not None else None
        below = sum(1 for cert in path[1:] if not cert.self_issued)
        if limit is not None and below > limit:
            return f"{where} allows {limit} intermediate CAs below it (pathLenConstraint); found {below}"
        unknown = critical_unknown(issuer, self.policy)
        if unknown:
            return f"{where} has unsupported critical extensions {', '.join(unknown)}"
        return None


def critical_unknown(cert: Certificate, policy: ChainPolicy) -> list[str]:
    return sorted(
        ext.oid
        for ext in cert.extensions.values()
        if ext.critical
        and ext.oid not in UNDERSTOOD_EXTENSIONS
        and ext.oid not in policy.ignore_critical_extensions
    )


def select_path(paths: tuple[Path_, ...], now: datetime) -> tuple[Path_ | None, ChainFailure | None]:
    """The first path whose every certificate is valid at ``now``; else the first path's time failure."""
    first_failure: ChainFailure | None = None
    for path in paths:
        failure = _time_failure(path, now)
        if failure is None:
            return path, None
        first_failure = first_failure or failure
    return None, first_failure


def _time_failure(path: Path_, now: datetime) -> ChainFailure | None:
    for depth, cert in enumerate(path):
        what = "EK certificate" if depth == 0 else f"CA certificate '{cert.display}'"
        if now > cert.not_after:
            return ChainFailure(
                CERT_EXPIRED,
                f"{what} (serial {cert.serial_hex}) expired at {cert.not_after:%Y-%m-%d %H:%M:%S}Z "
                f"(now {now:%Y-%m-%d %H:%M:%S}Z)",
                depth=depth,
            )
        if now < cert.not_before:
            return ChainFailure(
                CERT_NOT_YET_VALID,
                f"{what} (serial {cert.serial_hex}) is not valid before "
                f"{cert.not_before:%Y-%m-%d %H:%M:%S}Z "
                f"(now {now:%Y-%m-%d %H:%M:%S}Z): check the server's clock",
                depth=depth,
            )
    return None


def _hex(value: bytes | None) -> str:
    return value.hex() if value is not None else "(none)"


def _certificates_in(data: bytes, *, lenient: bool) -> tuple[list[Certificate], list[str]]:
    """Certificates in one file, and a description of each part that could not be used."""
    blobs: list[tuple[str, bytes | None]] = []
    if b"-----BEGIN " in data:
        for index, match in enumerate(_PEM_BLOCK.finditer(data), start=1):
            if match.group(1) not in _CERT_PEM_TYPES:
                continue
            try:
                blobs.append(
                    (f"PEM block {index}", base64.b64decode(b"".join(match.group(2).split()), validate=True))
                )
            except (binascii.Error, ValueError):
                blobs.append((f"PEM block {index}", None))
        if not blobs:
            return [], ["no CERTIFICATE PEM block"]
    else:
        blobs.append(("DER", data))
    certs: list[Certificate] = []
    problems: list[str] = []
    for label, blob in blobs:
        if blob is None:
            problems.append(f"{label}: invalid base64")
            continue
        try:
            cert = parse_certificate(blob)
        except DerError as exc:
            problems.append(f"{label}: not a certificate ({exc})")
            continue
        if cert.quirks and not lenient:
            problems.append(f"{label}: needs lenient parsing ({', '.join(sorted(cert.quirks))})")
            continue
        certs.append(cert)
    return certs, problems
