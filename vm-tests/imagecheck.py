"""Looking inside a built image offline: its root file system read with debugfs.

:class:`ImageFiles` converts the QCOW2 to a sparse raw file, finds the root partition in
its GPT and reads files with ``debugfs`` (no loop devices, no mounts). Booting an image is
the builder's own boot test (:mod:`imagebuilder.boottest`), which every build runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
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


def scratch() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="imagecheck-", dir="/var/tmp")
