"""Real spire-server and spire-agent v1.13.3 (from ``make peers``, interop/spire) for the peer tier.

Public API::

    SPIRE_VERSION = "1.13.3"
    spire_binary(name) -> Path                 # spire-server | spire-agent; PeerError naming `make peers`
    class SpireServer(dir, trust_domain, node_attestors={...})   # .start() .bundle_pem() .agent_show(id)
    class SpireAgent(dir, trust_domain, server_port, bundle, node_attestor=...)  # .start() .healthy()
    devid_attestor(...) / tpm_plugin_attestor(...)  # the NodeAttestor blocks, as HCL
    wait_for_line(log, pattern, *, proc, timeout, fail_on=()) -> str

The configurations are those of ../shared/reference/real-peers.md (5.1, 6.4): loopback, sqlite3,
memory KeyManager, rate limits off on the server (SPIRE's per-IP attestation limit admits one
attestation a second from 127.0.0.1). The agent's ``tpm_devid`` opens swtpm's UNIX data socket
directly (``tpm_device_path``); no kernel TPM is needed. Every process goes through
:mod:`tests.support.peers` (``spawn``/``stop``), in its own session, and is stopped by the test
that started it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.peers import PeerError, bin_dir, log_tail, run, spawn, stop

SPIRE_VERSION = "1.13.3"
_NAMES = ("spire-server", "spire-agent")


def spire_binary(name: str) -> Path:
    if name not in _NAMES:
        raise ValueError(f"not a SPIRE peer: {name!r}")
    path = bin_dir("spire") / name
    if not path.is_file():
        raise PeerError(f"{path} is missing: run `make peers`")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _q(value: str | Path) -> str:
    """An HCL string literal (HCL does not expand variables; paths are quoted as JSON strings)."""
    return json.dumps(str(value))


def devid_server_attestor(devid_ca: Path, endorsement_ca: Path) -> str:
    return (
        'NodeAttestor "tpm_devid" {\n  plugin_data {\n'
        f"    devid_ca_path = {_q(devid_ca)}\n    endorsement_ca_path = {_q(endorsement_ca)}\n  }}\n}}\n"
    )


def devid_agent_attestor(device: Path | None, cert: Path, priv: Path, pub: Path) -> str:
    """``device`` None: spire-agent finds the TPM itself (the first /dev/tpmrmN, else /dev/tpmN)."""
    dev = f"    tpm_device_path = {_q(device)}\n" if device is not None else ""
    return (
        'NodeAttestor "tpm_devid" {\n  plugin_data {\n'
        f"{dev}    devid_cert_path = {_q(cert)}\n"
        f"    devid_priv_path = {_q(priv)}\n    devid_pub_path = {_q(pub)}\n  }}\n}}\n"
    )


def tpm_plugin_attestor(plugin: Path, checksum: str, data: dict[str, str] | None = None) -> str:
    """spire-tpm-plugin's ``tpm`` attestor (agent: no data; server: ca_path and/or hash_path)."""
    body = "".join(f"    {k} = {_q(v)}\n" for k, v in (data or {}).items())
    return (
        'NodeAttestor "tpm" {\n'
        f"  plugin_cmd = {_q(plugin)}\n  plugin_checksum = {_q(checksum)}\n"
        f"  plugin_data {{\n{body}  }}\n}}\n"
    )


def wait_for_line(
    log: Path,
    pattern: str,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = 60.0,
    fail_on: Sequence[str] = (),
    count: int = 1,
) -> list[str]:
    """Wait until ``pattern`` (a regex) matched ``count`` lines of ``log``; PeerError on a ``fail_on``
    match, on ``proc`` exiting, or at ``timeout`` (a bound on a hang, never a speed assertion)."""
    rx, bad = re.compile(pattern), [re.compile(f) for f in fail_on]
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = text.splitlines()
        for line in lines:
            for b in bad:
                if b.search(line):
                    raise PeerError(f"{log.name}: {line}\n--- log tail ---\n{log_tail(log)}")
        hits = [line for line in lines if rx.search(line)]
        if len(hits) >= count:
            return hits
        if proc is not None and proc.poll() is not None:
            raise PeerError(f"{log.name}: the process exited {proc.returncode}\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise PeerError(
                f"{log.name}: {count} line(s) matching {pattern!r} not seen within {timeout:g} s "
                f"({len(hits)} seen)\n{log_tail(log)}"
            )
        time.sleep(0.2)


@dataclass
class SpireServer:
    """spire-server on 127.0.0.1:<port>, its admin socket in a short private folder."""

    dir: Path
    trust_domain: str
    node_attestors: str
    svid_ttl: str = "1h"
    log_level: str = "DEBUG"
    port: int = 0
    netns: str | None = (
        None  # run inside /run/netns/<netns> (a rack's, tests/support/rack.py); port then given
    )
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _sock_dir: Path | None = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        assert self._sock_dir is not None
        return self._sock_dir / "api.sock"

    @property
    def log_path(self) -> Path:
        return self.dir / "spire-server.log"

    def config(self) -> str:
        data = self.dir / "data"
        return (
            "server {\n"
            '  bind_address = "127.0.0.1"\n'
            f'  bind_port = "{self.port}"\n'
            f"  socket_path = {_q(self.socket_path)}\n"
            f"  trust_domain = {_q(self.trust_domain)}\n"
            f"  data_dir = {_q(data)}\n"
            f"  log_level = {_q(self.log_level)}\n"
            '  ca_key_type = "ec-p256"\n'
            f"  default_x509_svid_ttl = {_q(self.svid_ttl)}\n"
            "  ratelimit {\n    attestation = false\n    signing = false\n  }\n"
            "}\n"
            "plugins {\n"
            '  DataStore "sql" {\n    plugin_data {\n      database_type = "sqlite3"\n'
            f"      connection_string = {_q(data / 'datastore.sqlite3')}\n    }}\n  }}\n"
            '  KeyManager "memory" {\n    plugin_data {}\n  }\n'
            + "".join(f"  {line}\n" for line in self.node_attestors.splitlines())
            + "}\n"
        )

    def start(self, timeout: float = 60.0) -> SpireServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sock_dir = Path(tempfile.mkdtemp(prefix="nt-spire-s-"))
        self.port = self.port or free_port()
        conf = self.dir / "server.conf"
        conf.write_text(self.config())
        self.proc = spawn(
            [spire_binary("spire-server"), "run", "-config", conf], log_path=self.log_path, netns=self.netns
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise PeerError(f"spire-server exited {self.proc.returncode}:\n{log_tail(self.log_path)}")
            done = self.cli("healthcheck", check=False)
            if done.returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise PeerError(f"spire-server not healthy within {timeout:g} s:\n{log_tail(self.log_path)}")
            time.sleep(0.3)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        words = [a for a in args[: next((i for i, a in enumerate(args) if a.startswith("-")), len(args))]]
        argv: list[str | Path] = [
            spire_binary("spire-server"),
            *words,
            "-socketPath",
            str(self.socket_path),
            *args[len(words) :],
        ]
        return run(argv, check=check, timeout=60)

    def bundle_pem(self) -> bytes:
        return self.cli("bundle", "show").stdout.encode()

    def agents(self) -> list[dict[str, Any]]:
        """``spire-server agent list -output json``: every attested agent's record."""
        doc: dict[str, Any] = json.loads(self.cli("agent", "list", "-output", "json").stdout or "{}")
        agents: list[dict[str, Any]] = doc.get("agents") or []
        return agents

    def agent_show(self, spiffe_id: str) -> dict[str, Any]:
        """``spire-server agent show -output json``: the agent's record (selectors, attestation type)."""
        out = self.cli("agent", "show", "-spiffeID", spiffe_id, "-output", "json").stdout
        doc: dict[str, Any] = json.loads(out)
        return doc

    def stop(self) -> int | None:
        rc = stop(self.proc) if self.proc is not None else None
        self.proc = None
        if self._sock_dir is not None:
            import shutil

            shutil.rmtree(self._sock_dir, ignore_errors=True)
        return rc


@dataclass
class SpireAgent:
    """spire-agent with a health endpoint on 127.0.0.1:<health_port> (``/live`` and ``/ready``)."""

    dir: Path
    trust_domain: str
    server_port: int
    bundle_path: Path
    node_attestor: str
    log_level: str = "DEBUG"
    health_port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _sock_dir: Path | None = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        assert self._sock_dir is not None
        return self._sock_dir / "agent.sock"

    @property
    def log_path(self) -> Path:
        return self.dir / "spire-agent.log"

    def config(self) -> str:
        return (
            "agent {\n"
            f"  data_dir = {_q(self.dir / 'data')}\n"
            f"  log_level = {_q(self.log_level)}\n"
            '  server_address = "127.0.0.1"\n'
            f'  server_port = "{self.server_port}"\n'
            f"  socket_path = {_q(self.socket_path)}\n"
            f"  trust_bundle_path = {_q(self.bundle_path)}\n"
            f"  trust_domain = {_q(self.trust_domain)}\n"
            "}\n"
            "plugins {\n"
            + "".join(f"  {line}\n" for line in self.node_attestor.splitlines())
            + '  KeyManager "memory" {\n    plugin_data {}\n  }\n'
            '  WorkloadAttestor "unix" {\n    plugin_data {}\n  }\n'
            "}\n"
            "health_checks {\n"
            "  listener_enabled = true\n"
            '  bind_address = "127.0.0.1"\n'
            f'  bind_port = "{self.health_port}"\n'
            '  live_path = "/live"\n'
            '  ready_path = "/ready"\n'
            "}\n"
        )

    def start(self, *, argv_prefix: Sequence[str | Path] = ()) -> SpireAgent:
        """Start it; ``argv_prefix`` wraps the command (the private mount namespace of the plugin tests)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sock_dir = Path(tempfile.mkdtemp(prefix="nt-spire-a-"))
        self.health_port = self.health_port or free_port()
        conf = self.dir / "agent.conf"
        conf.write_text(self.config())
        argv = [*argv_prefix, spire_binary("spire-agent"), "run", "-config", conf]
        self.proc = spawn(argv, log_path=self.log_path)
        return self

    def wait_attested(self, timeout: float = 60.0) -> str:
        """The SPIFFE ID of the first successful attestation; PeerError on a failed one."""
        line = wait_for_line(
            self.log_path,
            r"Node attestation was successful",
            proc=self.proc,
            timeout=timeout,
            fail_on=(r"Failed to retrieve attestation result", r"Agent crashed"),
        )[0]
        m = re.search(r'spiffe_id="?(spiffe://[^" ]+)', line)
        if m is None:
            raise PeerError(f"no SPIFFE ID in {line!r}")
        return m.group(1)

    def http_status(self, path: str) -> int:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                status: int = resp.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code

    def healthcheck(self) -> subprocess.CompletedProcess[str]:
        return run(
            [spire_binary("spire-agent"), "healthcheck", "-socketPath", str(self.socket_path)],
            check=False,
            timeout=30,
        )

    def stop(self) -> int | None:
        rc = stop(self.proc) if self.proc is not None else None
        self.proc = None
        if self._sock_dir is not None:
            import shutil

            shutil.rmtree(self._sock_dir, ignore_errors=True)
        return rc
