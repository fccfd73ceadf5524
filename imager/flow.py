"""One imaging run, step by step; on any failure after the disk is chosen the disk is wiped and no
boot entry is left pointing at it.

========  ==========================================================================  ============
step      what                                                                        event
========  ==========================================================================  ============
release   verify the signature, then the signed manifest and the pins                 ``verified``
disk      choose the target by hints and the release's policy                          ``disk-chosen``
prepare   remove boot entries that point at the target's partitions; wipe both ends
write     stream, verify, write, read back; the head (GPT) last                        ``written``
check     move the backup GPT to the end, check the table, the partitions unique
seed      the role's cloud-init in a CIDATA partition after the image's
boot      the UEFI boot entry for the ESP's loader, first in BootOrder                 ``boot-entry``
========  ==========================================================================  ============

Before the disk is chosen nothing is written anywhere: a refused release leaves every disk as it was.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from imager import blockdev, digest, efi, post, seed
from imager.errors import ImagerError, Reason
from imager.events import Events
from imager.gpt import read_gpt
from imager.hints import merge, parse_hints
from imager.http import Fetcher
from imager.inventory import Disk, Inventory
from imager.params import Params
from imager.progress import Progress
from imager.run import run
from imager.select import choose
from imager.source import KEYS_DIR, Source, fetch_small_artifact, open_source
from imager.write import Written, fetch_scratch, write_qcow2, write_raw
from protocol import chunklist
from protocol.errors import ReleaseFormatError
from protocol.release import Image

log = logging.getLogger(__name__)

LOADERS = {
    "amd64": "\\EFI\\BOOT\\BOOTX64.EFI",
    "arm64": "\\EFI\\BOOT\\BOOTAA64.EFI",
    "": "\\EFI\\BOOT\\BOOTX64.EFI",
}
SCRATCH = Path("/run/nodeimager")
BIOS_BOOT_TYPE = uuid.UUID("21686148-6449-6e6f-744e-656564454649")


@dataclass
class Result:
    release: str = ""
    disk: Disk | None = None
    image: Image | None = None
    written: Written | None = None
    boot_entry: int | None = None
    boot_order: list[int] = field(default_factory=list)
    seed_partition: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "release": self.release,
            "disk": self.disk.identity() if self.disk else None,
            "image": {"name": self.image.name, "sha256": self.image.sha256, "format": self.image.format}
            if self.image
            else None,
            "boot_entry": f"Boot{self.boot_entry:04X}" if self.boot_entry is not None else None,
            "boot_order": [f"{n:04X}" for n in self.boot_order],
            "seed_partition": self.seed_partition,
            "seconds": {"write": self.written.seconds, "readback": self.written.readback_seconds}
            if self.written
            else None,
            "digest": self.written.digest if self.written else None,
        }


@dataclass
class Imaging:
    params: Params
    inventory: Inventory
    firmware: efi.Firmware
    fetcher: Fetcher
    events: Events
    keys_dir: Path | None = KEYS_DIR
    scratch_dir: Path = SCRATCH
    console: Callable[[str, int], Progress] | None = None
    result: Result = field(default_factory=Result)

    def run(self) -> Result:
        self.events.url = self.params.events
        self.events.emit("started", params={"release": self.params.release, "format": self.params.format,
                                            "role": self.params.role, "hints": self.params.hints})  # fmt: skip
        try:
            if self.params.firmware == "uefi":
                self.firmware.boot_order()  # no efivarfs: refuse now, before anything is fetched or written
            source = open_source(self.fetcher, self.params.release, keys_dir=self.keys_dir,
                                 key_pin=self.params.key, image_pin=self.params.image)  # fmt: skip
            view = source.view
            self.result.release = view.name
            self.events.release = view.name
            self.events.url = view.events_url or self.params.events
            image = (
                view.image(self.params.format)
                if self.params.format in {i.format for i in view.images}
                else None
            )
            if image is None:
                raise ImagerError(
                    Reason.usage,
                    f"the release has no {self.params.format} image (it has "
                    f"{', '.join(i.format for i in view.images)})",
                    hint="boot with nodeimager.format= one the release has",
                )
            self.result.image = image
            self.events.emit("verified", kind=source.statement.kind, build_id=view.build_id, signer=source.statement.key_id,
                             image={"name": image.name, "sha256": image.sha256, "size": image.size})  # fmt: skip
            hints = parse_hints(merge(view.hints, self.params.hints))
            min_size = image.virtual_size or image.size
            disk, _verdicts = choose(
                self.inventory.disks(), hints, policy=view.no_hint_policy, min_size=min_size
            )
        except ImagerError as exc:
            self._failed(exc, None)
            raise
        self.result.disk = disk
        self.events.emit("disk-chosen", disk=disk.identity(), hints=hints.values)
        try:
            self._image(source, image, disk)
        except BaseException as exc:
            self._undo(disk, image)
            error = (
                exc
                if isinstance(exc, ImagerError)
                else ImagerError(Reason.internal, f"{type(exc).__name__}: {exc}")
            )
            self._failed(error, disk)
            raise
        self.events.emit("done", disk=disk.identity(), boot_entry=self.result.boot_entry)
        return self.result

    def _failed(self, exc: ImagerError, disk: Disk | None) -> None:
        self.events.emit("failed", reason=str(exc.reason), message=exc.message, hint=exc.hint,
                         exit_code=exc.exit_code, disk=disk.identity() if disk else None,
                         wiped=disk is not None, **exc.details)  # fmt: skip

    def _undo(self, disk: Disk, image: Image) -> None:
        """Unbootable again: no boot entry of ours, no partition table at either end."""
        try:
            if self.result.boot_entry is not None:
                self.firmware.delete(self.result.boot_entry)
                self.result.boot_entry = None
        except ImagerError as exc:
            log.error("could not remove the boot entry: %s", exc.message)
        blockdev.wipe(disk.devnode, image_end=image.virtual_size or image.size)

    def _old_partitions(self, disk: Disk) -> set[uuid.UUID]:
        guids = set()
        for part in disk.partitions:
            with contextlib.suppress(ValueError):
                guids.add(uuid.UUID(part.part_uuid))
        with contextlib.suppress(ImagerError):
            guids |= {entry.part_guid for entry in read_gpt(disk.devnode).entries}
        return guids

    def _chunks(self, source: Source, image: Image) -> tuple[bytes, ...] | None:
        """The image's signed per-chunk digests, fetched and checked; None when the release has none."""
        if image.chunks is None:
            return None
        data = fetch_small_artifact(self.fetcher, source, image.chunks)
        try:
            return chunklist.parse(
                data, size=image.size, chunk_size=image.chunks.chunk_size, name=image.chunks.name
            )
        except ReleaseFormatError as exc:
            raise ImagerError(
                Reason.release_format, str(exc), hint="republish the release folder as imagebuilder wrote it"
            ) from None

    def _image(self, source: Source, image: Image, disk: Disk) -> None:
        efi.remove_entries_for(self.firmware, self._old_partitions(disk))
        blockdev.wipe(disk.devnode)
        url = source.url_of(image.name)
        check = digest.choose(self.params.digest, image)
        if image.format == "raw":
            chunks = self._chunks(source, image) if check.algorithm == "sha256" else None
            written = write_raw(
                self.fetcher, url, image, disk.devnode, console=self.console, chunks=chunks, check=check
            )
        else:
            self.scratch_dir.mkdir(parents=True, exist_ok=True)
            scratch = self.scratch_dir / f"{image.name}.{time.monotonic_ns()}"
            try:
                fetch_scratch(self.fetcher, url, image, scratch, console=self.console, check=check)
                written = replace(
                    write_qcow2(scratch, image, disk.devnode, console=self.console), digest=check.algorithm
                )
            finally:
                scratch.unlink(missing_ok=True)
        self.result.written = written
        self.events.emit("written", disk=disk.identity(), sha256=written.sha256, digest=written.digest,
                         bytes=written.disk_bytes,
                         seconds=round(written.seconds, 3), readback_seconds=round(written.readback_seconds, 3))  # fmt: skip
        post.relocate_backup(disk.devnode)
        table, esp, root = post.check_table(disk.devnode)
        efi.remove_entries_for(self.firmware, {esp.part_guid, root.part_guid})
        wanted = post.identities(disk.devnode, [(esp, "EFI system partition"), (root, "root partition")])
        role = source.view.cloud_init.get(self.params.role)
        if role is not None:
            files = {
                "user-data": seed.user_data(
                    fetch_small_artifact(self.fetcher, source, role), self.params.agent
                ),
                "meta-data": seed.meta_data(
                    release=source.view.name,
                    disk_id=disk.serial or disk.wwn or disk.name,
                    hostname=self.params.agent.get("node_name", ""),
                ),
            }
            added = seed.write_seed(disk.devnode, table, files)
            self.result.seed_partition = added.number
            wanted.append(post.Ident("LABEL", seed.SEED_LABEL, "cloud-init seed"))
        elif self.params.agent:
            log.warning(
                "nodeagent.* parameters given, but the release carries no %s cloud-init to seed",
                self.params.role,
            )
        post.check_unique(disk, wanted, self.inventory.disks())
        if self.params.firmware == "bios":
            if not any(e.type_guid == BIOS_BOOT_TYPE for e in table.entries):
                raise ImagerError(
                    Reason.boot_entry,
                    "the server booted in legacy BIOS mode, and the image has no BIOS boot partition (it is UEFI-only)",
                    hint="switch the server's firmware to UEFI boot (docs/bare-metal.md, 'Legacy BIOS')",
                )
            self.events.emit(
                "boot-entry", firmware="bios", note="no UEFI entry: the BIOS boot order must list the disk"
            )
            return
        loader = LOADERS.get(source.view.architecture, LOADERS[""])
        found = run(["mdir", "-b", "-i", f"{disk.devnode}@@{esp.offset}", "::" + loader.replace("\\", "/")],
                    reason=Reason.boot_entry, check=False, timeout=60)  # fmt: skip
        if found.returncode != 0:
            raise ImagerError(
                Reason.boot_entry,
                f"the image's EFI system partition has no {loader}",
                hint="rebuild the image with the removable-media loader installed (grub-install --removable)",
            )
        number = self.firmware.create(disk.devnode, esp.number, loader, f"nodetrust {source.view.name}")
        self.result.boot_entry = number
        self.result.boot_order = efi.set_first(self.firmware, number)
        self.events.emit("boot-entry", number=f"Boot{number:04X}", loader=loader, partition=str(esp.part_guid),
                         order=[f"{n:04X}" for n in self.result.boot_order])  # fmt: skip
