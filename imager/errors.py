"""The imager's one error hierarchy: every refusal carries a stable reason, an exit status and a fix.

A :class:`Reason` is what tooling decides on (it is sent in the ``failed`` event and printed by
``--json``); the message is for the operator and says what was wrong and what to do. The exit
status groups reasons by who has to act (docs/bare-metal.md, "Exit statuses"):

== ==========================================================================================
0  the image is written, checked and the boot entry set
1  an internal error (a bug: report it with the console log)
2  usage: a parameter or flag is missing or malformed
3  the network: a fetch failed or timed out (the release server, DHCP, a proxy)
4  the release is refused: a source, signature, digest, size or manifest that cannot be trusted
5  the image is refused: its QCOW2 header asks for a backing file, an external data file, ...
6  no disk: the hints match none or several disks, or the policy refuses to guess
7  writing failed, or the disk does not read back as the verified image
8  the written disk fails its checks (GPT, partitions that resolve elsewhere)
9  the boot entry could not be created (efivarfs, efibootmgr)
== ==========================================================================================

Whatever the status, a failure leaves the target disk unbootable (see :mod:`imager.wipe`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    usage = "usage"
    scheme_refused = "scheme-refused"
    redirect_refused = "redirect-refused"
    http_error = "http-error"
    network = "network"
    body_too_large = "body-too-large"
    truncated = "truncated"
    signature_untrusted = "signature-untrusted"
    signature_bad = "signature-bad"
    signature_malformed = "signature-malformed"
    key_pin_mismatch = "key-pin-mismatch"
    release_format = "release-format"
    digest_mismatch = "digest-mismatch"
    image_pin_mismatch = "image-pin-mismatch"
    image_format = "image-format"
    qcow2_backing_file = "qcow2-backing-file"
    qcow2_data_file = "qcow2-data-file"
    qcow2_encrypted = "qcow2-encrypted"
    qcow2_features = "qcow2-features"
    image_too_large = "image-too-large"
    memory = "memory"
    no_hint = "no-hint"
    no_match = "no-match"
    ambiguous = "ambiguous"
    write_failed = "write-failed"
    readback_mismatch = "readback-mismatch"
    gpt = "gpt"
    partition_elsewhere = "partition-elsewhere"
    boot_entry = "boot-entry"
    tool_missing = "tool-missing"
    internal = "internal"


EXIT_STATUS: dict[Reason, int] = {
    Reason.usage: 2,
    Reason.scheme_refused: 4,
    Reason.redirect_refused: 4,
    Reason.http_error: 3,
    Reason.network: 3,
    Reason.body_too_large: 4,
    Reason.truncated: 4,
    Reason.signature_untrusted: 4,
    Reason.signature_bad: 4,
    Reason.signature_malformed: 4,
    Reason.key_pin_mismatch: 4,
    Reason.release_format: 4,
    Reason.digest_mismatch: 4,
    Reason.image_pin_mismatch: 4,
    Reason.image_format: 5,
    Reason.qcow2_backing_file: 5,
    Reason.qcow2_data_file: 5,
    Reason.qcow2_encrypted: 5,
    Reason.qcow2_features: 5,
    Reason.image_too_large: 5,
    Reason.memory: 5,
    Reason.no_hint: 6,
    Reason.no_match: 6,
    Reason.ambiguous: 6,
    Reason.write_failed: 7,
    Reason.readback_mismatch: 7,
    Reason.gpt: 8,
    Reason.partition_elsewhere: 8,
    Reason.boot_entry: 9,
    Reason.tool_missing: 1,
    Reason.internal: 1,
}


class ImagerError(Exception):
    """A refusal or failure: ``reason`` (stable), ``message`` (what), ``hint`` (the fix) and
    ``details`` (structured facts for the ``failed`` event and ``--json``, e.g. every disk candidate
    and why it was excluded)."""

    def __init__(
        self, reason: Reason, message: str, *, hint: str = "", details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.hint = hint
        self.details = details or {}

    @property
    def exit_code(self) -> int:
        return EXIT_STATUS[self.reason]

    def __str__(self) -> str:
        return self.message


class CommandError(ImagerError):
    """A tool run through :mod:`imager.run` failed; ``argv`` and ``returncode`` say which and how."""

    def __init__(
        self, reason: Reason, message: str, *, argv: list[str], returncode: int | None, hint: str = ""
    ) -> None:
        super().__init__(reason, message, hint=hint)
        self.argv = argv
        self.returncode = returncode
