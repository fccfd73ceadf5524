"""A KubeletConfiguration through kubeadm's round trip, and the real kubelet's verdict on what arrives.

Public API::

    round_trip(cp: ControlPlane, config: dict, work: Path) -> dict
        # what `kubeadm init phase upload-config kubelet` puts into the kubelet-config ConfigMap for
        # ``config`` (the real kubeadm, --dry-run: the cluster's own ConfigMap is left alone)
    lost_in_round_trip(sent: dict, received: dict) -> dict[str, tuple[Any, Any]]
        # key -> (sent, received) for every key of ``sent`` that did not come back equal (None: absent)
    kubelet_verdict(config: dict, work: Path) -> tuple[bool, str]
        # (accepted, the kubelet's output): the real kubelet v1.36.3 validates ``config`` as at start

``kubelet_verdict`` runs the kubelet with ``--lock-file`` on a lock this process holds: the kubelet checks
its configuration and flags first, then blocks on the lock (``flock``). A kubelet that exits did not
accept the configuration; one that is listed in /proc/locks as waiting for the lock did, and is then
killed by its pid. Nothing is decided from how long it takes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.control_plane import ControlPlane
from tests.support.peers import PeerError, binary, log_tail, run, spawn

_ATTACHED = "[dryrun] Attached object:"


def round_trip(cp: ControlPlane, config: dict[str, Any], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    dry = work / "dry-run"
    dry.mkdir(exist_ok=True)
    shutil.copy(cp.ns_admin_kubeconfig, dry / "admin.conf")  # kubeadm's dry run reads it from its folder
    (dry / "admin.conf").chmod(0o600)
    cluster = {
        "apiVersion": "kubeadm.k8s.io/v1beta4",
        "kind": "ClusterConfiguration",
        "kubernetesVersion": "v1.36.3",
    }
    path = work / "kubeadm.yaml"
    path.write_text(yaml.safe_dump_all([cluster, config]))
    out = run(
        [binary("kubeadm"), "init", "phase", "upload-config", "kubelet", f"--config={path}",
         f"--kubeconfig={cp.ns_admin_kubeconfig}", "--dry-run"],
        netns=cp.ns.name,
        env={"KUBEADM_INIT_DRYRUN_DIR": str(dry)},
    ).stdout  # fmt: skip
    # The dry run prints each object it would create after this marker, as YAML, up to the next "[" line.
    for chunk in out.split(_ATTACHED)[1:]:
        lines = []
        for line in chunk.splitlines()[1:]:
            if line.startswith("["):
                break
            lines.append(line)
        obj = yaml.safe_load("\n".join(lines))
        if (
            isinstance(obj, dict)
            and obj.get("kind") == "ConfigMap"
            and obj["metadata"]["name"] == "kubelet-config"
        ):
            received = yaml.safe_load(obj["data"]["kubelet"])
            assert isinstance(received, dict)
            return received
    raise PeerError(f"kubeadm's dry run printed no kubelet-config ConfigMap:\n{out[-2000:]}")


def lost_in_round_trip(sent: dict[str, Any], received: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (v, received.get(k)) for k, v in sent.items() if received.get(k) != v}


def kubelet_verdict(config: dict[str, Any], work: Path) -> tuple[bool, str]:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "kubelet-config.yaml"
    path.write_text(yaml.safe_dump(config))
    lock = work / "kubelet.lock"
    log_path = work / "kubelet.log"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = spawn(
            [
                "unshare", "--mount", "--propagation", "private", "--",
                binary("kubelet"), f"--config={path}", f"--lock-file={lock}",
                f"--root-dir={work / 'root'}", f"--cert-dir={work / 'pki'}",
                f"--kubeconfig={work / 'absent.conf'}",
            ],
            log_path=log_path,
        )  # fmt: skip
        try:
            inode = os.stat(lock).st_ino
            while proc.poll() is None:
                if _waiting_for_lock(proc.pid, inode):
                    return True, log_tail(log_path)
                time.sleep(0.05)
            return False, log_tail(log_path)
        finally:
            if proc.poll() is None:
                proc.kill()  # blocked in flock, holding nothing: SIGTERM would wait for the lock
            proc.wait()


def _waiting_for_lock(pid: int, inode: int) -> bool:
    """/proc/locks lists a blocked waiter as ``N: -> FLOCK  ADVISORY  WRITE <pid> <maj>:<min>:<inode> ...``."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        fields = line.split()
        if (
            len(fields) >= 7
            and fields[1] == "->"
            and fields[5] == str(pid)
            and fields[6].rsplit(":", 1)[-1] == str(inode)
        ):
            return True
    return False
