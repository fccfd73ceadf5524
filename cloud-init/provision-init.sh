#!/bin/sh
# nodetrust image builder: PID 1 of the provisioning boot.
#
# The installer's late-command puts this file into the installed base as
# /usr/lib/nodetrust/provision-init (see cloud-init/stage.sh, plan entry `file`). The builder then
# starts the base's own kernel and initrd directly (no firmware, no boot loader) with
#
#   root=UUID=<root> rw init=/usr/lib/nodetrust/provision-init nodetrust.data=<data port>
#
# so that no systemd, no cloud-init and no first-boot logic ever runs on the image during the build:
# this script mounts what a chroot would have, runs stage.sh from the staging medium (label NTSTAGE)
# with TARGET=/, reports NODETRUST-STAGE-FAILED <status> on the data port if it fails, removes
# itself, and powers the VM off. It must never exit (the kernel panics when PID 1 exits).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
HOME=/root
LANG=C.UTF-8
SYSTEMD_OFFLINE=1  # systemctl enable/disable edit the file system: no systemd is running
export PATH HOME LANG SYSTEMD_OFFLINE

say() { echo "nodetrust-provision: $*" > /dev/console 2>/dev/null || true; }
mounted() { grep -q " $1 " /proc/mounts 2>/dev/null; }

mounted /proc || mount -t proc proc /proc
mounted /sys || mount -t sysfs sysfs /sys
mounted /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mounted /dev/pts || mount -t devpts devpts /dev/pts
mounted /dev/shm || mount -t tmpfs tmpfs /dev/shm
mounted /run || mount -t tmpfs -o mode=0755 tmpfs /run
mounted /tmp || mount -t tmpfs tmpfs /tmp
mount -o remount,rw /

data=/dev/ttyS1
# shellcheck disable=SC2013  # the kernel command line is one line of words
for word in $(cat /proc/cmdline); do
  case "$word" in nodetrust.data=*) data=${word#nodetrust.data=} ;; esac
done

status=0
medium=/run/nodetrust-staging
mkdir -p "$medium"
device=$(blkid -L NTSTAGE 2>/dev/null || true)
[ -n "$device" ] || device=/dev/disk/by-label/NTSTAGE
if mount -o ro "$device" "$medium"; then
  say "running the staging plan from $device"
  sh "$medium/stage.sh" / "$medium" "$data" || status=$?
  umount "$medium" || true
else
  say "cannot mount the staging medium (label NTSTAGE, $device)"
  status=98
fi
if [ "$status" -ne 0 ]; then
  say "staging failed with status $status"
  printf 'NODETRUST-STAGE-FAILED %s\n' "$status" > "$data" 2>/dev/null || true
fi

# Never part of the image: this hook removes itself before the file system is closed.
rm -f "$0"
rmdir /usr/lib/nodetrust 2>/dev/null || true
umount /tmp /dev/shm /dev/pts 2>/dev/null || true
sync
mount -o remount,ro / || sync
say "powering off"
echo o > /proc/sysrq-trigger
while :; do sleep 60; done
