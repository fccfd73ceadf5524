"""The download cache against a real loopback HTTP server: digests, corrupt and partial entries,
resumed downloads, mirror fallback."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from imagebuilder.cache import Cache, sha256_file
from imagebuilder.errors import FetchError, VerificationError
from imagebuilder.fetch import Progress, Retry, fetch_small
from tests.support.payload_server import PayloadServer

SPIRE = "/spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz"
QUICK = Retry(attempts=3, backoff_s=0.01, timeout_s=5.0)  # the default policy's shape, with short pauses
ONCE = Retry(attempts=1)


def _digest(payload_root: Path, path: str) -> tuple[str, int]:
    data = (payload_root / path.lstrip("/")).read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


def test_fetch_verifies_and_then_serves_from_the_cache(tmp_path: Path, payloads: PayloadServer,
                                                       payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    cache = Cache(tmp_path / "cache")
    first = cache.fetch("spire", [payloads.url + SPIRE], sha256=sha, size=size)
    assert first.url == payloads.url + SPIRE
    assert first.path == cache.entry(sha)
    assert sha256_file(first.path) == sha
    again = Cache(tmp_path / "cache").fetch("spire", [payloads.url + SPIRE], sha256=sha, size=size)
    assert again.url == "cache"
    assert [p for p, _ in payloads.requests] == [SPIRE]  # no second download
    assert not list((tmp_path / "cache" / "partial").iterdir())


def test_a_corrupt_entry_is_never_used(tmp_path: Path, payloads: PayloadServer, payload_root: Path) -> None:
    sha, size = _digest(payload_root, SPIRE)
    cache = Cache(tmp_path / "cache")
    entry = cache.fetch("spire", [payloads.url + SPIRE], sha256=sha).path
    entry.write_bytes(b"bit rot")
    fresh = Cache(tmp_path / "cache")
    assert fresh.lookup(sha) is None
    assert not entry.exists()
    refetched = fresh.fetch("spire", [payloads.url + SPIRE], sha256=sha, size=size)
    assert refetched.url != "cache" and sha256_file(refetched.path) == sha


def test_a_truncated_entry_is_never_used(
    tmp_path: Path, payloads: PayloadServer, payload_root: Path
) -> None:
    sha, _size = _digest(payload_root, SPIRE)
    cache = Cache(tmp_path / "cache")
    entry = cache.fetch("spire", [payloads.url + SPIRE], sha256=sha).path
    entry.write_bytes(entry.read_bytes()[:10])
    assert Cache(tmp_path / "cache").lookup(sha) is None


def test_a_download_cut_short_resumes_with_range_in_the_same_run(tmp_path: Path, payloads: PayloadServer,
                                                                  payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    payloads.truncate_once[SPIRE] = 100
    fetched = Cache(tmp_path / "cache", retry=QUICK).fetch(
        "spire", [payloads.url + SPIRE], sha256=sha, size=size
    )
    assert sha256_file(fetched.path) == sha and fetched.url == payloads.url + SPIRE
    assert payloads.requests == [(SPIRE, ""), (SPIRE, "bytes=100-")]


def test_without_a_digest_a_retry_starts_again_from_the_first_byte(tmp_path: Path, payloads: PayloadServer,
                                                                   payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    payloads.truncate_once[SPIRE] = 100
    fetched = Cache(tmp_path / "cache", retry=QUICK).fetch("spire", [payloads.url + SPIRE])
    assert (fetched.sha256, fetched.size) == (sha, size)
    assert payloads.requests == [(SPIRE, ""), (SPIRE, "")]  # no Range: nothing pins what the first one sent


def test_an_interrupted_download_resumes_with_range_on_the_next_run(tmp_path: Path, payloads: PayloadServer,
                                                                    payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    cache = Cache(tmp_path / "cache", retry=ONCE)
    payloads.truncate_once[SPIRE] = 100
    with pytest.raises(FetchError, match="every source failed") as caught:
        cache.fetch("spire", [payloads.url + SPIRE], sha256=sha, size=size)
    assert "resume" in caught.value.hint
    partial = tmp_path / "cache" / "partial" / f"{sha}.part"
    assert partial.stat().st_size == 100
    assert cache.lookup(sha) is None  # a partial is not an entry
    fetched = cache.fetch("spire", [payloads.url + SPIRE], sha256=sha, size=size)
    assert sha256_file(fetched.path) == sha
    assert payloads.requests[-1] == (SPIRE, "bytes=100-")
    assert not partial.exists()


def test_a_server_that_stops_answering_is_timed_out_and_tried_again(tmp_path: Path, payloads: PayloadServer,
                                                                    payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    payloads.stall_once.add(SPIRE)
    patient = Retry(attempts=2, backoff_s=0.01, timeout_s=0.5)
    fetched = Cache(tmp_path / "cache", retry=patient).fetch(
        "spire", [payloads.url + SPIRE], sha256=sha, size=size
    )
    assert sha256_file(fetched.path) == sha
    assert [p for p, _ in payloads.requests] == [SPIRE, SPIRE]


@pytest.mark.parametrize("status", [503, 429, 502])
def test_a_transient_http_error_is_retried_and_a_lasting_one_is_reported(
    tmp_path: Path, payloads: PayloadServer, payload_root: Path, status: int
) -> None:
    sha, size = _digest(payload_root, SPIRE)
    payloads.fail_next[SPIRE] = (status, 2)
    fetched = Cache(tmp_path / "cache", retry=QUICK).fetch(
        "spire", [payloads.url + SPIRE], sha256=sha, size=size
    )
    assert sha256_file(fetched.path) == sha and len(payloads.requests) == 3
    payloads.fail_next["/checksums"] = (status, 3)
    with pytest.raises(FetchError, match=f"/checksums: HTTP {status}"):
        fetch_small(payloads.url + "/checksums", name="checksums", retry=QUICK)
    assert [p for p, _ in payloads.requests[3:]] == ["/checksums"] * 3
    assert "/checksums" not in payloads.fail_next


def test_a_definite_answer_is_not_retried(tmp_path: Path, payloads: PayloadServer) -> None:
    payloads.status["/forbidden"] = 403
    with pytest.raises(FetchError, match="HTTP 403"):
        Cache(tmp_path / "cache", retry=QUICK).fetch("x", [payloads.url + "/forbidden"])
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch_small(payloads.url + "/missing", name="missing", retry=QUICK)
    assert [p for p, _ in payloads.requests] == ["/forbidden", "/missing"]


def test_a_retry_policy_must_make_sense() -> None:
    for bad in ({"attempts": 0}, {"backoff_s": -1.0}, {"timeout_s": 0.0}):
        with pytest.raises(ValueError, match="invalid retry policy"):
            Retry(**bad)


def test_mirrors_are_tried_in_order(tmp_path: Path, payloads: PayloadServer, payload_root: Path) -> None:
    sha, size = _digest(payload_root, SPIRE)
    payloads.status["/down" + SPIRE] = 503
    payloads.tamper("/evil" + SPIRE, b"not the pinned content")
    urls = [payloads.url + "/down" + SPIRE, payloads.url + "/evil" + SPIRE, payloads.url + SPIRE]
    fetched = Cache(tmp_path / "cache", retry=QUICK).fetch("spire", urls, sha256=sha, size=size)
    assert fetched.url == payloads.url + SPIRE
    # the mirror that is down is tried three times; the one serving other content once (no retry helps)
    assert [p for p, _ in payloads.requests] == ["/down" + SPIRE] * 3 + ["/evil" + SPIRE, SPIRE]


def test_no_source_with_the_pinned_content_is_a_verification_error(tmp_path: Path, payloads: PayloadServer,
                                                                   payload_root: Path) -> None:  # fmt: skip
    sha, _size = _digest(payload_root, SPIRE)
    payloads.tamper(SPIRE, b"tampered")
    cache = Cache(tmp_path / "cache")
    with pytest.raises(VerificationError, match="no source served the pinned content") as caught:
        cache.fetch("spire", [payloads.url + SPIRE], sha256=sha)
    assert hashlib.sha256(b"tampered").hexdigest() in caught.value.message
    assert cache.lookup(sha) is None
    assert not list((tmp_path / "cache" / "partial").iterdir())  # a wrong download is not kept


def test_without_a_digest_the_first_complete_download_wins(tmp_path: Path, payloads: PayloadServer,
                                                           payload_root: Path) -> None:  # fmt: skip
    sha, size = _digest(payload_root, SPIRE)
    payloads.status["/gone"] = 404
    fetched = Cache(tmp_path / "cache").fetch("spire", [payloads.url + "/gone", payloads.url + SPIRE])
    assert (fetched.sha256, fetched.size) == (sha, size)


def test_errors_name_every_source(tmp_path: Path, payloads: PayloadServer) -> None:
    with pytest.raises(FetchError) as caught:
        Cache(tmp_path / "cache", retry=QUICK).fetch(
            "x", [payloads.url + "/a", "http://127.0.0.1:9/b", "ftp://c/d"]
        )
    message = caught.value.message
    assert "/a: HTTP 404" in message and "127.0.0.1:9/b" in message and "unsupported URL scheme" in message


def test_file_urls_and_put(tmp_path: Path) -> None:
    source = tmp_path / "blob"
    source.write_bytes(b"x" * 1000)
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    cache = Cache(tmp_path / "cache")
    assert cache.fetch("blob", [source.as_uri()], sha256=sha).sha256 == sha
    other = tmp_path / "wheel.whl"
    other.write_bytes(b"wheel")
    put = cache.put(other)
    assert put.path == cache.entry(put.sha256) and put.path.read_bytes() == b"wheel"


def test_progress_is_a_bar_on_a_terminal_and_quiet_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress("iso", 1000, stream=tty)
    bar.update(500)
    bar.finish()
    assert "\r" in tty.getvalue() and "50.0%" in tty.getvalue() and "100.0%" not in tty.getvalue()
    assert tty.getvalue().endswith("\n")
    plain = io.StringIO()
    quiet = Progress("iso", 1000, stream=plain)
    quiet.update(1000)
    quiet.finish()
    assert plain.getvalue() == ""  # non-terminal progress goes to the log, not the stream
