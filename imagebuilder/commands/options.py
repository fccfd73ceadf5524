"""The options several ``imagebuilder`` commands share, as one settings table.

Each command adds the rows it uses with ``TABLE.add_arguments(parser, names, typed=True)``:
argparse then parses each value with its kind and the defaults are these (None where the
command computes one at run time, as ``default_text`` says). docs/settings.md lists them with
the commands that take each; command-specific options stay in their command's module.
"""

from __future__ import annotations

from collections.abc import Mapping

from protocol.settings import Setting, Table, boolean, choice, path, text

TABLE = Table(
    "imagebuilder",
    (
        Setting(
            "lock",
            path(),
            "the definition's lock file",
            default_text="<definition>.lock.json, next to the definition",
        ),
        Setting(
            "cache_dir",
            path(),
            "download cache; also keeps the KVM probe's verdict",
            env="IMAGEBUILDER_CACHE",
            default_text="$IMAGEBUILDER_CACHE, else $XDG_CACHE_HOME/nodetrust-imagebuilder "
            "(~/.cache/nodetrust-imagebuilder)",
        ),
        Setting(
            "work_dir",
            path(),
            "where the temporary work folder goes: it needs room for the disk, and QEMU's user must reach it",
            default_text="$TMPDIR, else /var/tmp",
        ),
        Setting("libvirt_uri", text(metavar="URI"), "libvirt connection", "qemu:///system"),
        Setting(
            "accel",
            choice("auto", "kvm", "tcg"),
            "accelerator: auto is KVM when a probe boot works on this host (the verdict is cached per host "
            "boot), else TCG",
            "auto",
        ),
        Setting(
            "keep_work", boolean(), "keep the work folder (console log, seed, disks) for debugging", False
        ),
    ),
)

# The shared options each command takes (the rest of its options are its own).
COMMAND_OPTIONS: Mapping[str, tuple[str, ...]] = {
    "lock": ("lock", "cache_dir"),
    "build": ("lock", "cache_dir", "work_dir", "libvirt_uri", "accel", "keep_work"),
    "test": ("cache_dir", "work_dir", "libvirt_uri", "accel", "keep_work"),
    "rebuild": ("lock", "cache_dir", "work_dir", "libvirt_uri", "accel", "keep_work"),
}


def used_by() -> dict[str, list[str]]:
    """``{setting name: [commands]}`` for the reference."""
    out: dict[str, list[str]] = {}
    for command, names in COMMAND_OPTIONS.items():
        for name in names:
            out.setdefault(name, []).append(f"`imagebuilder {command}`")
    return out
