"""cloud-init/stage.sh itself, run here on a folder standing for the target, with the seal's plan entries
(imagebuilder/seal.py ``plan_lines``: ``epoch``, the scrub list, ``bolt``, ``shadow``) that need no device.

The script bind-mounts its medium into the target, so it runs as root in a mount namespace of its own
(``unshare --mount``): nothing it mounts is seen outside, and it ends with the namespace.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from imagebuilder import reproducible, seal
from imagebuilder.run import run

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]
LOCK = "ab" * 32
CREATED = "2026-03-04T05:06:07Z"
DAY = reproducible.source_date_epoch(CREATED) // 86400


def _stage(tmp_path: Path, shadow: str) -> Path:
    assert os.geteuid() == 0, "stage.sh bind-mounts its medium: this test runs as root (make test does)"
    assert shutil.which("unshare"), "unshare (util-linux) is missing: apt-get install util-linux"
    target, medium = tmp_path / "target", tmp_path / "medium"
    for folder in ("etc", "var/log/apt", "var/log/installer", "var/cache/apt", "tmp", "root/.cache"):
        (target / folder).mkdir(parents=True)
    (target / "etc/shadow").write_text(shadow)
    (target / "etc/shadow-").write_text(shadow)
    (target / "var/log/apt/history.log").write_text("Start-Date: 2026-12-07\n")
    (target / "var/log/installer/autoinstall-user-data").write_text("token\n")
    (target / "var/cache/apt/pkgcache.bin").write_bytes(b"cache")
    (target / "tmp/scratch").write_text("x")
    medium.mkdir()
    lines = seal.plan_lines(reproducible.identity(LOCK, CREATED))
    (medium / "plan.tsv").write_text("".join(f"{line}\n" for line in [*lines.first, *lines.last]))
    run(["unshare", "--mount", "--propagation", "private", "sh", str(REPO / "cloud-init/stage.sh"),
         str(target), str(medium), "/dev/null"], timeout=60)  # fmt: skip
    return target


def test_every_password_age_becomes_the_locks_day_whatever_day_the_base_was_installed(
    tmp_path: Path,
) -> None:
    """A base cached by a build days before the lock, and a cold rebuild installed after it, wrote different
    days: both become the lock's, so the two images hold the same /etc/shadow (vm-tests/test_reproducible.py
    caught the clamp that only lowered later days)."""
    earlier, later = DAY - 3, DAY + 2
    shadow = (
        f"root:*:{earlier}:0:99999:7:::\n"
        f"node:!:{later}:0:99999:7:::\n"
        f"forced:$6$salt$hash:0:0:99999:7:::\n"  # 0: must change at next login, kept
        "noage:*::0:99999:7:::\n"  # empty: no aging, kept
        f"same:*:{DAY}:0:99999:7:::\n"
    )
    target = _stage(tmp_path, shadow)
    want = (
        f"root:*:{DAY}:0:99999:7:::\n"
        f"node:!:{DAY}:0:99999:7:::\n"
        "forced:$6$salt$hash:0:0:99999:7:::\n"
        "noage:*::0:99999:7:::\n"
        f"same:*:{DAY}:0:99999:7:::\n"
    )
    assert (target / "etc/shadow").read_text() == want
    assert (target / "etc/shadow-").read_text() == want
    # the base installed on another day gives the same file
    other = _stage(tmp_path / "other", shadow.replace(str(earlier), str(DAY - 40)))
    assert (other / "etc/shadow").read_bytes() == (target / "etc/shadow").read_bytes()


def test_the_scrub_list_removes_build_records_and_empties_logs(tmp_path: Path) -> None:
    target = _stage(tmp_path, f"root:*:{DAY}:0:99999:7:::\n")
    assert not (target / "var/log/installer").exists()  # the installer's logs hold the webhook token
    assert (target / "var/log/apt").is_dir() and not list((target / "var/log/apt").iterdir())
    assert not (target / "var/cache/apt/pkgcache.bin").exists()
    assert not (target / "root/.cache").exists()
    assert (target / "tmp").is_dir() and not list((target / "tmp").iterdir())
    assert not (target / "var/lib/nodetrust-staging").exists()  # the medium's mount point is gone
