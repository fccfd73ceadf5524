"""The pinned upstream peers that ``make peers`` builds from ``interop/``, and the one way to run them.

Public API::

    class PeerError(RuntimeError)            # a peer is missing, failed, or did not become ready
    KUBE_VERSION = "v1.36.3"
    binary(name: str) -> Path                # kubeadm, kubelet, kubectl, kube-apiserver,
                                             # kube-controller-manager, etcd
    bin_dir(module: str) -> Path             # ~/.cache/nodetrust/peers/<module>-<version>-<key>/bin
    relink(module, kind, version, tools, flags, check, *, cgo=False) -> Path
                                             # a module's tools linked again with other -ldflags
                                             # (another version stamped), cached; their bin folder
    run(argv, *, netns=None, env=None, input=None, timeout=120.0, check=True)
        -> subprocess.CompletedProcess[str]  # stdin closed unless input; LANG=C
    spawn(argv, *, log: Path, netns=None, env=None, pass_fds=()) -> subprocess.Popen[bytes]
    stop(proc, *, grace=20.0) -> int         # SIGTERM, wait, SIGKILL after grace; its exit status

Every subprocess of the peer tier (the peers, ``ip``, ``nsenter``) goes through ``run`` or ``spawn``;
``netns`` runs the command inside ``/run/netns/<netns>`` with ``nsenter --net`` (not ``ip netns exec``,
which remounts /sys and hides the cgroup mounts from a kubelet). A missing build is a
:class:`PeerError` that says to run ``make peers``: the peer tests fail, they never skip.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "interop" / "build.sh"
KUBE_VERSION = "v1.36.3"

_MODULE_OF = {
    "kube-apiserver": "kube",
    "kube-controller-manager": "kube",
    "kubeadm": "kube",
    "kubectl": "kube",
    "kubelet": "kube",
    "etcd": "etcd",
}
_TAIL = 4000


class PeerError(RuntimeError):
    """A peer binary is missing, a peer command failed, or a peer did not become ready."""


@functools.cache
def bin_dir(module: str) -> Path:
    """The bin folder of ``module``'s build for the committed go.sum; :class:`PeerError` if not built."""
    proc = subprocess.run(
        [str(BUILD_SCRIPT), "--bin", module],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    if proc.returncode != 0:
        raise PeerError(proc.stderr.strip() or f"interop/build.sh --bin {module} failed: run `make peers`")
    return Path(proc.stdout.strip())


def _cache() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nodetrust"
    return Path(os.environ.get("NODETRUST_CACHE") or default) / "peers"


def relink(
    module: str,
    kind: str,
    version: str,
    tools: tuple[str, ...],
    flags: str,
    check: list[str],
    *,
    cgo: bool = False,
) -> Path:
    """``tools`` of ``interop/<module>`` built again with ``-ldflags flags``, cached; returns the bin folder.

    The source is the module's pinned one (its go.sum, as ``make peers`` built it); ``check`` is a
    command run in the new bin folder whose first line of output (stdout, else stderr) must name
    ``version``. ``cgo``: build with ``CGO_ENABLED=1`` as the module's peer.conf may (then only the
    link step runs again: the build cache holds every package ``make peers`` compiled).
    """
    base = bin_dir(module)  # PeerError naming `make peers` when the module is not built
    keyed = f"{base}\0{version}\0{flags}\0{' '.join(tools)}" + ("\0cgo" if cgo else "")
    key = hashlib.sha256(keyed.encode()).hexdigest()[:12]
    out = _cache() / f"{kind}-v{version}-{key}"
    if (out / ".complete").is_file():
        return out / "bin"
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".lock-{kind}-{version}").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".complete").is_file():
            return out / "bin"
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{kind}-", dir=out.parent))
        try:
            packages = [p for p in _tool_packages(module) if p.rsplit("/", 1)[-1] in tools]
            script = '. "$0/interop/env.sh" && cd "$0/interop/$1" && shift && exec nice -n 19 go build -trimpath "$@"'
            run(["sh", "-c", script, ROOT, module, "-ldflags", flags, "-o", f"{tmp}/bin/", *packages],
                env={"CGO_ENABLED": "1" if cgo else "0", "HOME": str(Path.home())}, timeout=1800)  # fmt: skip
            done = run([tmp / "bin" / check[0], *check[1:]])
            said = (done.stdout.strip() or done.stderr.strip()).splitlines()[0]
            if version not in said:
                raise PeerError(f"the stamped {check[0]} says {said!r}, not {version}")
            (tmp / ".complete").write_text(f"{version} from {base}\n")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out / "bin"


def _tool_packages(module: str) -> list[str]:
    lines = (ROOT / "interop" / module / "go.mod").read_text().splitlines()
    found, block = [], False
    for line in lines:
        words = line.split()
        if words[:2] == ["tool", "("]:
            block = True
        elif block and words[:1] == [")"]:
            block = False
        elif block and words:
            found.append(words[0])
        elif words[:1] == ["tool"] and len(words) == 2:
            found.append(words[1])
    return found


def binary(name: str) -> Path:
    """The path of peer ``name``; :class:`PeerError` naming ``make peers`` when it is not built."""
    if name not in _MODULE_OF:
        raise ValueError(f"not a peer built by interop/: {name!r} (known: {', '.join(sorted(_MODULE_OF))})")
    path = bin_dir(_MODULE_OF[name]) / name
    if not os.access(path, os.X_OK):
        raise PeerError(f"{path} is missing or not executable: run `make peers`")
    return path


def _argv(argv: Sequence[str | Path], netns: str | None) -> list[str]:
    out = [os.fspath(a) for a in argv]
    if netns is not None:
        out = ["nsenter", f"--net=/run/netns/{netns}", "--", *out]
    return out


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    base = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    base.update(env or {})
    return base


def _tail(text: str) -> str:
    return text[-_TAIL:].strip()


def run(
    argv: Sequence[str | Path],
    *,
    netns: str | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float = 120.0,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; with ``check``, a non-zero exit is a :class:`PeerError` with its output."""
    cmd = _argv(argv, netns)
    log.debug("+ %s", shlex.join(cmd))
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            env=_env(env),
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{shlex.join(cmd)} did not finish within {timeout:g} s") from exc
    if check and proc.returncode != 0:
        raise PeerError(
            f"{shlex.join(cmd)} exited {proc.returncode}:\n{_tail(proc.stdout)}\n{_tail(proc.stderr)}".rstrip()
        )
    return proc


def spawn(
    argv: Sequence[str | Path],
    *,
    log_path: Path,
    netns: str | None = None,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start a long-running peer with stdout and stderr in ``log_path``; the Popen's pid is the peer's own."""
    cmd = _argv(argv, netns)
    log.debug("+ %s > %s", shlex.join(cmd), log_path)
    with log_path.open("ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(env),
            pass_fds=tuple(pass_fds),
            start_new_session=True,  # a ^C in the test's terminal reaches the test, which stops us in order
        )


def stop(proc: subprocess.Popen[bytes], *, grace: float = 20.0) -> int:
    """SIGTERM ``proc`` (by its pid), wait up to ``grace`` seconds, then SIGKILL; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %g s of SIGTERM; killing it", proc.pid, grace)
            proc.kill()
    return proc.wait()


def log_tail(path: Path, limit: int = _TAIL) -> str:
    """The end of a peer's log, for error messages."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()
