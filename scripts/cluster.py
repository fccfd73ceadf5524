"""``make cluster``: a real Kubernetes v1.36.3 control plane on this machine, until Ctrl-C.

etcd, kube-apiserver and kube-controller-manager built by ``make peers`` run in a network namespace of
their own (tests/support/control_plane.py, the same fixture the peer tests use); the API server is
forwarded to 127.0.0.1:<port> on the host. It prints the kubeconfig to use (system:masters: keep it to
yourself), and stops everything in order (API server first, then etcd) on Ctrl-C or SIGTERM.

    make cluster                               # any free port; state in .run/cluster (removed at the end)
    make cluster CLUSTER_ARGS="--port 16443 --keep"
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--port", type=int, default=0, help="host port for the API server (default: any free)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".run" / "cluster", help="state folder")
    parser.add_argument("--keep", action="store_true", help="keep the state folder (PKI, logs) at the end")
    args = parser.parse_args()

    from tests.support.control_plane import ControlPlane
    from tests.support.peers import PeerError, binary

    if args.work.exists():
        shutil.rmtree(args.work)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        cp = ControlPlane.start(args.work, port=args.port)
    except PeerError as exc:
        print(f"cluster: the control plane did not start: {exc}", file=sys.stderr)
        return 1
    try:
        info = cp.describe()
        print(f"cluster: Kubernetes v1.36.3 control plane ready in {cp.started_in_s:.1f} s")
        print(
            f"  API server     {info['server']} (inside network namespace {info['namespace']}: {cp.endpoint})"
        )
        print(f"  kubeconfig     {info['kubeconfig']}  (system:masters; mode 0600)")
        print(f"  cluster CA     {info['ca_cert']}")
        print(f"  logs           {info['logs']}")
        print(f"  try            {binary('kubectl')} --kubeconfig {info['kubeconfig']} get --raw /version")
        print("  Ctrl-C stops it (API server first, then etcd).", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\ncluster: stopping", flush=True)
    finally:
        cp.stop()
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
