"""The node-pool configuration for the first boot: a NoCloud seed partition at the end of the disk.

A release carries the cloud-init of each role (worker, first control plane, joining control
plane), signed with the rest. The imager writes the one its role names, byte for byte, into a
small FAT file system labelled ``CIDATA`` in a partition after the image's own (as Ironic writes
its config drive), so cloud-init's NoCloud data source finds it at first boot. The image's own
partitions are not touched: what the firmware and GRUB measure is what the build signed.

``meta-data`` holds the instance id (release and disk identity) and, when the boot parameters
give ``nodeagent.node_name=``, the host name. Other ``nodeagent.<key>=`` parameters of the imager's
kernel command line (per-machine settings an iPXE server adds) go into a second cloud-config part
of a MIME multipart ``user-data`` that writes ``/etc/nodeagent/config.d/50-netboot.yaml``; its
``merge_how`` appends to the release's ``write_files`` instead of replacing them.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path

import yaml

from imager import blockdev
from imager.errors import ImagerError, Reason
from imager.gpt import SECTOR, Entry, Gpt, read_gpt
from imager.run import run

SEED_BYTES = 16 << 20
SEED_LABEL = "CIDATA"
BASIC_DATA = "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7"
ALIGN_SECTORS = 2048
DROP_IN = "/etc/nodeagent/config.d/50-netboot.yaml"
MERGE_HOW = [
    {"name": "list", "settings": ["append"]},
    {"name": "dict", "settings": ["no_replace", "recurse_list"]},
]


def meta_data(*, release: str, disk_id: str, hostname: str = "") -> bytes:
    instance = "nodetrust-" + hashlib.sha256(f"{release}\0{disk_id}".encode()).hexdigest()[:16]
    doc: dict[str, str] = {"instance-id": instance}
    if hostname:
        doc["local-hostname"] = hostname
    return yaml.safe_dump(doc, sort_keys=True).encode("utf-8")


def user_data(signed: bytes, agent_settings: Mapping[str, str]) -> bytes:
    """The release's user-data unchanged, or a multipart of it and the per-machine agent drop-in."""
    if not agent_settings:
        return signed
    drop_in = yaml.safe_dump(dict(sorted(agent_settings.items())), sort_keys=True)
    extra = "#cloud-config\n" + yaml.safe_dump(
        {
            "merge_how": MERGE_HOW,
            "write_files": [
                {"path": DROP_IN, "permissions": "0644", "owner": "root:root", "content": drop_in}
            ],
        },
        sort_keys=False,
    )
    message = MIMEMultipart(boundary="nodetrust-netboot-seed")
    for part, name in ((signed.decode("utf-8"), "release.cfg"), (extra, "netboot.cfg")):
        text = MIMEText(part, "cloud-config", "utf-8")
        text.add_header("Content-Disposition", "attachment", filename=name)
        message.attach(text)
    return message.as_bytes()


def _fat_image(files: Mapping[str, bytes], work: Path, volume_id: str) -> bytes:
    image = work / "seed.fat"
    run(["mkfs.vfat", "-C", "-n", SEED_LABEL, "-i", volume_id, str(image), str(SEED_BYTES // 1024)],
        reason=Reason.write_failed, timeout=120)  # fmt: skip
    for name, data in sorted(files.items()):
        source = work / name
        source.write_bytes(data)
        run(
            ["mcopy", "-o", "-i", str(image), str(source), f"::{name}"],
            reason=Reason.write_failed,
            timeout=120,
        )
    return image.read_bytes()


def write_seed(path: Path, table: Gpt, files: Mapping[str, bytes], *, volume_id: str = "4e544e31") -> Entry:
    """Add the ``CIDATA`` partition after the image's partitions and fill it; returns its entry."""
    last_used = max((e.last_lba for e in table.entries), default=table.primary.first_usable)
    sectors = SEED_BYTES // SECTOR
    start = (table.primary.last_usable + 1 - sectors) // ALIGN_SECTORS * ALIGN_SECTORS
    if start <= last_used:
        raise ImagerError(
            Reason.gpt,
            f"{path}: no room for the {SEED_BYTES >> 20} MiB cloud-init seed after the image's partitions",
            hint="choose a disk at least 16 MiB larger than the image's virtual disk",
        )
    with tempfile.TemporaryDirectory(prefix="nodeimager-seed-") as work:
        fat = _fat_image(files, Path(work), volume_id)
    blockdev.write_at(path, fat, start * SECTOR)
    run(["sfdisk", "--append", "--no-reread", "--no-tell-kernel", str(path)],
        input_bytes=f"start={start}, size={sectors}, type={BASIC_DATA}, name=cidata\n".encode(),
        reason=Reason.gpt, timeout=120)  # fmt: skip
    after = read_gpt(path)
    added = [e for e in after.entries if e.first_lba == start]
    if len(added) != 1 or after.problems:
        raise ImagerError(
            Reason.gpt, f"{path}: the seed partition did not come out right: {'; '.join(after.problems)}"
        )
    return added[0]
