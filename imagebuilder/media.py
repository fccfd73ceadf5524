"""ISO media: read files out of the installer ISO, write the NoCloud seed and the staging medium.

All through ``xorriso`` (no mounts, no root): ``-osirrox on -extract`` reads,
``-as mkisofs`` writes ISO 9660 with Rock Ridge (names, modes) and Joliet.

* the seed is labelled ``CIDATA`` and holds ``user-data`` and ``meta-data`` (NoCloud);
* the staging medium is labelled ``NTSTAGE`` and holds what late-commands install:
  ``apt/`` (a flat apt repository), ``files/``, ``wheels/``, ``plan.tsv`` and ``stage.sh``.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from imagebuilder.errors import BuildError, CommandError
from imagebuilder.run import run

SEED_LABEL = "CIDATA"
STAGING_LABEL = "NTSTAGE"


def check_member(member: str) -> str:
    """``member`` as an ISO path (``/casper/vmlinuz``): relative to the ISO's root, no ``.`` or ``..``
    components, no control characters; else :class:`BuildError`."""
    parts = member.split("/")
    if (
        not member
        or member.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in member)
    ):
        raise BuildError(
            f"{member!r} is not a plain path inside an ISO",
            hint="name ISO members relative to the ISO's root, without . or .. (e.g. casper/vmlinuz)",
        )
    return "/" + member


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a regular file"


def extract(iso: Path, members: Mapping[str, Path]) -> None:
    """Copy ``members`` (paths inside the ISO) to the given local paths, each a new regular file, mode 0644.

    xorriso restores members as they are: a symbolic link as a link (to any host path), a FIFO as a FIFO.
    So it extracts into a private folder first, and only a member that came out as a regular file is
    moved to its destination; a link, a device, a FIFO or a folder is refused by name, and nothing the
    ISO names outside itself is ever read, written or chmod-ed.
    """
    names = {member: check_member(member) for member in members}
    if not members:
        return
    first = next(iter(members.values()))
    first.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".imagebuilder-iso-", dir=first.parent) as tmp:
        private = Path(tmp)
        argv = ["xorriso", "-osirrox", "on", "-indev", str(iso)]
        for index, member in enumerate(members):
            argv += ["-extract", names[member], str(private / f"member-{index}")]
        try:
            run(argv)
        except CommandError as exc:
            raise BuildError(
                f"cannot read {', '.join(members)} from {iso}",
                hint="is it the installer ISO the definition expects (installer.kernel / initrd / base_manifests)?"
                f"\n{exc.output}",
            ) from exc
        for index, (member, dest) in enumerate(members.items()):
            _move_regular(private / f"member-{index}", dest, iso=iso, member=member)


def _move_regular(got: Path, dest: Path, *, iso: Path, member: str) -> None:
    try:
        st = os.lstat(got)
    except FileNotFoundError:
        raise BuildError(f"{iso} has no {member}", hint="check installer.kernel, installer.initrd") from None
    if not stat.S_ISREG(st.st_mode):
        what = _kind(st.st_mode)
        target = f" to {os.readlink(got)!r}" if stat.S_ISLNK(st.st_mode) else ""
        raise BuildError(
            f"{iso}: {member} is {what}{target}, not a regular file: refused",
            hint="the builder reads only regular files out of an ISO; is this the installer ISO the lock pins?",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    if st.st_nlink == 1:
        os.chmod(got, 0o644)  # a regular file in our private folder (lstat above): nothing to follow
        try:
            os.replace(got, dest)
            return
        except OSError:  # another file system: copied below
            pass
    # a hard link among the extracted members (or another file system): a copy of its own
    fd = os.open(got, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as src:
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(out, "wb") as sink:
            shutil.copyfileobj(src, sink, 1 << 20)
            os.fchmod(sink.fileno(), 0o644)
    os.replace(tmp, dest)


def read_member(iso: Path, member: str, *, limit: int = 64 << 20) -> bytes:
    """A (small) regular file of the ISO, at most ``limit`` bytes."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-iso-") as tmp:
        out = Path(tmp) / "member"
        extract(iso, {member: out})
        if out.stat().st_size > limit:
            raise BuildError(f"{iso}: {member} is larger than {limit >> 20} MiB")
        return out.read_bytes()


def make_iso(tree: Path, out: Path, *, label: str) -> Path:
    """An ISO 9660 image of ``tree`` with volume id ``label``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    run(
        [
            "xorriso",
            "-as",
            "mkisofs",
            "-quiet",
            "-output",
            str(out),
            "-volid",
            label,
            "-joliet",
            "-joliet-long",
            "-rock",
            str(tree),
        ]
    )
    return out


def make_seed(user_data: str, meta_data: str, out: Path) -> Path:
    """A NoCloud seed (``CIDATA``) holding ``user-data`` and ``meta-data``."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-seed-") as tmp:
        tree = Path(tmp)
        (tree / "user-data").write_text(user_data, encoding="utf-8")
        (tree / "meta-data").write_text(meta_data, encoding="utf-8")
        return make_iso(tree, out, label=SEED_LABEL)
