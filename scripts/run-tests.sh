#!/usr/bin/env bash
# The test entry point behind `make test` (all), `make unit` (fast), `make vm-test` (vm); `peers` runs tier 6.
# Starts the services the tiers need and stops what it started, even on failure.
#
# `all` runs the VM tier beside the others: its VMs (TCG) keep the CPUs busy while the fast and peer
# tiers mostly wait on sockets, TPMs and servers, and neither of those starts a VM or touches the system
# libvirtd (the VM tier waits for any other QEMU: one VM at a time). Its output is kept in
# .run/vm-tier.log and printed once it is done; the exit status is the first failing tier's.
# The VM tier is the longest (the critical path), so it starts first. The peer build (interop/build.sh) runs
# in the background, its compiles at nice 19 (they have no deadline, the VMs' watchdogs do), filling the CPU
# the VM tier leaves, beside the lint and the fast tier; the peers tier waits for it. The VM tier needs only the
# cri-tools peer until its last tests (the demo's image and the demo: vm-tests/conftest.py, real_env) and waits
# for the others there, through interop/build.sh's per-module locks. A lint failure still ends the run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
what=${1:-all}
mkdir -p .run
VM_LOG=.run/vm-tier.log
# One temporary root per tier: pytest's default (/tmp/pytest-of-$USER/pytest-N) keeps the three newest runs, so
# a fourth pytest started beside a long tier (another tier, or anyone's) removed that tier's files mid-run.
# Each tier's folder is emptied when the tier starts and left for inspection after it.
BASETEMP=${NODETRUST_TEST_TMP:-/tmp/nodetrust-tests}
mkdir -p "$BASETEMP"
PEERS_LOG=.run/peers-build.log
vm_pid=""
peers_pid=""

cleanup() {
  if [ -n "$peers_pid" ] && kill -0 "$peers_pid" 2>/dev/null; then
    echo ">> stopping the peer build ($peers_pid)" >&2
    kill -- "-$peers_pid" 2>/dev/null || kill "$peers_pid" 2>/dev/null || true
    wait "$peers_pid" 2>/dev/null || true
  fi
  if [ -n "$vm_pid" ] && kill -0 "$vm_pid" 2>/dev/null; then
    echo ">> stopping the VM tier ($vm_pid): its fixtures remove their VMs" >&2
    kill -INT "$vm_pid" 2>/dev/null || true
    wait "$vm_pid" 2>/dev/null || true
  fi
  scripts/services.sh stop || true
}

vm_tier() {
  # A background job of a script ignores SIGINT; SIG_DFL again, so that pytest turns it into a
  # KeyboardInterrupt and its fixtures tear their VMs down (cleanup above sends it).
  python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
    python -m pytest vm-tests tests -q -p no:cacheprovider -m vm --durations=0 --basetemp "$BASETEMP/vm"
}

vm_verdict() {  # $1: pytest's exit status
  if [ "$1" -eq 5 ]; then
    echo "vm-tests: no VM tests were collected (exit 5): that is a failure, not a skip" >&2
  fi
  [ "$1" -eq 0 ] || status=$1
}

lint() {
  echo "== lint"
  ruff check .
  ruff format --check .
  mypy protocol agent server imagebuilder imager tests bench scripts vm-tests fixtures
}

peers_built() {  # wait for the background peer build (when there is one); print its log if it failed
  if [ -z "$peers_pid" ]; then
    interop/build.sh
    return
  fi
  local built=0
  wait "$peers_pid" || built=$?
  peers_pid=""
  if [ "$built" -ne 0 ]; then
    cat "$PEERS_LOG" >&2
    echo "the peer build (interop/build.sh) or the real payload tree after it failed ($built): its output is above and in $PEERS_LOG" >&2
    return "$built"
  fi
  cat "$PEERS_LOG"
}

status=0
if [ "$what" = all ] || [ "$what" = vm ]; then
  trap cleanup EXIT
  scripts/services.sh start
fi
if [ "$what" = all ]; then
  echo "== vm-tests: started beside the peer build, the lint, the fast and peer tiers (output: $VM_LOG, printed when it ends)"
  started=$(date +%s)
  vm_tier >"$VM_LOG" 2>&1 &
  vm_pid=$!
  echo "== peers: building beside the VM tier (output: $PEERS_LOG, printed before the peers tier)"
  # then the real payload tree for the demo's image (vm-tests/conftest.py real_env), off the VM tier's path;
  # its own process group (set -m), so that cleanup can stop the go builds under it
  set -m
  { interop/build.sh && nice -n 10 python -m tests.support.payload_server --kind real --for-fixture-iso --prepare; } \
    >"$PEERS_LOG" 2>&1 &
  peers_pid=$!
  set +m
fi
if [ "$what" = all ] || [ "$what" = fast ]; then
  lint
fi
if [ "$what" = all ] || [ "$what" = fast ]; then
  echo "== tests (unit, swtpm, libvirt test driver, store)"
  python -m pytest tests -q -m "not vm and not peers" --durations=20 --basetemp "$BASETEMP/fast" || status=$?
fi
if [ "$what" = all ] || [ "$what" = peers ]; then
  echo "== peers (tier 6: a real control plane, kubeadm and kubelet from interop/)"
  rc=0
  if peers_built; then
    python -m pytest tests -q -p no:cacheprovider -m peers --durations=0 --basetemp "$BASETEMP/peers" || rc=$?
  else
    rc=1
  fi
  if [ "$rc" -eq 5 ]; then
    echo "peers: no peer tests were collected (exit 5): that is a failure, not a skip" >&2
  fi
  [ "$rc" -eq 0 ] || status=$rc
fi
if [ "$what" = all ]; then
  echo "== vm-tests (waiting for the tier started at $(date -u -d "@$started" +%H:%M:%S))"
  rc=0
  wait "$vm_pid" || rc=$?
  vm_pid=""
  cat "$VM_LOG"
  echo "== vm-tests: $(( $(date +%s) - started )) s"
  vm_verdict "$rc"
fi
if [ "$what" = vm ]; then
  echo "== vm-tests"
  rc=0
  python -m pytest vm-tests tests -q -p no:cacheprovider -m vm --durations=0 --basetemp "$BASETEMP/vm" || rc=$?
  vm_verdict "$rc"
fi
exit "$status"
