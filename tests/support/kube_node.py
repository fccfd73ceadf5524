"""A Kubernetes node on this host for the real kubeadm and kubelet v1.36.3, with no systemd and no trace on the host.

Public API::

    class HostNode:                                  # a context manager too
        work: Path; cri_socket: str; kubeadm: Path   # kubeadm: the wrapper to hand the agent (NODEAGENT_KUBEADM)
        @classmethod
        def start(cls, cp: ControlPlane, work: Path, node_name: str) -> HostNode      # containerd up
        def kubelet_pid(self) -> int | None
        def etc(self) -> Path; def var(self) -> Path  # the node's /etc and /var as kubeadm changed them
        def kubeadm_calls(self) -> list[list[str]]    # every argv the wrapper was given
        def stop(self) -> None                        # the kubelet, then containerd, by their pids

The node shares the control plane's network namespace (its node IP is 10.255.255.1, the API server is
127.0.0.1:6443 there). containerd 1.6 and the CNI plugins are Debian's; containerd runs as a plain
process with its root, state, socket and CNI folders under ``work``. ``kubeadm`` is a wrapper script
that runs each kubeadm call, with the argv it was given, in a private mount namespace whose ``/etc`` and
``/var`` are overlays kept under ``work`` (so ``/etc/kubernetes`` and ``/var/lib/kubelet`` persist from one
call to the next, as on a disk, and never touch the host), adds
``--ignore-preflight-errors=SystemVerification`` to ``join`` (a cgroup v1 host; the kubelet has
``failCgroupV1: false``), and, once ``kubeadm join`` has written the kubelet's files, starts the kubelet
exactly as kubeadm's systemd drop-in would::

    kubelet --bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf \\
      --config=/var/lib/kubelet/config.yaml $KUBELET_KUBEADM_ARGS     # from /var/lib/kubelet/kubeadm-flags.env

``kubeadm reset`` through the wrapper first stops every kubelet it started (systemd would: ``systemctl stop kubelet``).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

from tests.support.control_plane import ControlPlane
from tests.support.netns import ADDRESS
from tests.support.peers import PeerError, binary, log_tail, spawn, stop

CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
_DEBIAN_CNI = Path("/usr/lib/cni")
_CONTAINERD = Path("/usr/bin/containerd")

_CONFLIST = {
    "cniVersion": "1.0.0",
    "name": "nodetrust-test",
    "plugins": [
        {
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]]},
        },
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}

# Runs as /bin/sh inside the private mount namespace; @W@, @BIN@ are filled in.
_IN_MNTNS = r"""set -eu
W=@W@
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$W/etc/upper,workdir=$W/etc/work" /etc
mount -t overlay overlay -o "lowerdir=/var,upperdir=$W/var/upper,workdir=$W/var/work" /var
PATH=@BIN@:$PATH
export PATH
printf '%s\n' "$*" >> "$W/kubeadm-calls"
stop_kubelet() {
  if [ -s "$W/kubelet.pids" ]; then
    for pid in $(cat "$W/kubelet.pids"); do
      if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
      fi
    done
  fi
  rm -f "$W/kubelet.pids"
}
case "${1:-}" in
join)
  kubeadm_pid=$$
  # kubeadm's kubelet-start phase (re)starts the kubelet once it has written the kubelet's files in this
  # run; files an earlier run left behind do not count (their modification time is the old one).
  flags=/var/lib/kubelet/kubeadm-flags.env
  before=$(stat -c %y "$flags" 2>/dev/null || true)
  (
    while :; do
      now=$(stat -c %y "$flags" 2>/dev/null || true)
      if [ -n "$now" ] && [ "$now" != "$before" ] && [ -s /var/lib/kubelet/config.yaml ]; then break; fi
      kill -0 "$kubeadm_pid" 2>/dev/null || exit 0
      sleep 0.2
    done
    if [ -e "$W/fault-kill-kubeadm-after-kubelet-start" ]; then
      rm -f "$W/fault-kill-kubeadm-after-kubelet-start"
      kill -KILL "$kubeadm_pid"
      exit 0
    fi
    . /var/lib/kubelet/kubeadm-flags.env
    exec /bin/sh -c 'echo $$ >> "$1/kubelet.pids"; shift; exec setsid "$@"' sh "$W" kubelet \
      --bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf \
      --config=/var/lib/kubelet/config.yaml $KUBELET_KUBEADM_ARGS
  ) >> "$W/kubelet.log" 2>&1 < /dev/null &
  exec kubeadm "$@" --ignore-preflight-errors=SystemVerification
  ;;
reset)
  stop_kubelet
  exec kubeadm "$@"
  ;;
*)
  exec kubeadm "$@"
  ;;
esac
"""


class HostNode:
    def __init__(self, cp: ControlPlane, work: Path, node_name: str) -> None:
        self.cp = cp
        self.work = work
        self.node_name = node_name
        self.cri_socket = f"unix://{work / 'containerd' / 'containerd.sock'}"
        self.kubeadm = work / "bin" / "kubeadm"
        self._containerd: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, cp: ControlPlane, work: Path, node_name: str) -> HostNode:
        work.mkdir(parents=True, exist_ok=True)
        work.chmod(0o700)
        node = cls(cp, work, node_name)
        try:
            node._prepare()
            node._start_containerd()
        except BaseException:
            node.stop()
            raise
        return node

    def _prepare(self) -> None:
        w = self.work
        for d in (
            "etc/upper",
            "etc/work",
            "var/upper",
            "var/work",
            "bin",
            "cni/bin",
            "cni/net.d",
            "containerd",
        ):
            (w / d).mkdir(parents=True, exist_ok=True)
        for plugin in CNI_PLUGINS:
            source = _DEBIAN_CNI / plugin
            if not os.access(source, os.X_OK):
                raise PeerError(
                    f"{source} is missing: install containernetworking-plugins (scripts/ensure-deps.sh)"
                )
            link = w / "cni" / "bin" / plugin
            if not link.exists():
                link.symlink_to(source)
        (w / "cni" / "net.d" / "10-nodetrust-test.conflist").write_text(json.dumps(_CONFLIST, indent=2))
        # The node resolves its own name, as a real one does, and has no DNS server: the namespace has no
        # route out, and the kubelet's lookups of its own name would otherwise wait out their timeouts
        # (long enough for its CSINode set-up to give up and leave the Node NotReady until a restart).
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        (w / "etc" / "upper" / "hosts").write_text(
            f"{hosts.rstrip()}\n{ADDRESS} {self.node_name}\n".lstrip()
        )
        (w / "etc" / "upper" / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        kube_bin = binary("kubeadm").parent
        script = w / "in-mntns.sh"
        script.write_text(
            _IN_MNTNS.replace("@W@", shlex.quote(str(w))).replace("@BIN@", shlex.quote(str(kube_bin)))
        )
        self.kubeadm.write_text(
            "#!/bin/sh\n"
            "# kubeadm for a node on this host (tests/support/kube_node.py): the control plane's network\n"
            "# namespace, a private mount namespace with /etc and /var overlaid from the node's folder.\n"
            f"exec nsenter --net={shlex.quote(str(self.cp.ns.path))} -- unshare --mount --propagation private -- "
            f'/bin/sh {shlex.quote(str(script))} "$@"\n'
        )
        self.kubeadm.chmod(0o700)

    def _start_containerd(self) -> None:
        if not os.access(_CONTAINERD, os.X_OK):
            raise PeerError(f"{_CONTAINERD} is missing: install containerd (scripts/ensure-deps.sh)")
        c = self.work / "containerd"
        config = c / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{c / "root"}"\n'
            f'state = "{c / "state"}"\n'
            "[grpc]\n"
            f'  address = "{c / "containerd.sock"}"\n'
            '[plugins."io.containerd.grpc.v1.cri".cni]\n'
            f'  bin_dir = "{self.work / "cni" / "bin"}"\n'
            f'  conf_dir = "{self.work / "cni" / "net.d"}"\n'
        )
        self._containerd = spawn(
            [_CONTAINERD, "--config", config], log_path=self.work / "containerd.log", netns=self.cp.ns.name
        )
        deadline = time.monotonic() + 60
        while not (c / "containerd.sock").exists():
            if self._containerd.poll() is not None:
                raise PeerError(
                    f"containerd exited {self._containerd.returncode}:\n{log_tail(self.work / 'containerd.log')}"
                )
            if time.monotonic() > deadline:
                raise PeerError("containerd did not create its socket within 60 s")
            time.sleep(0.05)

    def fault_kill_kubeadm_after_kubelet_start(self) -> None:
        """The next ``kubeadm join`` is SIGKILLed once it has written the kubelet's files (a crash mid-join)."""
        (self.work / "fault-kill-kubeadm-after-kubelet-start").touch()

    def _kubelet_pids(self) -> list[int]:
        """Every kubelet the wrapper started (one pid a line, in order) that is still alive."""
        try:
            listed = [int(p) for p in (self.work / "kubelet.pids").read_text().split()]
        except (OSError, ValueError):
            return []
        alive = []
        for pid in listed:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            alive.append(pid)
        return alive

    def kubelet_pid(self) -> int | None:
        """The running kubelet (the last one started), or None."""
        alive = self._kubelet_pids()
        return alive[-1] if alive else None

    def etc(self) -> Path:
        return self.work / "etc" / "upper"

    def var(self) -> Path:
        return self.work / "var" / "upper"

    def kubeadm_calls(self) -> list[list[str]]:
        path = self.work / "kubeadm-calls"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    def stop(self) -> None:
        """Every kubelet the wrapper started (their pids are in kubelet.pids), then containerd."""
        for pid in self._kubelet_pids():
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while self._kubelet_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self._kubelet_pids():
            os.kill(pid, signal.SIGKILL)
        if self._containerd is not None:
            stop(self._containerd, grace=20.0)
            self._containerd = None

    def __enter__(self) -> HostNode:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
