"""sd_notify against real datagram sockets (path and abstract), and the journald log format."""

from __future__ import annotations

import io
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import journal, sdnotify


@pytest.fixture
def path_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    # sun_path holds 108 bytes: pytest's tmp_path can be longer, so use a short private folder.
    folder = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    try:
        yield sock
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(folder)


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    name = f"nodetrust-test-{secrets.token_hex(6)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        yield sock
    finally:
        sock.close()


def test_notify_to_a_path_socket(path_socket: socket.socket) -> None:
    assert sdnotify.notify(STATUS="attesting with the TPM", READY="1")
    assert path_socket.recv(4096) == b"STATUS=attesting with the TPM\nREADY=1\n"


def test_status_to_an_abstract_socket(abstract_socket: socket.socket) -> None:
    assert sdnotify.status("verify: running (attempt 2)")
    assert abstract_socket.recv(4096) == b"STATUS=verify: running (attempt 2)\n"


def test_a_newline_cannot_forge_a_field(abstract_socket: socket.socket) -> None:
    assert sdnotify.status("bad\nREADY=1")
    assert abstract_socket.recv(4096) == b"STATUS=bad READY=1\n"


def test_unicode_and_long_status(abstract_socket: socket.socket) -> None:
    assert sdnotify.status("GPU 0 \u2013 ok " + "x" * 5000)
    data = abstract_socket.recv(8192).decode()
    assert data.startswith("STATUS=GPU 0 \u2013 ok ")
    assert len(data) <= len("STATUS=\n") + 1024


def test_no_socket_is_a_quiet_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.status("x") is False


def test_a_dead_socket_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.status("x") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sdnotify.status("x") is False


def test_bad_field_names_are_a_programming_error(abstract_socket: socket.socket) -> None:
    with pytest.raises(ValueError, match="upper-case"):
        sdnotify.notify(status="x")


# -- journal formatting ------------------------------------------------------------


def _record(level: int, msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("agent.lifecycle", level, __file__, 1, msg, args, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


@pytest.mark.parametrize(
    ("level", "prefix"),
    [(logging.DEBUG, "<7>"), (logging.INFO, "<6>"), (logging.WARNING, "<4>"), (logging.ERROR, "<3>"),
     (logging.CRITICAL, "<2>"), (25, "<6>"), (logging.WARNING + 5, "<4>")],
)  # fmt: skip
def test_priority_prefix(level: int, prefix: str) -> None:
    assert journal.JournalFormatter().format(_record(level, "hello %s", "world")) == (
        f"{prefix}agent.lifecycle: hello world"
    )


def test_structured_hints_are_sorted_and_quoted() -> None:
    extra = journal.fields(step="attest", attempt=2, reason='server said "no"', node="gpu-01", empty="")
    line = journal.JournalFormatter().format(_record(logging.WARNING, "attest failed", **extra))
    assert (
        line
        == '<4>agent.lifecycle: attest failed ATTEMPT=2 EMPTY="" NODE=gpu-01 REASON="server said \\"no\\"" STEP=attest'
    )


def test_a_traceback_keeps_the_priority_on_every_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("agent.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    lines = journal.JournalFormatter().format(record).splitlines()
    assert len(lines) > 3
    assert all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>RuntimeError: boom"


def test_human_format() -> None:
    extra = journal.fields(step="verify")
    assert (
        journal.HumanFormatter().format(_record(logging.INFO, "ok", **extra))
        == "INFO agent.lifecycle: ok STEP=verify"
    )


def test_field_names_are_checked() -> None:
    with pytest.raises(ValueError, match="journal field names"):
        journal.fields(**{"_private": 1})
    with pytest.raises(ValueError):
        journal.fields(**{"bad-name": 1})


def test_under_journald_compares_device_and_inode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with open(tmp_path / "stream", "w") as fh:
        st = os.fstat(fh.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert journal.under_journald(fh)
        with open(tmp_path / "other", "w") as other:
            assert not journal.under_journald(other)  # inherited variable, redirected stream
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert not journal.under_journald(sys.__stderr__)
    monkeypatch.delenv("JOURNAL_STREAM")
    assert not journal.under_journald(io.StringIO())


_CHILD = """
import logging, sys
from agent.journal import fields, setup_logging
setup_logging(int(sys.argv[1]))
log = logging.getLogger("agent.lifecycle")
log.debug("debug line")
log.info("attesting", extra=fields(step="attest"))
log.warning("server unreachable, retrying")
setup_logging(int(sys.argv[1]))  # idempotent: still one handler
log.error("gave up")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("verbosity", "journald", "expected"),
    [
        (0, True, ["<6>agent.lifecycle: attesting STEP=attest", "<4>agent.lifecycle: server unreachable, retrying",
                   "<3>agent.lifecycle: gave up"]),
        (2, True, ["<7>agent.lifecycle: debug line", "<6>agent.lifecycle: attesting STEP=attest",
                   "<4>agent.lifecycle: server unreachable, retrying", "<3>agent.lifecycle: gave up"]),
        (0, False, ["WARNING agent.lifecycle: server unreachable, retrying", "ERROR agent.lifecycle: gave up"]),
        (1, False, ["INFO agent.lifecycle: attesting STEP=attest", "WARNING agent.lifecycle: server unreachable, retrying",
                    "ERROR agent.lifecycle: gave up"]),
    ],
)  # fmt: skip
def test_setup_logging_end_to_end(
    tmp_path: Path, verbosity: int, journald: bool, expected: list[str]
) -> None:
    """A child process whose stderr is (or is not) the stream JOURNAL_STREAM names, as systemd sets it up."""
    err = tmp_path / "stderr"
    with open(err, "w") as fh:
        st = os.fstat(fh.fileno())
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        if journald:
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(verbosity)], stderr=fh, env=env, check=True, timeout=60
        )
    assert err.read_text().splitlines() == expected
