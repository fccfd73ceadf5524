"""What the imager's boot environment is made of (docs/bare-metal.md, "The boot environment")."""

from __future__ import annotations

import os
from pathlib import Path

from imagebuilder.definition import AptRepository, Target

SUITE = "bookworm"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
ARCHITECTURE = "amd64"

#: The boot environment's Python and glibc, bookworm's: the wheels are resolved for them, and the lock
#: refuses Debian packages that disagree (libc6 2.36, python3.11 3.11).
TARGET = Target(python="3.11", glibc="2.36", release=SUITE)

#: The Debian packages asked for; the lock adds their dependency closure.
PACKAGES = (
    "linux-image-amd64",  # the kernel and its modules (trimmed to MODULE_DIRS)
    "busybox-static",  # /init's shell, udhcpc, ip, mount, reboot
    "udev",  # device nodes, module autoloading, /dev/disk/by-* and the ID_* properties the imager reads
    "kmod",  # modprobe for udev
    "python3-minimal",
    "libpython3.11-stdlib",
    "python3-cryptography",  # DSSE signature verification
    "python3-yaml",  # the cloud-init seed
    "qemu-utils",  # qemu-img convert / compare (QCOW2 images only, after verification)
    "fdisk",  # sfdisk --relocate / --append
    "util-linux",  # blkid, wipefs
    "dosfstools",  # mkfs.vfat for the CIDATA seed
    "mtools",  # mcopy, mdir
    "efibootmgr",  # the UEFI boot entry
    "ca-certificates",  # HTTPS release servers
    "libgcc-s1",  # libgcc_s.so.1, which the blake3 wheel's Rust extension links against
)

#: Wheels from PyPI, each pinned to one version (``name==version``) and installed without its dependencies:
#: blake3 verifies images with BLAKE3 beside SHA-256, and Debian has no package of it. The lock pins each
#: wheel file by the SHA-256 the index gives; the build checks its tags fit :data:`TARGET`.
WHEELS = ("blake3==1.0.11",)

#: Kernel module folders kept (under lib/modules/<version>/kernel/); the rest is dropped.
MODULE_DIRS = (
    "drivers/block",
    "drivers/nvme",
    "drivers/virtio",
    "drivers/scsi",
    "drivers/cdrom",
    "drivers/ata",
    "drivers/net/ethernet/intel",
    "drivers/net/ethernet/mellanox",
    "drivers/net/ethernet/broadcom",
    "drivers/net/virtio_net.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/mdio",
    "drivers/net/phy",
    "drivers/char/tpm",
    "drivers/firmware/efi",
    "drivers/md",
    "drivers/usb",
    "fs/fat",
    "fs/nls",
    "fs/efivarfs",
    "net/core",
    "net/packet",
    "lib",
    "crypto",
)

#: Paths dropped from the tree: documentation and what only a full system uses.
DROP = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian", "boot")


def apt_source() -> AptRepository:
    mirror = os.environ.get("IMAGEBUILDER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    return AptRepository(name="debian", url=mirror, keyring=KEYRING, suite=SUITE, components=("main",))
