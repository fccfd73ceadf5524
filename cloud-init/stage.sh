#!/bin/sh
# nodetrust image builder: the late-command that installs the staging medium into the target.
#
#   sh stage.sh TARGET MEDIUM DATA_PORT
#
# Runs in the installer environment (subiquity's late-commands, or the fixture's), with
# the installed system mounted at TARGET and the staging medium (label NTSTAGE) at MEDIUM.
# It follows MEDIUM/plan.tsv, written by `imagebuilder build` (imagebuilder/staging.py):
#
#   apt      PKG...                 install from MEDIUM/apt (a flat apt repository)
#   hold     PKG...                 apt-mark hold
#   file     SRC DEST MODE          copy MEDIUM/SRC to TARGET/DEST
#   tarball  SRC DIR STRIP          extract MEDIUM/SRC into TARGET/DIR
#   dir      PATH MODE              an empty directory
#   venv     PATH REQUIREMENT PIP   a venv at PATH with REQUIREMENT from MEDIUM/wheels (pip: MEDIUM/wheels/PIP)
#   enable   UNIT NEED              systemctl enable UNIT; NEED is required or optional (skip if absent)
#   user     NAME SUDO SHELL KEYS   a local user, password locked, with KEYS (a file on MEDIUM or -)
#   sshd     PASSWORD               sshd policy: PASSWORD yes|no; "disable" turns the server off
#
# Progress goes to the console; the package list (dpkg-query, read inside the target),
# the installed size and a completion marker go to DATA_PORT (a second serial port the
# builder reads). Every step must succeed: a failure fails the install, and the
# installer's error-commands report it.
set -eu
T=$1
M=$2
DATA=$3
IN=/var/lib/nodetrust-staging  # the medium, as seen inside the target
TAB=$(printf '\t')

say() { echo "nodetrust-stage: $*" > /dev/console 2>/dev/null || echo "nodetrust-stage: $*"; }
data() { printf '%s\n' "$*" > "$DATA"; }
intarget() { curtin in-target --target "$T" -- "$@"; }
apt_target() {
  intarget env DEBIAN_FRONTEND=noninteractive apt-get \
    -o Dir::Etc::SourceList=/etc/apt/nodetrust-staging.list \
    -o Dir::Etc::SourceParts=/etc/apt/nodetrust-staging.d \
    -o APT::Get::List-Cleanup=false -o Acquire::Languages=none \
    -o Dpkg::Options::=--force-confold "$@"
}

[ -c "$DATA" ] || { say "the data port $DATA does not exist"; exit 1; }
[ -f "$M/plan.tsv" ] || { say "$M/plan.tsv is missing: is $M the staging medium?"; exit 1; }
say "staging from $M into $T"
data "NODETRUST-STAGE-BEGIN"

mkdir -p "$T$IN"
mount --bind "$M" "$T$IN"
cleanup() {
  umount "$T$IN" 2>/dev/null || true
  rmdir "$T$IN" 2>/dev/null || true
  rm -rf "$T/etc/apt/nodetrust-staging.list" "$T/etc/apt/nodetrust-staging.d"
  rm -f "$T"/var/lib/apt/lists/*nodetrust-staging* 2>/dev/null || true
}
trap cleanup EXIT

apt_ready=no
# The plan is read on fd 3: the commands below (apt, curtin) must not eat it from stdin.
exec 3< "$M/plan.tsv"
while IFS="$TAB" read -r kind a b c d <&3; do
  case "$kind" in
    ""|"#"*) continue ;;
    apt)
      if [ "$apt_ready" = no ]; then
        mkdir -p "$T/etc/apt/nodetrust-staging.d"
        echo "deb [trusted=yes] file:$IN/apt ./" > "$T/etc/apt/nodetrust-staging.list"
        apt_target update
        apt_ready=yes
      fi
      say "apt install $a"
      # shellcheck disable=SC2086  # a is a space-separated package list
      apt_target install -y --no-install-recommends $a
      ;;
    hold)
      say "apt-mark hold $a"
      # shellcheck disable=SC2086
      intarget apt-mark hold $a
      ;;
    file)
      say "file $b"
      mkdir -p "$(dirname "$T$b")"
      cp "$M/$a" "$T$b"
      chmod "$c" "$T$b"
      ;;
    tarball)
      say "extract $a into $b"
      mkdir -p "$T$b"
      tar -xf "$M/$a" -C "$T$b" --no-same-owner --strip-components="$c"
      ;;
    dir)
      mkdir -p "$T$a"
      chmod "$b" "$T$a"
      ;;
    venv)
      say "venv $a: $b"
      intarget python3 -m venv --without-pip "$a"
      intarget "$a/bin/python" "$IN/wheels/$c/pip" install --no-index --no-cache-dir \
        --disable-pip-version-check --only-binary=:all: --find-links "$IN/wheels" "$b"
      ;;
    enable)
      if [ "$b" = optional ] && [ ! -e "$T/usr/lib/systemd/system/$a" ] && [ ! -e "$T/lib/systemd/system/$a" ] \
        && [ ! -e "$T/etc/systemd/system/$a" ]; then
        say "unit $a is not in the target; not enabled"
      else
        say "enable $a"
        intarget systemctl enable "$a"
      fi
      ;;
    user)
      say "user $a"
      intarget useradd --create-home --shell "$c" "$a"
      intarget passwd --lock "$a" >/dev/null
      if [ "$b" = yes ]; then
        mkdir -p "$T/etc/sudoers.d"
        echo "$a ALL=(ALL) NOPASSWD:ALL" > "$T/etc/sudoers.d/90-nodetrust-$a"
        chmod 0440 "$T/etc/sudoers.d/90-nodetrust-$a"
      fi
      if [ "$d" != "-" ]; then
        home=$(intarget getent passwd "$a" | cut -d: -f6)
        mkdir -p "$T$home/.ssh"
        cp "$M/$d" "$T$home/.ssh/authorized_keys"
        chmod 0700 "$T$home/.ssh"
        chmod 0600 "$T$home/.ssh/authorized_keys"
        intarget chown -R "$a:" "$home/.ssh"
      fi
      ;;
    sshd)
      if [ "$a" = disable ]; then
        say "sshd disabled"
        intarget systemctl disable ssh.service >/dev/null 2>&1 || true
      else
        mkdir -p "$T/etc/ssh/sshd_config.d"
        pw=no; [ "$a" = yes ] && pw=yes
        printf 'PasswordAuthentication %s\nKbdInteractiveAuthentication no\nPermitRootLogin no\n' "$pw" \
          > "$T/etc/ssh/sshd_config.d/60-nodetrust.conf"
      fi
      ;;
    *)
      say "unknown plan entry: $kind"
      exit 1
      ;;
  esac
done
exec 3<&-

if [ "$apt_ready" = yes ]; then
  intarget apt-get clean
fi

# The package list, read inside the installed target; the builder checks count and digest.
say "reporting the installed packages"
# shellcheck disable=SC2016  # dpkg-query's format, not shell expansions
intarget dpkg-query -W -f '${binary:Package}\t${Version}\t${Architecture}\n' | LC_ALL=C sort > /tmp/nodetrust-packages.tsv
count=$(wc -l < /tmp/nodetrust-packages.tsv)
digest=$(sha256sum /tmp/nodetrust-packages.tsv | cut -d' ' -f1)
{
  echo "NODETRUST-PACKAGES-BEGIN"
  cat /tmp/nodetrust-packages.tsv
  echo "NODETRUST-PACKAGES-END $count $digest"
} > "$DATA"

# Generalise: no identity, no host keys, no first-boot state from the installer.
say "generalising the image"
: > "$T/etc/machine-id"
rm -f "$T/var/lib/dbus/machine-id" "$T"/etc/ssh/ssh_host_*
# The node's own first boot must run cloud-init from its datasource (the node pool's release), not the
# installer's: drop what the installer configured (its clean.d hook does this on newer cloud-init).
if [ -x "$T/usr/bin/cloud-init" ]; then
  intarget cloud-init clean --logs >/dev/null 2>&1 || true
fi
rm -f "$T/etc/cloud/cloud.cfg.d/99-installer.cfg" "$T/etc/cloud/cloud.cfg.d/90-installer-network.cfg" \
  "$T/etc/cloud/ds-identify.cfg" "$T/etc/cloud/cloud-init.disabled"

data "NODETRUST-INSTALLED-SIZE $(df -B1 --output=used "$T" | tail -n 1 | tr -d ' ')"
cleanup
trap - EXIT
fstrim "$T" >/dev/null 2>&1 || true
data "NODETRUST-STAGE-DONE"
say "done"
