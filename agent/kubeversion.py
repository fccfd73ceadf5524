"""Which Kubernetes version the node runs: the image's installed one, or a staged one, chosen by the join answer.

The image (``imagebuilder``) installs one Kubernetes version (its packages held) and stages others as
debs at fixed paths; ``/etc/nodetrust/image.json`` says which (``kubernetes.installed``,
``kubernetes.staged_paths``). The join answer names the version the pool runs. Before ``kubeadm join``
the agent makes that version the installed one:

* :func:`carried` reads what the image carries;
* :func:`predict` is the version the node will run, before it has the answer: a version an earlier
  answer selected (kept in the state), else the newest carried version of the pool's control-plane
  minor, else the installed one. The ``node.kubelet`` skew check judges this version, not the one
  installed at build time (:func:`agent.node.tools.kubelet`);
* :func:`select` turns the answer's version into a carried one, or refuses with
  :class:`~agent.errors.KubernetesVersionError` naming what the image carries: nothing is installed;
* :func:`activate` installs the staged debs of that version offline (apt from the staged folder only,
  downgrades allowed, the packages held again), after checking everything it needs first (each
  package present at that version, apt's simulation of the install): a version that cannot be
  installed is refused before any package changes. Installed already: it only checks the holds.

Every program runs through :func:`agent.proc.run`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import KubeadmError, KubernetesVersionError
from agent.files import read_bounded
from agent.proc import CommandError, run

log = logging.getLogger(__name__)

IMAGE_INFO = Path("/etc/nodetrust/image.json")
PACKAGES = ("kubeadm", "kubelet", "kubectl")
MAX_INFO_BYTES = 1024 * 1024
_VERSION = re.compile(r"\Av?(\d+)\.(\d+)\.(\d+)\Z")
_INSTALL_TIMEOUT_S = 900.0
# apt only from the files named on its command line: no source list (so nothing to download), no lists
# update. Not --no-download: with it, apt 2.6 installs no local .deb at all ("E: Internal Error, Pathname
# to install is not absolute"; --simulate still passes), which the booted image showed (vm-tests/test_demo.py).
_APT_OFFLINE = (
    "-o", "Dir::Etc::SourceList=/dev/null",
    "-o", "Dir::Etc::SourceParts=/nonexistent",
    "-o", "Acquire::Languages=none",
    "-o", "Dpkg::Options::=--force-confold",
)  # fmt: skip


def normalise(version: str) -> str:
    """``v1.35.3`` or ``1.35.3`` -> ``1.35.3``; :class:`KubernetesVersionError` for anything else."""
    match = _VERSION.match(version.strip()) if isinstance(version, str) else None
    if match is None:
        raise KubernetesVersionError(
            f"the join answer's Kubernetes version {version!r} is not MAJOR.MINOR.PATCH",
            hint="check kubernetes_version of the pool (or cluster) in nodeserver's configuration",
        )
    return ".".join(match.groups())


def _key(version: str) -> tuple[int, int, int]:
    major, minor, patch = (int(x) for x in normalise(version).split("."))
    return major, minor, patch


@dataclass(frozen=True)
class Carried:
    """The Kubernetes versions an image carries: one installed, others staged in folders of debs."""

    installed: str
    staged: dict[str, Path] = field(default_factory=dict)

    @property
    def versions(self) -> list[str]:
        return sorted({self.installed, *self.staged}, key=_key)


def carried(info: Path = IMAGE_INFO) -> Carried | None:
    """What ``info`` (the image's ``/etc/nodetrust/image.json``) says the image carries; None without it."""
    try:
        doc = json.loads(read_bounded(info, MAX_INFO_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise KubernetesVersionError(
            f"cannot read what the image carries from {info}: {exc}",
            hint="the image's build wrote this file; rebuild the image",
        ) from exc
    kube = doc.get("kubernetes") if isinstance(doc, dict) else None
    if not isinstance(kube, dict) or not isinstance(kube.get("installed"), str):
        return None
    paths = kube.get("staged_paths") or {}
    if not isinstance(paths, dict) or not all(isinstance(v, str) for v in paths.values()):
        raise KubernetesVersionError(f"{info}: kubernetes.staged_paths is not a mapping of folders")
    return Carried(
        installed=normalise(kube["installed"]),
        staged={normalise(v): Path(p) for v, p in paths.items()},
    )


def predict(image: Carried | None, *, selected: str = "", control_plane: str = "") -> str:
    """The version this node will run at its join (before the answer has said): see the module docstring."""
    if image is None:
        return selected
    if selected:
        return selected
    if control_plane:
        parts = control_plane.strip().lstrip("v").split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]):
            same_minor = [v for v in image.versions if v.split(".")[:2] == parts[:2]]
            if same_minor:
                return same_minor[-1]
    return image.installed


def select(answer: str, image: Carried | None) -> str:
    """The carried version the join answer names; refuses one the image does not carry."""
    version = normalise(answer)
    if image is None:
        raise KubernetesVersionError(
            f"the join answer asks for Kubernetes {version}, and this image says nothing of the versions it "
            f"carries ({IMAGE_INFO} has no kubernetes section)",
            hint="boot a node image built by imagebuilder, or set kubernetes_version of the pool to what the node runs",
        )
    if version not in image.versions:
        raise KubernetesVersionError(
            f"the join answer asks for Kubernetes {version}; this image carries only "
            f"{', '.join(image.versions)} (installed {image.installed}): nothing was installed",
            hint="set kubernetes_version of the pool to a version the pool's image carries, or build an image "
            f"that stages {version} (kubernetes.staged in its definition)",
        )
    return version


def installed_versions(packages: Sequence[str] = PACKAGES) -> dict[str, tuple[str, bool]]:
    """``{package: (Debian version, held)}`` of the installed packages (absent ones left out)."""
    found: dict[str, tuple[str, bool]] = {}
    for package in packages:
        result = run(["dpkg-query", "-W", "-f=${Version}\t${Status}", package], check=False, timeout=60)
        if result.returncode != 0:
            continue
        deb_version, _, status = result.stdout.partition("\t")
        if status.endswith(" installed"):
            found[package] = (deb_version, status.startswith("hold "))
    return found


def _upstream(deb_version: str) -> str:
    return deb_version.rsplit(":", 1)[-1].split("-", 1)[0]


def _staged_debs(folder: Path, version: str, packages: Sequence[str]) -> list[Path]:
    debs = sorted(folder.glob("*.deb")) if folder.is_dir() else []
    names: dict[str, str] = {}
    for deb in debs:
        fields = run(["dpkg-deb", "--field", str(deb), "Package", "Version"], timeout=60).stdout
        info = dict(line.partition(": ")[::2] for line in fields.splitlines() if ": " in line)
        names[info.get("Package", "")] = info.get("Version", "")
    wrong = [p for p in packages if _upstream(names.get(p, "")) != version]
    if wrong:
        raise KubernetesVersionError(
            f"the image's staged Kubernetes {version} in {folder} lacks {', '.join(wrong)} at {version} "
            f"(has: {', '.join(f'{k} {v}' for k, v in sorted(names.items())) or 'nothing'}): nothing was installed",
            hint="the image is damaged or was changed after its build: rebuild it",
        )
    return debs


@dataclass(frozen=True)
class Activation:
    version: str
    installed_now: bool  # False: it was the installed version already
    packages: dict[str, str]  # package -> Debian version, after


def activate(version: str, image: Carried, *, packages: Sequence[str] = PACKAGES) -> Activation:
    """Make ``version`` (a carried one) the installed and held Kubernetes version; see the module docstring."""
    before = installed_versions(packages)
    if all(_upstream(before.get(p, ("", False))[0]) == version for p in packages):
        unheld = [p for p in packages if not before[p][1]]
        if unheld:
            run(["apt-mark", "hold", *unheld], timeout=60)
        log.info("Kubernetes %s is the installed version (held)", version)
        return Activation(version, False, {p: before[p][0] for p in packages})
    folder = image.staged.get(version)
    if folder is None:
        raise KubernetesVersionError(
            f"Kubernetes {version} is neither installed nor staged in this image: nothing was installed",
            hint="rebuild the image with this version in kubernetes.staged",
        )
    debs = _staged_debs(folder, version, packages)
    apt = ["apt-get", *_APT_OFFLINE, "--allow-downgrades", "--allow-change-held-packages"]
    try:
        run([*apt, "--simulate", "install", *map(str, debs)], timeout=300)
    except CommandError as exc:
        raise KubernetesVersionError(
            f"the staged Kubernetes {version} cannot be installed offline ({exc.message}): nothing was installed",
            hint=f"`apt-get --simulate install {folder}/*.deb` says why; the image is inconsistent: rebuild it",
        ) from exc
    log.info("installing the staged Kubernetes %s from %s (offline)", version, folder)
    try:
        run([*apt, "install", "-y", "--no-install-recommends", *map(str, debs)],
            timeout=_INSTALL_TIMEOUT_S, env={"DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        run(["apt-mark", "hold", *packages], timeout=60)
    except CommandError as exc:
        raise KubeadmError(
            f"installing the staged Kubernetes {version} failed: {exc.message}",
            hint="see `journalctl -u nodeagent`; the agent tries again",
        ) from exc
    after = installed_versions(packages)
    wrong = [p for p in packages if _upstream(after.get(p, ("", False))[0]) != version or not after[p][1]]
    if wrong:
        raise KubeadmError(
            f"after installing Kubernetes {version}, {', '.join(wrong)} is not at {version} and held",
            hint="see `dpkg -l kubeadm kubelet kubectl`; the agent tries again",
        )
    log.info("Kubernetes %s installed and held (was %s)", version,
             ", ".join(f"{p} {v[0]}" for p, v in sorted(before.items())) or "none")  # fmt: skip
    return Activation(version, True, {p: after[p][0] for p in packages})
