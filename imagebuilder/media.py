"""ISO media: read files out of the installer ISO, write the NoCloud seed and the staging medium.

All through ``xorriso`` (no mounts, no root): ``-osirrox on -extract`` reads,
``-as mkisofs`` writes ISO 9660 with Rock Ridge (names, modes) and Joliet.

* the seed is labelled ``CIDATA`` and holds ``user-data`` and ``meta-data`` (NoCloud);
* the staging medium is labelled ``NTSTAGE`` and holds what late-commands install:
  ``apt/`` (a flat apt repository), ``files/``, ``wheels/``, ``plan.tsv`` and ``stage.sh``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

from imagebuilder.errors import BuildError, CommandError
from imagebuilder.run import run

SEED_LABEL = "CIDATA"
STAGING_LABEL = "NTSTAGE"


def extract(iso: Path, members: Mapping[str, Path]) -> None:
    """Copy ``members`` (paths inside the ISO) to the given local paths."""
    argv = ["xorriso", "-osirrox", "on", "-indev", str(iso)]
    for member, dest in members.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        argv += ["-extract", "/" + member.lstrip("/"), str(dest)]
    try:
        run(argv)
    except CommandError as exc:
        raise BuildError(
            f"cannot read {', '.join(members)} from {iso}",
            hint="is it the installer ISO the definition expects (installer.kernel / initrd / base_manifests)?"
            f"\n{exc.output}",
        ) from exc
    for member, dest in members.items():
        if not dest.is_file():
            raise BuildError(f"{iso} has no {member}", hint="check installer.kernel, installer.initrd")
        dest.chmod(0o644)


def read_member(iso: Path, member: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="imagebuilder-iso-") as tmp:
        out = Path(tmp) / "member"
        extract(iso, {member: out})
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
