"""The fixture's SPIRE tarball with the real peers (the VM tier's and ``make demo``'s payloads).

The node definitions pin SPIRE 1.14.1; only v1.13.3 can be built here, so the tarball carries v1.13.3's
spire-agent linked again with 1.14.1 stamped (tests/support/spire_release.py says exactly what it is).
Checked: upstream's layout (one ``spire-1.14.1/`` folder, ``LICENSE``, ``README.md``, the sample
configurations and ``bin/spire-agent``), its checksum file, and the binary itself once unpacked the way
the builder stages it (one component stripped, to ``/opt/spire/1.14.1/``): it runs, says 1.14.1, and
is the v1.13.3 code (the same subcommands as the peer's, and ``validate`` accepts the release's
agent.conf as the peer's does).
"""

from __future__ import annotations

import hashlib
import stat
import tarfile
from pathlib import Path

import pytest

from tests.support.payload_server import spire_tarball
from tests.support.peers import run
from tests.support.spire import SPIRE_VERSION, spire_binary
from tests.support.spire_release import FIXTURE_SPIRE_VERSION
from tests.systemd.test_spire_agent_unit import documented_agent_conf

TOP = f"spire-{FIXTURE_SPIRE_VERSION}"


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spire_tarball(tmp_path_factory.mktemp("spire-payload") / f"v{FIXTURE_SPIRE_VERSION}", real=True)


@pytest.fixture(scope="module")
def staged(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tarball unpacked as the definition's artifact is: ``strip_components: 1``."""
    dest = tmp_path_factory.mktemp("opt-spire") / FIXTURE_SPIRE_VERSION
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) < 2 or not parts[1]:
                continue
            member.name = parts[1]
            # tarfile's extraction filters need Python 3.11.4; this one is 3.11.2 (Debian 12): check by hand
            assert (member.isfile() or member.isdir()) and not member.name.startswith("/"), member.name
            assert ".." not in member.name.split("/"), member.name
            tar.extract(member, dest)
    return dest


def _version(binary: Path) -> str:
    done = run([binary, "--version"])
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[0]


def test_the_layout_is_upstreams(tarball: Path) -> None:
    assert tarball.name == f"spire-{FIXTURE_SPIRE_VERSION}-linux-amd64-musl.tar.gz"
    with tarfile.open(tarball) as tar:
        files = {m.name: m for m in tar.getmembers() if m.isfile()}
        dirs = {m.name for m in tar.getmembers() if m.isdir()}
    assert set(files) == {
        f"{TOP}/LICENSE",
        f"{TOP}/README.md",
        f"{TOP}/bin/spire-agent",
        f"{TOP}/conf/agent/agent.conf",
        f"{TOP}/conf/server/server.conf",
    }
    assert {n.split("/", 1)[0] for n in files} | {d.split("/", 1)[0] for d in dirs} == {TOP}
    assert stat.S_IMODE(files[f"{TOP}/bin/spire-agent"].mode) == 0o755
    assert all(stat.S_IMODE(m.mode) == 0o644 for n, m in files.items() if not n.endswith("/spire-agent"))
    sums = (tarball.parent / f"spire-{FIXTURE_SPIRE_VERSION}-linux-amd64-musl_sha256sum.txt").read_text()
    assert sums == f"{hashlib.sha256(tarball.read_bytes()).hexdigest()}  {tarball.name}\n"


def test_the_staged_binary_is_the_real_spire_agent_stamped_with_the_fixture_version(staged: Path) -> None:
    binary = staged / "bin" / "spire-agent"
    assert binary.stat().st_size > 10 * 1024 * 1024, "a stand-in script, not the real spire-agent"
    assert b"stand-in" not in binary.read_bytes()[:4096]
    assert _version(binary) == FIXTURE_SPIRE_VERSION
    assert _version(spire_binary("spire-agent")) == SPIRE_VERSION  # the source it was linked from
    ours = run([binary, "--help"], check=False)
    peer = run([spire_binary("spire-agent"), "--help"], check=False)
    assert (ours.stdout + ours.stderr) == (peer.stdout + peer.stderr)  # the same commands: the same code


def test_the_staged_binary_accepts_the_release_agent_conf(staged: Path, tmp_path: Path) -> None:
    conf = tmp_path / "agent.conf"
    conf.write_text(documented_agent_conf())
    ours = run([staged / "bin" / "spire-agent", "validate", "-config", conf], check=False)
    peer = run([spire_binary("spire-agent"), "validate", "-config", conf], check=False)
    assert ours.returncode == peer.returncode == 0, ours.stdout + ours.stderr
