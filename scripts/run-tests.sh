#!/usr/bin/env bash
# The test entry point behind `make test` (all), `make unit` (fast), `make vm-test` (vm); `peers` runs tier 6.
# Starts the services the tiers need and stops what it started, even on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
what=${1:-all}

cleanup() { scripts/services.sh stop || true; }

if [ "$what" = all ] || [ "$what" = fast ]; then
  echo "== lint"
  ruff check .
  ruff format --check .
  mypy protocol agent server imagebuilder imager tests bench scripts vm-tests fixtures
fi

status=0
if [ "$what" = all ] || [ "$what" = vm ]; then
  trap cleanup EXIT
  scripts/services.sh start
fi
if [ "$what" = all ] || [ "$what" = fast ]; then
  echo "== tests (unit, swtpm, libvirt test driver, store)"
  python -m pytest tests -q -m "not vm and not peers" --durations=20 || status=$?
fi
if [ "$what" = all ] || [ "$what" = peers ]; then
  echo "== peers (tier 6: a real control plane, kubeadm and kubelet from interop/)"
  interop/build.sh
  rc=0
  python -m pytest tests -q -p no:cacheprovider -m peers --durations=0 || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "peers: no peer tests were collected (exit 5): that is a failure, not a skip" >&2
  fi
  [ "$rc" -eq 0 ] || status=$rc
fi
if [ "$what" = all ] || [ "$what" = vm ]; then
  echo "== vm-tests"
  rc=0
  python -m pytest vm-tests tests -q -p no:cacheprovider -m vm --durations=0 || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "vm-tests: no VM tests were collected (exit 5): that is a failure, not a skip" >&2
  fi
  [ "$rc" -eq 0 ] || status=$rc
fi
exit "$status"
