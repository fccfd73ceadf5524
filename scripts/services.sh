#!/usr/bin/env bash
# Start or stop the system services the VM tier needs (virtlogd, libvirtd).
# Only services this script started are stopped, by the process id it recorded.
# PostgreSQL and swtpm are started per test session / per test by the fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=.run
mkdir -p "$RUN"

running() { pgrep -x "$1" >/dev/null 2>&1; }

start_one() {
  local name=$1; shift
  if running "$name"; then
    echo ">> $name already running; leaving it alone"
    return
  fi
  echo ">> starting $name (log: $RUN/$name.log)"
  "$@" >"$RUN/$name.log" 2>&1 &
  local pid=$!
  echo "$pid" > "$RUN/$name.pid"
  for _ in $(seq 1 50); do
    if [ "$name" = libvirtd ] && [ -S /var/run/libvirt/libvirt-sock ]; then return; fi
    if [ "$name" = virtlogd ] && [ -S /var/run/libvirt/virtlogd-sock ]; then return; fi
    sleep 0.2
  done
  echo "$name did not come up; see its output above" >&2
  exit 1
}

stop_one() {
  local name=$1 f="$RUN/$1.pid"
  [ -f "$f" ] || return 0
  local pid
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    echo ">> stopping $name ($pid)"
    kill "$pid" || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$f"
}

case "${1:-}" in
  start)
    mkdir -p /var/run/libvirt /var/log/libvirt/qemu
    # QEMU runs as libvirt-qemu; it must be in /dev/kvm's group, or libvirt re-probes QEMU on every
    # domain start (~100 s each). Idempotent.
    if [ -e /dev/kvm ] && id libvirt-qemu >/dev/null 2>&1; then
      kvm_group=$(stat -c %G /dev/kvm)
      id -nG libvirt-qemu | tr ' ' '\n' | grep -qx "$kvm_group" || usermod -aG "$kvm_group" libvirt-qemu
    fi
    start_one virtlogd /usr/sbin/virtlogd
    start_one libvirtd /usr/sbin/libvirtd
    ;;
  stop)
    stop_one libvirtd
    stop_one virtlogd
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
