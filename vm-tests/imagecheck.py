"""Looking inside a built image: offline (its root file system read with debugfs) and by booting it.

:class:`ImageFiles` converts the QCOW2 to a sparse raw file, finds the root partition in
its GPT and reads files with ``debugfs`` (no loop devices, no mounts). :func:`boot_image`
boots a copy-on-write overlay of the image under libvirt (UEFI, an emulated TPM, user-mode
networking with ``restrict=on``: DHCP and no route anywhere) with a NoCloud seed whose
first-boot script reports on the serial console and powers the VM off: a node pool's
release would deliver its cloud-init the same way.

The script runs as a ``bootcmd`` (cloud-init's init stage), not a ``runcmd``: the image
enables ``systemd-time-wait-sync`` and the agent's oneshot unit is ordered after
``time-sync.target``, so without a reachable NTP server ``multi-user.target`` (and with it
cloud-init's final stage) is never reached.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(argv), capture_output=True, check=check)


class ImageFiles:
    def __init__(self, qcow2: Path, workdir: Path) -> None:
        self.raw = workdir / "image.raw"
        run("qemu-img", "convert", "-O", "raw", str(qcow2), str(self.raw))
        table = json.loads(run("sfdisk", "-J", str(self.raw)).stdout)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        root = max(table["partitions"], key=lambda p: int(p["size"]))
        self.offset, self.size = int(root["start"]) * sector, int(root["size"]) * sector
        self.device = f"{self.raw}?offset={self.offset}"

    def _debugfs(self, request: str) -> tuple[str, str]:
        result = run("debugfs", "-R", request, self.device, check=False)
        return result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")

    def read(self, path: str) -> bytes | None:
        if not self.exists(path):
            return None
        return run("debugfs", "-R", f"cat {path}", self.device).stdout

    def text(self, path: str) -> str:
        data = self.read(path)
        assert data is not None, f"{path} is not in the image"
        return data.decode()

    def exists(self, path: str) -> bool:
        _out, err = self._debugfs(f"stat {path}")
        return "File not found" not in err

    def listdir(self, path: str) -> list[str]:
        out, err = self._debugfs(f"ls -p {path}")
        assert "File not found" not in err, f"{path} is not in the image"
        names = []
        for line in out.splitlines():
            fields = line.strip().strip("/").split("/")
            if len(fields) >= 5 and fields[4] not in (".", ".."):
                names.append(fields[4])
        return sorted(names)

    def symlink_target(self, path: str) -> str:
        out, _err = self._debugfs(f"stat {path}")
        match = re.search(r'Fast link dest: "([^"]*)"', out)
        return match.group(1) if match else ""

    def _writable(self) -> Path:
        """The root partition as a file of its own, its journal replayed (the image's last boot powered off
        with ``needs_recovery`` set: without the replay the guest's kernel would undo what debugfs wrote)."""
        part = self.raw.with_name("root.ext4")
        if not part.exists():
            run("dd", f"if={self.raw}", f"of={part}", "bs=4M", "iflag=skip_bytes,count_bytes",
                f"skip={self.offset}", f"count={self.size}", "conv=sparse", "status=none")  # fmt: skip
            fsck = run("e2fsck", "-fy", str(part), check=False)
            assert fsck.returncode in (0, 1), (
                f"e2fsck {fsck.returncode}: {fsck.stdout.decode(errors='replace')}"
            )
        return part

    def replace(self, path: str, data: bytes) -> None:
        """Write ``path`` (debugfs -w on the unmounted file system): the image as a build that forgot to
        generalise would have shipped it. :meth:`save_qcow2` makes the changed image."""
        part = self._writable()
        source = self.raw.with_name("replace.tmp")
        source.write_bytes(data)
        requests = self.raw.with_name("replace.debugfs")
        requests.write_text(f"rm {path}\nwrite {source} {path}\n")
        run("debugfs", "-w", "-f", str(requests), str(part), check=False)  # rm fails when there is none
        source.unlink()
        written = run("debugfs", "-R", f"cat {path}", str(part)).stdout
        assert written == data, f"debugfs could not write {path}"

    def save_qcow2(self, dest: Path) -> Path:
        """The image with what :meth:`replace` wrote, as a QCOW2 at ``dest``."""
        part = self._writable()
        run("dd", f"if={part}", f"of={self.raw}", "bs=4M", "oflag=seek_bytes", f"seek={self.offset}",
            "conv=notrunc", "status=none")  # fmt: skip
        part.unlink()
        run("qemu-img", "convert", "-O", "qcow2", str(self.raw), str(dest))
        return dest

    def close(self) -> None:
        self.raw.unlink(missing_ok=True)
        self.raw.with_name("root.ext4").unlink(missing_ok=True)


def dpkg_status(text: str) -> dict[str, dict[str, str]]:
    """Installed packages of /var/lib/dpkg/status: name:arch -> fields."""
    packages: dict[str, dict[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Status", "").endswith(" installed"):
            packages[f"{fields['Package']}:{fields['Architecture']}"] = fields
    return packages


BOOT_CHECK = textwrap.dedent(
    """\
    #!/bin/sh
    # First boot of the built image: report what the node has, then power off.
    exec > /dev/ttyS0 2>&1
    echo NODETRUST-BOOT-BEGIN
    echo "kubeadm=$(kubeadm version)"
    echo "kubelet=$(kubelet)"
    echo "held=$(apt-mark showhold | tr '\\n' ' ')"
    echo "nodeagent-enabled=$(systemctl is-enabled nodeagent.service)"
    echo "machine-id-length=$(tr -d '\\n' < /etc/machine-id | wc -c)"
    echo "spire-agent=$(/opt/spire/1.14.1/bin/spire-agent)"
    echo "staged=$(ls /opt/nodetrust/staged/kubernetes | tr '\\n' ' ')"
    /opt/nodeagent/venv/bin/python - <<'PY'
    import hashlib
    import tpm2_pytss
    from agent.tpm.attestor import TpmAttestor
    with TpmAttestor() as tpm:
        ek = tpm.read_ek()
        data = tpm.attestation_data()
    print("tpm-agent-id=" + hashlib.sha256(ek.spki_der).hexdigest())
    print("tpm-attestation-data=ok")
    PY
    echo "agent-python-exit=$?"
    echo NODETRUST-BOOT-END
    systemctl poweroff
    """
)


def _seed(workdir: Path) -> Path:
    user_data = "#cloud-config\n" + json.dumps(
        {
            "bootcmd": [["sh", "-c", BOOT_CHECK]],
        }
    )
    tree = workdir / "seed"
    tree.mkdir()
    (tree / "user-data").write_text(user_data)
    (tree / "meta-data").write_text(f"instance-id: boot-{uuid.uuid4().hex[:8]}\nlocal-hostname: node0\n")
    seed = workdir / "boot-seed.iso"
    run("xorriso", "-as", "mkisofs", "-quiet", "-output", str(seed), "-volid", "CIDATA", "-joliet", "-rock",
        str(tree))  # fmt: skip
    return seed


def boot_domain_xml(name: str, overlay: Path, seed: Path, console: Path, nvram: Path) -> str:
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  <memory unit='MiB'>2048</memory>
  <vcpu>2</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <loader readonly='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE_4M.fd</loader>
    <nvram template='/usr/share/OVMF/OVMF_VARS_4M.fd'>{nvram}</nvram>
  </os>
  <features><acpi/><apic/></features>
  <cpu mode='maximum' check='none'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' cache='unsafe'/>
      <source file='{overlay}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='file' device='cdrom'>
      <driver name='qemu' type='raw'/>
      <source file='{seed}'/>
      <target dev='sda' bus='sata'/>
      <readonly/>
    </disk>
    <serial type='file'><source path='{console}'/><target port='0'/></serial>
    <tpm model='tpm-crb'><backend type='emulator' version='2.0'/></tpm>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-netdev'/>
    <qemu:arg value='user,id=n0,restrict=on'/>
    <qemu:arg value='-device'/>
    <qemu:arg value='virtio-net-pci,netdev=n0,bus=pcie.0,addr=0x0f'/>
  </qemu:commandline>
</domain>
"""


def boot_image(image: Path, workdir: Path, *, timeout: float = 1200) -> str:
    """Boot an overlay of ``image`` until its first-boot check powers it off; return the console text."""
    import libvirt

    base = (
        workdir / "image.qcow2"
    )  # a copy QEMU (user libvirt-qemu) can reach; the published one stays untouched
    run("cp", "--reflink=auto", str(image), str(base))
    overlay = workdir / "overlay.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(overlay))
    seed = _seed(workdir)
    console = workdir / "boot-console.log"
    name = f"imagebuilder-boottest-{uuid.uuid4().hex[:8]}"
    workdir.chmod(0o755)
    conn = libvirt.open("qemu:///system")
    dom = conn.defineXML(boot_domain_xml(name, overlay, seed, console, workdir / "nvram.fd"))
    try:
        dom.create()
        deadline = time.monotonic() + timeout
        while dom.isActive():
            if time.monotonic() > deadline:
                text = console.read_text(errors="replace") if console.exists() else ""
                raise AssertionError(
                    f"the built image did not finish its first boot in {timeout:.0f} s:\n{text[-4000:]}"
                )
            time.sleep(2)
    finally:
        if dom.isActive():
            dom.destroy()
        dom.undefineFlags(
            getattr(libvirt, "VIR_DOMAIN_UNDEFINE_NVRAM", 0) | getattr(libvirt, "VIR_DOMAIN_UNDEFINE_TPM", 0)
        )
        conn.close()
    return console.read_text(errors="replace")


def boot_report(console: str) -> dict[str, str]:
    start, end = console.find("NODETRUST-BOOT-BEGIN"), console.find("NODETRUST-BOOT-END")
    assert start >= 0 and end > start, f"no first-boot report on the console:\n{console[-4000:]}"
    report = {}
    for line in console[start:end].splitlines()[1:]:
        key, sep, value = line.strip().partition("=")
        if sep:
            report[key] = value
    return report


def scratch() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="imagecheck-", dir="/var/tmp")
