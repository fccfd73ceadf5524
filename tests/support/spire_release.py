"""The fixture's SPIRE release tarball: stand-ins for the fast tier, the real spire-agent for the VM tier.

Public API::

    FIXTURE_SPIRE_VERSION = "1.14.1"           # what the fixture definition pins (the product's version)
    spire_agent_binary(version) -> Path        # the real spire-agent that says `version`
    release_members(version, *, real, standin) -> dict[str, bytes]   # tarball path -> content
    tarball_name(version) -> str               # spire-<version>-linux-amd64-musl.tar.gz

What the real binary is, exactly (``real=True``: tests/support/payload_server.py ``real_kubernetes``,
the VM tier and ``make demo``):

* **spire-agent "1.14.1"** is **SPIRE v1.13.3's source, linked again with the version stamped 1.14.1**.
  Only v1.13.3 is served by the Go module proxy these machines use (interop/spire), while the node
  definitions pin 1.14.1, the product's version. So :func:`spire_agent_binary` builds
  ``github.com/spiffe/spire/cmd/spire-agent`` from interop/spire's go.sum exactly as ``make peers`` does
  (``CGO_ENABLED=1``, ``-trimpath``, ``-ldflags "-s -w ..."``) but with
  ``-X github.com/spiffe/spire/pkg/common/version.gittag=1.14.1`` instead of ``1.13.3``, and the same
  ``githash=191c76b`` (v1.13.3's commit: the code is that tag's). ``spire-agent --version`` prints
  ``1.14.1``; everything it does is v1.13.3's, which is what docs/attestation.md claims compatibility
  with. What the VM tier proves with it is the image's staging, unit and hand-off (the agent's DevID,
  ``tpm_devid`` against a stock spire-server), not SPIRE 1.14's behaviour. Linking again reuses the build
  cache of ``make peers`` (the same cgo setting), so it costs one link; the result is cached in the
  machine's peer cache (``$NODETRUST_CACHE/peers/spire-stamped-v1.14.1-*``, :func:`tests.support.peers.relink`).
  It is dynamically linked against the build machine's glibc (Debian 12, glibc 2.36, the fixture image's
  bookworm), where upstream's ``-musl`` tarball is static.
* **The layout is upstream's** (spiffe/spire ``.github/workflows/scripts/build_linux_artifacts.sh``):
  one top folder ``spire-<version>/`` with ``LICENSE``, the files of ``release/posix/spire/``
  (``README.md``, ``conf/agent/agent.conf``, ``conf/server/server.conf``), all taken from the v1.13.3
  module source, and ``bin/spire-agent``. **``bin/spire-server`` is left out**: a node never runs it, and
  the VM tier would carry tens of MB for nothing through every build.

The fast tier (``real=False``) keeps its two stand-ins: ``bin/spire-agent`` (a script that says it is a
stand-in) and ``conf/agent/agent.conf``.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.peers import PeerError, relink, run
from tests.support.spire import SPIRE_VERSION

FIXTURE_SPIRE_VERSION = "1.14.1"
SOURCE_COMMIT = "191c76b"  # interop/spire/peer.conf's githash: v1.13.3's commit
_VERSION_PKG = "github.com/spiffe/spire/pkg/common/version"
_MODULE = "github.com/spiffe/spire"


def tarball_name(version: str) -> str:
    return f"spire-{version}-linux-amd64-musl.tar.gz"


def spire_agent_binary(version: str) -> Path:
    """The real spire-agent that says ``version``: the peer build for 1.13.3, else that source stamped."""
    from tests.support.spire import spire_binary

    if version == SPIRE_VERSION:
        return spire_binary("spire-agent")
    flags = f"-s -w -X {_VERSION_PKG}.gittag={version} -X {_VERSION_PKG}.githash={SOURCE_COMMIT}"
    return (
        relink(
            "spire",
            "spire-stamped",
            version,
            ("spire-agent",),
            flags,
            ["spire-agent", "--version"],
            cgo=True,
        )
        / "spire-agent"
    )


def _module_dir() -> Path:
    """The SPIRE module's source in the Go module cache (what ``make peers`` downloaded)."""
    from tests.support.peers import ROOT

    script = '. "$0/interop/env.sh" && cd "$0/interop/spire" && exec go list -m -f "{{.Dir}}" "$1"'
    out = run(["sh", "-c", script, ROOT, _MODULE], timeout=120).stdout.strip()
    path = Path(out)
    if not (path / "LICENSE").is_file():
        raise PeerError(
            f"the SPIRE {SPIRE_VERSION} source is not in the Go module cache ({out!r}): run `make peers`"
        )
    return path


def release_members(version: str, *, real: bool, standin: bytes) -> dict[str, bytes]:
    """The tarball's files (path in the tarball -> content); see the module docstring for ``real``."""
    top = f"spire-{version}"
    if not real:
        return {
            f"{top}/bin/spire-agent": standin,
            f"{top}/conf/agent/agent.conf": b"# spire-agent configuration stand-in\n",
        }
    source = _module_dir()
    release = source / "release" / "posix" / "spire"
    members = {f"{top}/LICENSE": (source / "LICENSE").read_bytes()}
    for path in sorted(p for p in release.rglob("*") if p.is_file()):
        members[f"{top}/{path.relative_to(release).as_posix()}"] = path.read_bytes()
    members[f"{top}/bin/spire-agent"] = spire_agent_binary(version).read_bytes()
    return members
