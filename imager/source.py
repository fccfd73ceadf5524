"""The release as the imager sees it: signature first, then the digests it vouches for.

1. The trusted keys: every ``*.pub`` baked into the boot environment (``/etc/nodeimager/keys``),
   or, with ``nodeimager.key=sha256:<fingerprint>`` on the command line, only the key with that
   fingerprint: a baked one, else ``signing-key.pub`` fetched from the release folder, whose
   fingerprint must equal the pin (compared in constant time). No key, no image.
2. ``signature.dsse.json`` is fetched (at most 1 MiB) and verified with those keys before anything
   it says is believed (:mod:`protocol.dsse`).
3. The signed manifest (``manifest.json`` of a build, ``release.json`` of a release; at most
   16 MiB) is fetched and must hash to the digest the statement signs (:mod:`protocol.release`).
4. With ``nodeimager.image=sha256:<hex>`` (the iPXE script always passes it), the release's QCOW2
   image must be that image: a boot script pointed at another release is refused.

Every later fetch (the image, the cloud-init) is bounded by its signed size and checked against its
signed digest.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from imager.errors import ImagerError, Reason
from imager.http import Fetcher, check_url, join
from protocol.dsse import (
    MAX_ENVELOPE_BYTES,
    MAX_PUBLIC_KEY_BYTES,
    PublicKey,
    fingerprint,
    fingerprints_equal,
    load_public_key,
    parse_envelope,
    verify_envelope,
)
from protocol.errors import ReleaseFormatError, SignatureError
from protocol.release import (
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    Artifact,
    ReleaseView,
    Statement,
    digests_equal,
    read_manifest,
    read_statement,
)

log = logging.getLogger(__name__)

KEYS_DIR = Path("/etc/nodeimager/keys")
SIGNING_KEY = "signing-key.pub"
MAX_SMALL_ARTIFACT = 4 << 20  # cloud-init user-data and the like

_SIGNATURE_REASONS = {
    "malformed": Reason.signature_malformed,
    "untrusted-key": Reason.signature_untrusted,
    "bad-signature": Reason.signature_bad,
}


@dataclass(frozen=True)
class Source:
    """A verified release: where it is, what signed it, what it holds."""

    url: str
    statement: Statement
    view: ReleaseView

    def url_of(self, name: str) -> str:
        return join(self.url, name)


def _baked_keys(keys_dir: Path | None) -> list[PublicKey]:
    if keys_dir is None or not keys_dir.is_dir():
        return []
    keys = []
    for path in sorted(keys_dir.glob("*.pub")):
        try:
            with path.open("rb") as fh:
                keys.append(load_public_key(fh.read(MAX_PUBLIC_KEY_BYTES + 1), source=str(path)))
        except (OSError, SignatureError) as exc:
            log.warning("ignoring the baked key %s: %s", path, exc)
    return keys


def trusted_keys(fetcher: Fetcher, base: str, *, keys_dir: Path | None, pin: str) -> list[PublicKey]:
    """The keys a signature may be made with (see the module docstring)."""
    baked = _baked_keys(keys_dir)
    if not pin:
        if not baked:
            raise ImagerError(
                Reason.signature_untrusted,
                "no signing key is trusted: none is baked into the boot environment and none is pinned",
                hint="pin the release key on the kernel command line: nodeimager.key=sha256:<fingerprint> "
                "(imagebuilder release prints it)",
            )
        return baked
    chosen = [key for key in baked if fingerprints_equal(fingerprint(key), pin)]
    if chosen:
        return chosen
    data = fetcher.get_small(join(base, SIGNING_KEY), name=SIGNING_KEY, limit=MAX_PUBLIC_KEY_BYTES)
    try:
        key = load_public_key(data, source=SIGNING_KEY)
    except SignatureError as exc:
        raise ImagerError(_SIGNATURE_REASONS[exc.reason], str(exc)) from None
    if not fingerprints_equal(fingerprint(key), pin):
        raise ImagerError(
            Reason.key_pin_mismatch,
            f"{SIGNING_KEY} of the release is {fingerprint(key)}, not the pinned {pin}",
            hint="the release at that URL is signed by another key: check nodeimager.release= and nodeimager.key=",
        )
    return [key]


def open_source(
    fetcher: Fetcher, url: str, *, keys_dir: Path | None = KEYS_DIR, key_pin: str = "", image_pin: str = ""
) -> Source:
    """Fetch and verify the release at ``url`` (a folder); ImagerError says why it cannot be trusted."""
    check_url(url, what="release")
    keys = trusted_keys(fetcher, url, keys_dir=keys_dir, pin=key_pin)
    envelope_bytes = fetcher.get_small(join(url, SIGNATURE), name=SIGNATURE, limit=MAX_ENVELOPE_BYTES)
    try:
        verified = verify_envelope(parse_envelope(envelope_bytes), keys)
    except SignatureError as exc:
        raise ImagerError(
            _SIGNATURE_REASONS[exc.reason],
            f"{SIGNATURE}: {exc}",
            hint="the release was not signed by the key this boot trusts, or it was changed after signing",
        ) from None
    try:
        statement = read_statement(verified)
        manifest = fetcher.get_small(
            join(url, statement.manifest), name=statement.manifest, limit=MAX_MANIFEST_BYTES
        )
        view = read_manifest(statement, manifest)
    except ReleaseFormatError as exc:
        reason = Reason.digest_mismatch if exc.reason == "digest" else Reason.release_format
        raise ImagerError(
            reason, str(exc), hint="republish the release folder as imagebuilder wrote it"
        ) from None
    if image_pin:
        qcow2 = view.image("qcow2")
        if not digests_equal(qcow2.sha256, image_pin.removeprefix("sha256:")):
            raise ImagerError(
                Reason.image_pin_mismatch,
                f"the release at {url} holds image {qcow2.name} sha256:{qcow2.sha256}, not the sha256:"
                f"{image_pin.removeprefix('sha256:')} the boot script pins",
                hint="the boot script points at another release than it was rendered for: re-render it "
                "(imagebuilder release) or fix nodeimager.release=",
            )
    log.info(
        "release %s (%s %s) verified: signed by %s", url, statement.kind, statement.name, statement.key_id
    )
    return Source(url, statement, view)


def fetch_small_artifact(fetcher: Fetcher, source: Source, artifact: Artifact) -> bytes:
    """A small signed file of the release, bounded by its signed size and checked against its digest."""
    if artifact.size > MAX_SMALL_ARTIFACT:
        raise ImagerError(
            Reason.release_format, f"{artifact.name}: {artifact.size} bytes is too large for this file"
        )
    data = fetcher.get_small(source.url_of(artifact.name), name=artifact.name, limit=artifact.size)
    actual = hashlib.sha256(data).hexdigest()
    if len(data) != artifact.size:
        raise ImagerError(
            Reason.truncated, f"{artifact.name}: {len(data)} bytes, the release signs {artifact.size}"
        )
    if not digests_equal(actual, artifact.sha256):
        raise ImagerError(
            Reason.digest_mismatch,
            f"{artifact.name}: sha256 mismatch (the signature says {artifact.sha256}, the file is {actual})",
            hint="the file on the server is not the signed one: republish the release",
        )
    return data
