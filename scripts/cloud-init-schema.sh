#!/usr/bin/env bash
# Unpack Debian's cloud-init package into .cache/cloud-init-deb/root (never installed: no services,
# nothing runs at boot), so `imagebuilder release` and the tests can run cloud-init's own schema
# validation on a machine without cloud-init. Idempotent. Its Python dependencies are Debian
# packages in scripts/ensure-deps.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=.cache/cloud-init-deb
if [ -d "$cache/root/usr/lib/python3/dist-packages/cloudinit" ]; then
  exit 0
fi
mkdir -p "$cache"
chmod 0777 "$cache"  # apt-get download runs as _apt where it can
( cd "$cache" && apt-get download cloud-init >/dev/null 2>&1 ) || {
  apt-get update >/dev/null
  ( cd "$cache" && apt-get download cloud-init >/dev/null )
}
debs=("$cache"/cloud-init_*.deb)
rm -rf "$cache/root.tmp"
dpkg-deb -x "${debs[0]}" "$cache/root.tmp"
mv "$cache/root.tmp" "$cache/root"
echo ">> unpacked ${debs[0]} into $cache/root"
