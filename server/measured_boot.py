"""A pool's measured-boot policy: which releases it admits, and the check of a join's quote against them.

Configured per pool (``pools.<name>.measured_boot``, docs/attestation.md "Measured boot")::

    measured_boot:
      releases:                                   # the releases this pool admits
        - name: k8s-1.36.3-amd64-h200
          measurements: releases/k8s-1.36.3-amd64-h200/boot-measurements.json
          sha256: <the file's digest as the release's signed SHA256SUMS lists it>
      unchecked_pcrs: [0, 1, 2, 3, 5, 6, 7]       # quoted and replayed, but not compared: firmware
      bank: sha256
      nonce_ttl: 2m

A join to such a pool (server.join_service) takes a nonce from ``BeginJoin``, and its request must
carry a TPM2_Quote over that nonce, signed by the AK the server credential-activated when the
agent attested, over the union of every release's PCRs and ``unchecked_pcrs``, and the UEFI event
log. :func:`verify` checks, in order: the log parses; it replays, in the policy's bank, to the
values the quote's digest covers (so the log is the one the TPM measured); the quote itself
(protocol.quote); then each release's reference (protocol.measurements): the node is admitted
when one release matches every one of its PCRs. ``unchecked_pcrs`` are said to be unchecked in the
audit line of every join, so nobody reads more into an admission than it proves.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import eventlog, measurements
from protocol.errors import ProtocolError
from protocol.quote import QuoteError, verify_quote
from protocol.settings import Ctx, Setting, Table, choice, duration, integer, list_of, path, section, text
from server.errors import AttestationDeniedError, ConfigError, InvalidRequestError

MAX_REFERENCE_BYTES = measurements.MAX_REFERENCE_BYTES
_HEX64 = r"[0-9a-f]{64}"

RELEASE = Table(
    "pools.<name>.measured_boot.releases[]",
    (
        Setting("name", text("a release name", pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"), "the release's name",
                required=True),
        Setting("measurements", path(), "the release's boot-measurements.json (relative: from this file's folder)",
                required=True),
        Setting("sha256", text("64 lowercase hex characters", pattern=_HEX64),
                "the file's SHA-256 as the release's signed SHA256SUMS lists it (checked at start)", required=True),
    ),
    flags=False,
)  # fmt: skip


@dataclass(frozen=True)
class Release:
    name: str
    reference: measurements.BootReference


@dataclass(frozen=True)
class MeasuredBoot:
    releases: tuple[Release, ...]
    unchecked_pcrs: tuple[int, ...]
    bank: str
    nonce_ttl_s: float
    on_change: str = "refuse"  # what a Recheck that no longer matches does: refuse, or ban too

    @property
    def checked_pcrs(self) -> tuple[int, ...]:
        return tuple(sorted({p for r in self.releases for p in r.reference.pcrs}))

    @property
    def quoted_pcrs(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.checked_pcrs) | set(self.unchecked_pcrs)))


def _build(values: dict[str, Any], ctx: Ctx) -> MeasuredBoot:
    where = ".".join(str(p) for p in ctx.path) or "measured_boot"
    releases = []
    for n, rel in enumerate(values["releases"]):
        file: Path = rel["measurements"]
        try:
            with file.open("rb") as fh:
                raw = fh.read(MAX_REFERENCE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"{where}.releases[{n}].measurements: cannot read {file}: {exc.strerror}"
            ) from exc
        digest = hashlib.sha256(raw).hexdigest()
        if not hmac.compare_digest(digest, rel["sha256"]):
            raise ConfigError(
                f"{where}.releases[{n}]: {file} has sha256 {digest}, not the {rel['sha256']} the configuration "
                "pins: the file is not the release's (verify the release with `imagebuilder verify`)"
            )
        try:
            reference = measurements.load(raw)
        except ProtocolError as exc:
            raise ConfigError(f"{where}.releases[{n}].measurements: {exc}") from exc
        if reference.bank != values["bank"]:
            raise ConfigError(
                f"{where}.releases[{n}]: measured in bank {reference.bank}, the pool quotes {values['bank']}"
            )
        releases.append(Release(rel["name"], reference))
    if not releases:
        raise ConfigError(f"{where}.releases: name at least one release the pool admits")
    overlap = set(values["unchecked_pcrs"]) & {p for r in releases for p in r.reference.pcrs}
    if overlap:
        raise ConfigError(f"{where}.unchecked_pcrs: PCR(s) {sorted(overlap)} are checked by a release")
    return MeasuredBoot(
        tuple(releases),
        tuple(sorted(values["unchecked_pcrs"])),
        values["bank"],
        values["nonce_ttl"].total_seconds(),
        values["on_change"],
    )


MEASURED_BOOT = Table(
    "pools.<name>.measured_boot",
    (
        Setting("releases", list_of(section(RELEASE), "a list of releases", max_items=64),
                "the releases (name, measurements file, its sha256) whose boot this pool admits", required=True),
        Setting("unchecked_pcrs", list_of(integer(0, 23), "a list of PCR numbers", max_items=24),
                "PCRs quoted and replayed but not compared (firmware and platform: 0-3, 5-7)", (0, 1, 2, 3, 5, 6, 7)),
        Setting("bank", choice("sha256", "sha384"), "the PCR bank to quote (SHA-1-only TPMs are refused)", "sha256"),
        Setting("nonce_ttl", duration("10s", "10m"), "how long a BeginJoin nonce stays valid", dt.timedelta(minutes=2)),
        Setting("on_change", choice("refuse", "ban"),
                "a joined node whose re-check no longer matches: refused (and audited), or banned as well", "refuse"),
    ),
    flags=False,
)  # fmt: skip


def measured_boot_kind() -> Any:
    return section(MEASURED_BOOT, _build)


@dataclass(frozen=True)
class Admission:
    release: str
    checked_pcrs: tuple[int, ...]
    unchecked_pcrs: tuple[int, ...]


class QuoteRefusedError(AttestationDeniedError):
    """A quote or event log that does not prove the boot (reason: the check that failed)."""

    reason = "quote_signature"


class BootNotAcceptedError(AttestationDeniedError):
    reason = "boot_not_accepted"


def verify(
    policy: MeasuredBoot,
    *,
    ak_public_hex: str,
    nonce: bytes,
    quote: bytes,
    signature: bytes,
    event_log: bytes,
    ak_qualified_name_hex: str = "",
) -> Admission:
    """The join's measured-boot evidence against the pool's policy (in a worker thread)."""
    if not quote or not signature or not event_log:
        raise InvalidRequestError(
            "this pool checks measured boot: send a TPM2_Quote over BeginJoin's nonce and the event log "
            "(upgrade the agent)",
            reason="quote_missing",
        )
    try:
        ak_public = bytes.fromhex(ak_public_hex)
    except ValueError:
        ak_public = b""
    if not ak_public:
        raise QuoteRefusedError(
            "the server holds no AK for this agent (it attested before measured boot was checked): attest again",
            reason="quote_no_ak",
        )
    try:
        log = eventlog.parse(event_log)
    except ProtocolError as exc:
        raise InvalidRequestError(f"event log: {exc}", reason="eventlog_malformed") from exc
    if policy.bank not in log.algorithms:
        raise QuoteRefusedError(
            f"the event log has no {policy.bank} bank (it has {', '.join(log.algorithms) or 'none'}): "
            f"this pool requires {policy.bank}",
            reason="quote_bank",
        )
    replayed = log.replay(policy.bank)
    size = log.algorithms[policy.bank]
    values = {
        p: replayed.get(p, eventlog.initial_value(p, size, log.startup_locality)) for p in policy.quoted_pcrs
    }
    try:
        verify_quote(
            ak_public=ak_public,
            quote=quote,
            signature=signature,
            nonce=nonce,
            pcr_values=values,
            bank=policy.bank,
            # The qualified name the AK's own certification named at attestation: a quote must carry
            # exactly it (an agent attested before it was recorded gets the name-algorithm check).
            ak_qualified_name=bytes.fromhex(ak_qualified_name_hex) if ak_qualified_name_hex else None,
        )
    except QuoteError as exc:
        reason = "eventlog_replay" if exc.reason == "quote_pcr_digest" else exc.reason
        message = (
            "the event log does not replay to the quoted PCRs: it is not the log of this boot"
            if reason == "eventlog_replay"
            else str(exc)
        )
        raise QuoteRefusedError(message, reason=reason) from exc
    failures: list[str] = []
    for release in policy.releases:
        problems = measurements.check(release.reference, log)
        if not problems:
            return Admission(release.name, policy.checked_pcrs, policy.unchecked_pcrs)
        failures.append(f"{release.name}: {problems[0].message}")
    raise BootNotAcceptedError(
        "the node booted something this pool does not admit; " + "; ".join(failures[:4]),
        detail="; ".join(failures),
    )
