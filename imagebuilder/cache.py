"""The download cache: content-addressed by SHA-256, shared by builds, resumable, never trusted blindly.

Layout under the cache root (default ``$XDG_CACHE_HOME/nodetrust-imagebuilder``)::

    sha256/ab/abcdef...      complete entries; the file name is the digest of the content
    partial/<key>.part       downloads in progress (key: the expected digest, or url-<sha256 of the URL>)
    locks/<key>.lock         one process downloads a key at a time; others wait and reuse

An entry is re-hashed every time it is used: a truncated, corrupted or tampered entry
is deleted and fetched again, never used. A partial download is resumed (HTTP Range)
from the next URL tried; it becomes an entry only after its digest matched. Mirrors are
tried in order; a mirror that serves different content is skipped and named in the error.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from imagebuilder.errors import FetchError, VerificationError
from imagebuilder.fetch import DEFAULT_RETRY, Retry, download

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"(url-)?[0-9a-f]{64}")
_DIGEST_HINT = "digests come from the lock: run `imagebuilder lock` again and review the diff"


def check_digest(sha256: str) -> str:
    """``sha256`` when it is 64 lower-case hex digits, else :class:`VerificationError`."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise VerificationError(
            f"{sha256!r} is not a sha256 digest (64 lower-case hex digits)", hint=_DIGEST_HINT
        )
    return sha256


def default_cache_dir() -> Path:
    env = os.environ.get("IMAGEBUILDER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nodetrust-imagebuilder"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Fetched:
    path: Path
    sha256: str
    size: int
    url: str  # where it came from this time ("cache" when it was already there)


class Cache:
    def __init__(self, root: Path, *, retry: Retry = DEFAULT_RETRY) -> None:
        self.root = Path(root)
        self.retry = retry
        self._verified: dict[str, tuple[int, int]] = {}  # sha -> (size, mtime_ns) hashed in this process

    def entry(self, sha256: str) -> Path:
        """Where the entry of ``sha256`` lives; anything but 64 lower-case hex digits is refused (it would
        be a path: an absolute one replaces the cache root)."""
        return self.root / "sha256" / check_digest(sha256)[:2] / sha256

    def _ensure(self) -> None:
        for sub in ("sha256", "partial", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        if not _KEY.fullmatch(key):
            raise VerificationError(f"cache key {key!r} is not a digest", hint=_DIGEST_HINT)
        self._ensure()
        with (self.root / "locks" / f"{key}.lock").open("w") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another build is fetching %s; waiting for it", key[:16])
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            yield

    def lookup(self, sha256: str, *, size: int | None = None) -> Path | None:
        """The verified entry for ``sha256``, or None; a corrupt entry is deleted."""
        path = self.entry(sha256)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        if self._verified.get(sha256) == (st.st_size, st.st_mtime_ns):
            return path
        actual = sha256_file(path)
        if actual != sha256 or (size is not None and st.st_size != size):
            log.warning(
                "cache entry %s is corrupt (content sha256 %s, %d bytes); removing it",
                path,
                actual,
                st.st_size,
            )
            path.unlink(missing_ok=True)
            return None
        self._verified[sha256] = (st.st_size, st.st_mtime_ns)
        return path

    def fetch(
        self, name: str, urls: Sequence[str], *, sha256: str | None = None, size: int | None = None
    ) -> Fetched:
        """The content of the first URL whose download has ``sha256`` (and ``size``), via the cache.

        Without ``sha256`` (first resolution by ``imagebuilder lock``) the first URL that
        downloads completely wins and its digest is computed.
        """
        if not urls:
            raise FetchError(f"{name}: no URL to fetch it from")
        key = sha256 or "url-" + hashlib.sha256(urls[0].encode()).hexdigest()
        with self._locked(key):
            if sha256 is not None:
                hit = self.lookup(sha256, size=size)
                if hit is not None:
                    log.debug("%s: cache hit %s", name, hit)
                    return Fetched(hit, sha256, hit.stat().st_size, "cache")
            failures: list[str] = []
            mismatches: list[str] = []
            partial = self.root / "partial" / f"{key}.part"
            for url in urls:
                try:
                    # Nothing pins the content without a digest: never splice a resumed download onto what
                    # another source, or another attempt at this one, sent.
                    download(url, partial, name=name, retry=self.retry, resume=sha256 is not None)
                except FetchError as exc:
                    log.warning("%s", exc.message)
                    failures.append(exc.message)
                    continue
                got = partial.stat().st_size
                actual = sha256_file(partial)
                if (sha256 is not None and actual != sha256) or (size is not None and got != size):
                    mismatches.append(f"{url} served sha256 {actual} ({got} bytes)")
                    log.error(
                        "%s: %s, expected %s; discarding it", name, mismatches[-1], sha256 or f"{size} bytes"
                    )
                    partial.unlink(missing_ok=True)
                    continue
                target = self.entry(actual)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(partial, target)
                st = target.stat()
                self._verified[actual] = (st.st_size, st.st_mtime_ns)
                return Fetched(target, actual, st.st_size, url)
        if mismatches:
            raise VerificationError(
                f"{name}: no source served the pinned content (sha256 {sha256}): " + "; ".join(mismatches),
                hint="an upstream file changed or was tampered with: check it, then `imagebuilder lock` again "
                "only if the change is legitimate",
            )
        raise FetchError(
            f"{name}: every source failed: " + "; ".join(failures),
            hint="check the network or add a mirror; partial downloads resume on the next run",
        )

    def put(self, source: Path) -> Fetched:
        """Add a local file (e.g. a wheel built here) to the cache; returns its entry."""
        digest = sha256_file(source)
        target = self.entry(digest)
        with self._locked(digest):
            if self.lookup(digest) is None:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.root / "partial" / f"{digest}.put-{os.getpid()}"
                shutil.copyfile(source, tmp)
                os.replace(tmp, target)
        return Fetched(target, digest, target.stat().st_size, source.as_uri())
