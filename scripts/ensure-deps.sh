#!/usr/bin/env bash
# Install what the project needs, idempotently: Debian packages, then a .venv
# with the project and its development tools. Safe to run again and again; it
# only touches apt when a package is missing and pip when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # build and Python
  build-essential pkg-config python3 python3-dev python3-venv git
  # TPM: emulator, its tools and the TSS the agent binds to
  swtpm swtpm-tools libtss2-dev tpm2-tools
  # fake sysfs/udev for the PCI inventory tests
  umockdev libumockdev-dev
  # libvirt, QEMU and firmware for the builder and the VM tests
  libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients libvirt-dev
  qemu-system-x86 qemu-utils ovmf
  # ISO, seed and root file system tools for the fixture installer
  xorriso mtools dosfstools debootstrap cpio zstd e2fsprogs fdisk squashfs-tools busybox-static
  util-linux dpkg-dev shellcheck gnupg gpgv
  # PostgreSQL for the HA store tests
  postgresql
  # Authenticode oracles for the boot reference values (imagebuilder.pehash tests)
  osslsigncode pesign
  # the imager's tests: sgdisk -v as a GPT oracle, the iPXE ROM, b3sum (the BLAKE3 team's own tool) as the oracle
  # of the BLAKE3 digests a release signs; cloud-init's own schema validation runs from
  # Debian's cloud-init package unpacked by scripts/cloud-init-schema.sh, on these Python modules
  gdisk ipxe-qemu b3sum python3-requests python3-jinja2 python3-jsonschema python3-yaml python3-configobj
  python3-jsonpatch python3-netifaces
  # the peer tier's node on this host (tests/support/kube_node.py): containerd, CNI plugins, iptables for the kubelet
  containerd containernetworking-plugins iptables
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "Missing Debian packages: ${missing[*]}" >&2
    echo "Run as root (or: sudo apt-get install ${missing[*]})." >&2
    exit 1
  fi
  echo ">> installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" || {
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  }
fi

PY=/usr/bin/python3
if [ ! -x .venv/bin/python ]; then
  echo ">> creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.nodetrust-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo ">> installing the project and its tools into .venv"
  .venv/bin/pip install --quiet --disable-pip-version-check --upgrade pip 2>/dev/null || true
  .venv/bin/pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import tpm2_pytss, grpc, grpclib, pyudev, pynvml, libvirt, psycopg, blake3" \
    || { echo "the .venv is incomplete; see the pip output above" >&2; exit 1; }
  touch "$stamp"
fi

# cloud-init's own schema validation for `imagebuilder release` and the tests: Debian's package
# unpacked into .cache/cloud-init-deb, never installed (a no-op once unpacked).
scripts/cloud-init-schema.sh
