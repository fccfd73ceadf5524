#!/bin/sh
# nodetrust image builder: the one script that puts things into the target, for both runs of a build.
#
#   sh stage.sh TARGET MEDIUM DATA_PORT
#
# It follows MEDIUM/plan.tsv, written by `imagebuilder build` (imagebuilder/staging.py), and runs
#
#  * in the installer, as a late-command (the installed system mounted at TARGET=/target, the base
#    medium at MEDIUM): what must happen at install time, the base plan; its result is the installed
#    base that builds cache and reuse;
#  * in the provisioning boot of that base (TARGET=/: the base's own kernel with
#    cloud-init/provision-init.sh as PID 1, the staging medium at MEDIUM): everything else, the
#    staging plan.
#
# Plan entries, one per line, tab-separated:
#
#   apt      PKG...                 install from MEDIUM/apt (a flat apt repository)
#   hold     PKG...                 apt-mark hold
#   file     SRC DEST MODE          copy MEDIUM/SRC to TARGET/DEST
#   tarball  SRC DIR STRIP          extract MEDIUM/SRC into TARGET/DIR
#   dir      PATH MODE              an empty directory
#   pip      PIP                    unpack MEDIUM/wheels/PIP under $BUILD/pip/PIP and byte-compile it: the base
#                                   plan does it once, so the staging plan's venv step runs a compiled pip
#   venv     PATH REQUIREMENT PIP   a venv at PATH with REQUIREMENT from MEDIUM/wheels, installed by the pip of
#                                   the `pip` entry when the base has it, else by MEDIUM/wheels/PIP itself
#   enable   UNIT NEED              systemctl enable UNIT; NEED is required or optional (skip if absent)
#   user     NAME SUDO SHELL KEYS   a local user, password locked, with KEYS (a file on MEDIUM or -)
#   sshd     PASSWORD               sshd policy: PASSWORD yes|no; "disable" turns the server off
#   owner    PATH OWNER             chown OWNER (user or user:group of the target) PATH
#   mask     UNIT                   systemctl mask UNIT
#   images   NS LIST CONFIG         import the OCI archives LIST names (MEDIUM/LIST: "SRC<TAB>REF" lines) into
#                                   containerd's NS namespace, each tagged REF: the target's containerd runs on
#                                   CONFIG for the import only (its own socket and state, stopped afterwards)
#   bootloader INFO                 the measured boot chain (imagebuilder/bootmeasure.py): a GRUB image of the
#                                   target's own modules with the tpm module and a literal configuration embedded,
#                                   as the ESP's EFI/BOOT/BOOTX64.EFI (and EFI/debian/grubx64.efi); what it boots
#                                   written to INFO as JSON for the builder's reference values
#   export   SERIAL                 the target's kernel and initrd, as a tar, onto the raw disk whose
#                                   serial is SERIAL; their digests and the root file system on DATA_PORT
#   report                          the installed packages (dpkg-query, read inside the target) and the
#                                   used size of the root file system on DATA_PORT
#   generalise                      no machine-id, no SSH host keys, no installer cloud-init state, no $BUILD
#   trim                            fstrim the root file system (freed blocks leave the QCOW2)
#
# Entries of a sealed image (imagebuilder/seal.py, docs/reproducible.md; the provisioning boot only):
#
#   epoch    SECONDS                SOURCE_DATE_EPOCH for every later step (pip's bytecode records source
#                                   hashes instead of times)
#   identify ROOT ESP DISK RPART EPART  the lock's identifiers replace the installer's random ones wherever
#                                   /etc, /boot and the ESP name them (fstab, grub.cfg); the boot loader then
#                                   embeds ROOT, the UUID the sealed root file system will have
#   remove   PATTERN                rm -rf every match of PATTERN in the target (a build record or cache)
#   empty    DIR                    remove every file under DIR, keep its folders (logs)
#   shadow   SECONDS                every account's last password change in /etc/shadow (and shadow-) set to
#                                   the day of SECONDS, when it is a day (0, must change, and empty, no
#                                   aging, stay): a cached base installed days before the lock and a cold
#                                   rebuild installed after it then write the same file
#   bolt     DIR                    every bbolt database under DIR (containerd's) rewritten canonically, its
#                                   time stamps clamped to SOURCE_DATE_EPOCH (MEDIUM/boltcanon.py)
#
# The builder then reads the provisioned disk offline and assembles the image's disk from it (the seal).
#
# Progress goes to the console, with the seconds since the machine booted; the data (package list,
# size, boot files) and the markers NODETRUST-STAGE-BEGIN / NODETRUST-STAGE-DONE go to DATA_PORT (a
# second serial port the builder reads). Every step must succeed: a failure stops the script with a
# non-zero status, which fails the install (the installer's error-commands report it) or the
# provisioning boot (provision-init.sh reports NODETRUST-STAGE-FAILED).
set -eu
T=$1
M=$2
DATA=$3
[ "$T" = / ] && T=""  # paths below are "$T$path": absolute in the running system, under /target in the installer
IN=/var/lib/nodetrust-staging  # the medium, as seen inside the target
BUILD=/var/lib/nodetrust-build  # what the base plan leaves for the staging plan; generalise removes it
TAB=$(printf '\t')

say() {
  up=$(cut -d' ' -f1 /proc/uptime 2>/dev/null || echo "?")
  echo "nodetrust-stage: [${up}s] $*" > /dev/console 2>/dev/null || echo "nodetrust-stage: [${up}s] $*"
}
data() { printf '%s\n' "$*" > "$DATA"; }
intarget() {
  if [ -z "$T" ]; then
    "$@"
  else
    curtin in-target --target "$T" -- "$@"
  fi
}
# --force-unsafe-io: dpkg skips its fsync before each rename. The image is built, synced and powered off
# before anyone uses it, and a build that dies half-way publishes nothing, so the per-file fsync buys
# nothing here and costs minutes under emulation (Ubuntu's own image builds skip it the same way).
apt_target() {
  intarget env DEBIAN_FRONTEND=noninteractive apt-get \
    -o Dir::Etc::SourceList=/etc/apt/nodetrust-staging.list \
    -o Dir::Etc::SourceParts=/etc/apt/nodetrust-staging.d \
    -o APT::Get::List-Cleanup=false -o Acquire::Languages=none \
    -o Dpkg::Options::=--force-confold -o Dpkg::Options::=--force-unsafe-io "$@"
}
# The newest of the given candidates that exists, else of the glob (vmlinuz, vmlinuz-6.8.0-...).
boot_file() {
  for candidate in "$T/boot/$1" "$T/$1"; do
    [ -e "$candidate" ] && { echo "$candidate"; return 0; }
  done
  # shellcheck disable=SC2012  # plain kernel file names
  newest=$(ls -1 "$T/boot/$1"-* 2>/dev/null | sort -V | tail -n 1)
  [ -n "$newest" ] && echo "$newest"
}

# The block device whose serial is $1 (a raw disk the builder attached), or nothing.
disk_by_serial() {
  for serial in /sys/block/*/serial; do
    [ "$(cat "$serial" 2>/dev/null)" = "$1" ] && echo "/dev/$(basename "$(dirname "$serial")")"
  done
  return 0
}
ESP_TYPE=c12a7328-f81f-11d2-ba4b-00a0c93ec93b
# The running system's root partition, its disk and its EFI system partition (provisioning boot only: no udev,
# so libblkid probes the devices itself): root_dev, disk, esp_dev.
target_devices() {
  root_dev=$(findmnt -no SOURCE / | head -n 1)
  disk=/dev/$(lsblk -ndo PKNAME "$root_dev" | head -n 1)
  esp_dev=""
  for part in $(lsblk -lnpo NAME "$disk"); do
    [ "$part" != "$disk" ] || continue
    [ "$(blkid -p -s PART_ENTRY_TYPE -o value "$part" 2>/dev/null)" != "$ESP_TYPE" ] || esp_dev=$part
  done
  if [ ! -b "$root_dev" ] || [ ! -b "$disk" ] || [ -z "$esp_dev" ]; then
    say "cannot tell the root partition ($root_dev), its disk ($disk) and the EFI system partition ($esp_dev)"
    exit 1
  fi
}
probe() { blkid -p -s "$1" -o value "$2" 2>/dev/null || true; }
SEAL=/run/nodetrust-seal  # the identify and bolt steps' scratch space (tmpfs)

[ -c "$DATA" ] || { say "the data port $DATA does not exist"; exit 1; }
[ -f "$M/plan.tsv" ] || { say "$M/plan.tsv is missing: is $M the staging medium?"; exit 1; }
say "staging from $M into ${T:-/}"
data "NODETRUST-STAGE-BEGIN"

mkdir -p "$T$IN"
mount --bind "$M" "$T$IN"
policy=""
if [ -z "$T" ] && [ ! -e /usr/sbin/policy-rc.d ]; then
  # No daemon may start while packages are installed (curtin in-target does the same in the installer).
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 0755 /usr/sbin/policy-rc.d
  policy=/usr/sbin/policy-rc.d
fi
cleanup() {
  umount "$T$IN" 2>/dev/null || true
  rmdir "$T$IN" 2>/dev/null || true
  rm -rf "$T/etc/apt/nodetrust-staging.list" "$T/etc/apt/nodetrust-staging.d"
  rm -f "$T"/var/lib/apt/lists/*nodetrust-staging* 2>/dev/null || true
  [ -z "$policy" ] || rm -f "$policy"
}
trap cleanup EXIT

apt_ready=no
# The plan is read on fd 3: the commands below (apt, curtin) must not eat it from stdin.
exec 3< "$M/plan.tsv"
SEAL_ROOT=""
SEAL_ESP=""
while IFS="$TAB" read -r kind a b c d e <&3; do
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
      intarget apt-get clean
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
    pip)
      # pip run from its wheel compiles its own modules from source at every run (zipimport writes no
      # bytecode): about 40 % of the venv step under emulation. The base keeps it unpacked and compiled.
      say "pip $a: unpacked and byte-compiled for the staging plan"
      rm -rf "$T$BUILD/pip/$a"
      mkdir -p "$T$BUILD/pip"
      intarget python3 -m zipfile -e "$IN/wheels/$a" "$BUILD/pip/$a"
      intarget python3 -m compileall -q "$BUILD/pip/$a/pip" >/dev/null
      ;;
    venv)
      pip="$IN/wheels/$c/pip"
      how="pip from its wheel"
      if [ -f "$T$BUILD/pip/$c/pip/__main__.py" ]; then
        pip="$BUILD/pip/$c/pip"
        how="pip compiled in the base"
      fi
      say "venv $a: $b ($how)"
      intarget python3 -m venv --without-pip "$a"
      intarget "$a/bin/python" "$pip" install --no-index --no-cache-dir \
        --disable-pip-version-check --only-binary=:all: --find-links "$IN/wheels" "$b"
      say "venv $a: installed"
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
    owner)
      say "owner $a $b"
      intarget chown "$b" "$a"
      ;;
    mask)
      say "mask $a"
      intarget systemctl mask "$a"
      ;;
    images)
      # The provisioning boot only (the target is the running system): containerd runs as a child of this script.
      [ -z "$T" ] || { say "images: only the staging plan (the provisioning boot) imports images"; exit 1; }
      say "importing container images into containerd's $a namespace"
      run=/run/nodetrust-containerd
      mkdir -p "$run"
      modprobe overlay 2>/dev/null || true  # the overlayfs snapshotter unpacks the layers
      containerd --config "$c" --address "$run/containerd.sock" --state "$run/state" > "$run/log" 2>&1 &
      ctd=$!
      tries=0
      while [ ! -S "$run/containerd.sock" ]; do
        if ! kill -0 "$ctd" 2>/dev/null || [ "$tries" -ge 1200 ]; then
          say "containerd did not start for the image import: $(tail -n 5 "$run/log")"
          exit 1
        fi
        tries=$((tries + 1))
        sleep 0.1
      done
      ctr_() { ctr --address "$run/containerd.sock" --namespace "$a" "$@"; }
      while IFS="$TAB" read -r src ref <&4; do
        before=$(ctr_ images ls -q)
        ctr_ images import "$IN/$src" > /dev/null
        # an archive names its image itself (a docker save tag, an OCI ref name): tag it with the definition's ref
        for name in $(ctr_ images ls -q); do
          case "$name" in sha256:*|"$ref") continue ;; esac
          printf '%s\n' "$before" | grep -qxF "$name" || ctr_ images tag --force "$name" "$ref" > /dev/null
        done
        ctr_ images ls -q | grep -qxF "$ref" || { say "$src did not import as $ref"; exit 1; }
        say "imported $ref"
      done 4< "$M/$b"
      # What an import leaves unreferenced (an archive's own OCI index) containerd removes in a garbage collection
      # it schedules by itself, a moment later: before this kill or after it, so one build shipped a blob another
      # did not. One collection now, waited for (a lease deleted with --sync), gives every build the same store.
      lease=$(ctr_ leases create) || { say "containerd refused a lease for its garbage collection"; exit 1; }
      ctr_ leases delete --sync "$lease" > /dev/null || { say "containerd's garbage collection failed"; exit 1; }
      say "images: containerd's garbage collection done"
      kill "$ctd"
      wait "$ctd" || true
      rm -rf "$run"
      ;;
    bootloader)
      # No grub.cfg, grubenv or module file read from disk, no menu, no state: GRUB measures the command line
      # (PCR 8), the kernel and the initrd (PCR 9); the firmware measures this image (PCR 4). linuxefi starts the
      # kernel's EFI stub, which hands the firmware's TCG event log to the kernel.
      kernel=$(readlink -f "$(boot_file vmlinuz)") || true
      initrd=$(readlink -f "$(boot_file initrd.img)") || true
      if [ ! -f "$kernel" ] || [ ! -f "$initrd" ]; then
        say "no kernel or initrd in $T/boot for the boot loader"
        exit 1
      fi
      kernel=${kernel#"$T"}
      initrd=${initrd#"$T"}
      root=$SEAL_ROOT  # a sealed image: the UUID its root file system will have (identify)
      [ -n "$root" ] || root=$(findmnt -no UUID --target "${T:-/}" 2>/dev/null || true)
      [ -n "$root" ] || root=$(blkid -s UUID -o value "$(df --output=source "${T:-/}" | tail -n 1)")
      [ -n "$root" ] || { say "cannot tell the UUID of the root file system"; exit 1; }
      # shellcheck disable=SC1091,SC2086  # Debian's defaults file; its values are word lists
      extra=$( . "$T/etc/default/grub" 2>/dev/null; echo ${GRUB_CMDLINE_LINUX:-} ${GRUB_CMDLINE_LINUX_DEFAULT:-} )
      cmdline="root=UUID=$root ro${extra:+ $extra}"
      mounted=""
      if ! mountpoint -q "$T/boot/efi"; then
        # fstab names the ESP by /dev/disk/by-uuid/, which needs udev; libblkid finds it by UUID without one.
        # A sealed image's fstab already names the ESP's final volume ID (identify): mount the partition itself.
        esp=$(awk '!/^[[:space:]]*#/ && $2 == "/boot/efi" { print $1; exit }' "$T/etc/fstab")
        case "$esp" in /dev/disk/by-uuid/*) esp="UUID=${esp#/dev/disk/by-uuid/}" ;; esac
        [ -z "$SEAL_ESP" ] || esp=$SEAL_ESP
        mount -t vfat "$esp" "$T/boot/efi" || { say "cannot mount the ESP ($esp) at /boot/efi"; exit 1; }
        mounted=yes
      fi
      cfg=$T$BUILD/grub-embedded.cfg
      mkdir -p "$(dirname "$cfg")" "$T/boot/efi/EFI/BOOT"
      # shellcheck disable=SC2016  # ($root) is GRUB's variable
      printf 'search --no-floppy --fs-uuid --set=root %s\nlinuxefi ($root)%s %s\ninitrdefi ($root)%s\nboot\n' \
        "$root" "$kernel" "$cmdline" "$initrd" > "$cfg"
      say "boot loader: GRUB with tpm and an embedded configuration (kernel $kernel, root UUID=$root)"
      intarget grub-mkimage -d /usr/lib/grub/x86_64-efi -O x86_64-efi -p /EFI/BOOT -c "$BUILD/grub-embedded.cfg" \
        -o /boot/efi/EFI/BOOT/BOOTX64.EFI tpm part_gpt fat ext2 search search_fs_uuid linuxefi
      [ ! -d "$T/boot/efi/EFI/debian" ] || cp "$T/boot/efi/EFI/BOOT/BOOTX64.EFI" "$T/boot/efi/EFI/debian/grubx64.efi"
      mkdir -p "$(dirname "$T$a")"
      printf '{"root_uuid": "%s", "kernel": "%s", "initrd": "%s", "cmdline": "%s"}\n' \
        "$root" "$kernel" "$initrd" "$cmdline" > "$T$a"
      chmod 0644 "$T$a"
      sync
      [ -z "$mounted" ] || umount "$T/boot/efi"
      ;;
    export)
      # The provisioning boot starts the base's own kernel directly: hand kernel and initrd to the builder.
      dev=$(disk_by_serial "$a")
      [ -n "$dev" ] || { say "no disk with serial $a to export the boot files to"; exit 1; }
      kernel=$(boot_file vmlinuz) || true
      initrd=$(boot_file initrd.img) || true
      if [ -z "$kernel" ] || [ -z "$initrd" ]; then
        say "no kernel or initrd in $T/boot"
        exit 1
      fi
      root=$(findmnt -no UUID --target "${T:-/}" 2>/dev/null || true)
      [ -n "$root" ] || root=$(blkid -s UUID -o value "$(df --output=source "${T:-/}" | tail -n 1)")
      [ -n "$root" ] || { say "cannot tell the UUID of the root file system"; exit 1; }
      out=$(mktemp -d)
      cp -L "$kernel" "$out/vmlinuz"
      cp -L "$initrd" "$out/initrd.img"
      say "export $kernel and $initrd to $dev (root UUID=$root)"
      tar -C "$out" -cf - vmlinuz initrd.img | dd of="$dev" bs=1M conv=fsync status=none
      data "NODETRUST-BOOT root=UUID=$root" \
        "vmlinuz=$(sha256sum < "$out/vmlinuz" | cut -d' ' -f1):$(wc -c < "$out/vmlinuz")" \
        "initrd.img=$(sha256sum < "$out/initrd.img" | cut -d' ' -f1):$(wc -c < "$out/initrd.img")"
      rm -rf "$out"
      ;;
    report)
      # The package list, read inside the target; the builder checks count and digest.
      say "reporting the installed packages"
      list=$(mktemp)
      # shellcheck disable=SC2016  # dpkg-query's format, not shell expansions
      intarget dpkg-query -W -f '${binary:Package}\t${Version}\t${Architecture}\n' | LC_ALL=C sort > "$list"
      count=$(wc -l < "$list")
      digest=$(sha256sum "$list" | cut -d' ' -f1)
      {
        echo "NODETRUST-PACKAGES-BEGIN"
        cat "$list"
        echo "NODETRUST-PACKAGES-END $count $digest"
      } > "$DATA"
      rm -f "$list"
      data "NODETRUST-INSTALLED-SIZE $(df -B1 --output=used "${T:-/}" | tail -n 1 | tr -d ' ')"
      ;;
    generalise)
      # No identity, no host keys, no first-boot state from the installer or the provisioning boot.
      say "generalising the image"
      : > "$T/etc/machine-id"
      rm -rf "$T$BUILD"
      rm -f "$T/var/lib/dbus/machine-id" "$T"/etc/ssh/ssh_host_* "$T/var/lib/systemd/random-seed"
      # The node's own first boot must run cloud-init from its datasource (the node pool's release), not the
      # installer's: drop what the installer configured (its clean.d hook does this on newer cloud-init).
      if [ -x "$T/usr/bin/cloud-init" ]; then
        intarget cloud-init clean --logs >/dev/null 2>&1 || true
      fi
      rm -f "$T/etc/cloud/cloud.cfg.d/99-installer.cfg" "$T/etc/cloud/cloud.cfg.d/90-installer-network.cfg" \
        "$T/etc/cloud/ds-identify.cfg" "$T/etc/cloud/cloud-init.disabled"
      ;;
    trim)
      fstrim "${T:-/}" >/dev/null 2>&1 || true
      ;;
    epoch)
      SOURCE_DATE_EPOCH=$a
      export SOURCE_DATE_EPOCH
      say "SOURCE_DATE_EPOCH=$a"
      ;;
    identify)
      [ -z "$T" ] || { say "identify: only the staging plan (the provisioning boot) sets the image's identifiers"; exit 1; }
      target_devices
      old_root=$(probe UUID "$root_dev")
      old_esp=$(probe UUID "$esp_dev")
      old_disk=$(probe PTUUID "$disk")
      old_rpart=$(probe PART_ENTRY_UUID "$root_dev")
      old_epart=$(probe PART_ENTRY_UUID "$esp_dev")
      for id in "$old_root" "$old_esp" "$old_disk" "$old_rpart" "$old_epart"; do
        case "$id" in ""|*[!0-9A-Fa-f-]*) say "identify: an identifier of the installer's disk is unreadable ($id)"; exit 1 ;; esac
      done
      mkdir -p "$SEAL/esp"
      mount -t vfat "$esp_dev" "$SEAL/esp" || { say "identify: cannot mount the ESP $esp_dev"; exit 1; }
      say "identify: root file system $old_root -> $a, ESP $old_esp -> $b, disk $old_disk -> $c"
      # every text file of /etc, /boot and the ESP that names an old identifier gets the new one
      grep -rlIiZF -e "$old_root" -e "$old_esp" -e "$old_disk" -e "$old_rpart" -e "$old_epart" \
          /etc /boot "$SEAL/esp" 2>/dev/null \
        | xargs -0 -r sed -i -e "s/$old_root/$a/gI" -e "s/$old_esp/$b/gI" -e "s/$old_disk/$c/gI" \
          -e "s/$old_rpart/$d/gI" -e "s/$old_epart/$e/gI"
      umount "$SEAL/esp"
      SEAL_ROOT=$a
      SEAL_ESP=$esp_dev
      ;;
    remove)
      # shellcheck disable=SC2086  # a is a pattern: expanded here, inside the target
      for path in $T$a; do
        if [ -e "$path" ] || [ -L "$path" ]; then rm -rf -- "$path"; fi
      done
      ;;
    empty)
      [ ! -d "$T$a" ] || find "$T$a" -xdev ! -type d -delete
      ;;
    shadow)
      day=$((a / 86400))
      for f in "$T/etc/shadow" "$T/etc/shadow-"; do
        [ -f "$f" ] || continue
        awk -F: -v OFS=: -v day="$day" '$3 ~ /^[0-9]+$/ && $3 > 0 { $3 = day } { print }' "$f" > "$f.nodetrust"
        cat "$f.nodetrust" > "$f"
        rm -f "$f.nodetrust"
      done
      ;;
    bolt)
      if [ -d "$T$a" ]; then
        say "bolt: canonical databases under $a"
        mkdir -p "$SEAL"
        if ! find "$T$a" -xdev -type f -name '*.db' \
            -exec python3 "$M/boltcanon.py" "${SOURCE_DATE_EPOCH:?the epoch entry comes first}" {} + > "$SEAL/bolt.log" 2>&1; then
          say "bolt: $(tail -n 5 "$SEAL/bolt.log")"
          exit 1
        fi
        while IFS= read -r line; do say "bolt: $line"; done < "$SEAL/bolt.log"
      fi
      ;;
    *)
      say "unknown plan entry: $kind"
      exit 1
      ;;
  esac
done
exec 3<&-

cleanup
trap - EXIT
data "NODETRUST-STAGE-DONE"
say "done"
