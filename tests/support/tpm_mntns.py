"""Run an unmodified program that looks for a kernel TPM (go-attestation: ``/sys/class/tpm/tpm*``, then
``/dev/tpmN``) against swtpm's UNIX socket, on a machine whose kernel has no TPM driver.

:func:`argv_prefix` wraps a command in a private mount namespace (``unshare --mount --propagation
private``; root, nothing outside changes) whose ``/sys/class`` is a tmpfs holding only an empty
``tpm/tpm0`` folder (no ``caps`` file: TPM 2.0; no ``device/tpmrm``: the direct device) and whose
``/dev`` is a tmpfs with the usual character devices bind-mounted back and ``/dev/tpm0`` a symlink
to the socket (go-tpm's OpenTPM opens a UNIX socket like a device, one connection per command).
This is how spire-agent with spire-tpm-plugin's ``tpm_attestor_agent`` runs here (real-peers.md 5.3).
"""

from __future__ import annotations

import shlex
from pathlib import Path

_SCRIPT = """set -euo pipefail
S={scratch}
mkdir -p "$S/olddev"
mount --bind /dev "$S/olddev"
mount -t tmpfs -o mode=755 nsdev /dev
for n in null zero random urandom full tty; do touch "/dev/$n"; mount --bind "$S/olddev/$n" "/dev/$n"; done
mkdir -p /dev/pts /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s {socket} /dev/tpm0
mount -t tmpfs -o mode=755 nssysclass /sys/class
mkdir -p /sys/class/tpm/tpm0
exec "$@"
"""


def argv_prefix(socket: Path, scratch: Path) -> list[str]:
    """``[unshare ..., bash, -c, SCRIPT, NAME]``: append the program's argv."""
    scratch.mkdir(parents=True, exist_ok=True)
    script = _SCRIPT.format(scratch=shlex.quote(str(scratch)), socket=shlex.quote(str(socket)))
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "nt-tpm-mntns"]
