"""The staging medium: everything late-commands put into the target, and the plan they follow.

Tree (becomes the ``NTSTAGE`` ISO)::

    stage.sh                 cloud-init/stage.sh
    plan.tsv                 what stage.sh does, in order (see the head of stage.sh)
    apt/                     a flat apt repository: OS packages and the installed Kubernetes version
    staged/...               Kubernetes debs of the staged versions
    files/<artifact>/...     tarballs, binaries, OCI archives, debs to stage
    wheels/                  the agent wheel, its dependencies, pip
    units/                   systemd units and drop-ins of the agent
    keys/<user>.keys         authorized SSH keys
    info/image.json          /etc/nodetrust/image.json in the target

Files come from verified cache entries (hard links where possible) and from the build.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from imagebuilder import aptrepo
from imagebuilder.autoinstall import STAGE_SCRIPT, template_text
from imagebuilder.definition import Definition
from imagebuilder.errors import BuildError
from imagebuilder.lock import LockedInput


@dataclass(frozen=True)
class StagedFile:
    """One locked input and where its verified content lies on this host."""

    item: LockedInput
    path: Path


def place(source: Path, dest: Path) -> None:
    """Hard-link (cache entries are never modified) or copy ``source`` to ``dest``, mode 0644."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
    if dest.stat().st_mode & 0o777 != 0o644:
        if dest.stat().st_nlink > 1:  # never chmod a shared cache entry: copy instead
            dest.unlink()
            shutil.copyfile(source, dest)
        dest.chmod(0o644)


def _dest_file(destination: str, filename: str) -> str:
    return destination + filename if destination.endswith("/") else destination


def build_tree(
    tree: Path,
    defn: Definition,
    files: Sequence[StagedFile],
    *,
    wheels: Sequence[Path],
    pip_wheel: str,
    agent_requirement: str,
    image_info: dict[str, object],
) -> list[str]:
    """Write the staging tree; return the plan lines (tab-separated)."""
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "stage.sh").write_text(template_text(STAGE_SCRIPT), encoding="utf-8")
    (tree / "stage.sh").chmod(0o755)
    plan: list[str] = []
    kube = defn.kubernetes

    apt_items = [f for f in files if f.item.role == "apt"]
    if apt_items:
        for staged in apt_items:
            place(staged.path, tree / "apt" / staged.item.filename)
        aptrepo.make_flat_repo(tree / "apt")
        install = [str(p) for p in defn.packages if any(f.item.name == p.name for f in apt_items)]
        if kube is not None:
            install += [f"{p}={kube.deb_version(kube.installed)}" for p in kube.packages]
        plan.append("apt\t" + " ".join(install))
        if kube is not None:
            plan.append("hold\t" + " ".join(kube.packages))

    for staged in files:
        item = staged.item
        if item.role != "stage":
            continue
        if item.kind == "deb" and item.key.startswith("kubernetes/"):
            rel = f"staged/{item.key.split('/')[1]}/{item.filename}"
            place(staged.path, tree / rel)
            plan.append(f"file\t{rel}\t{_dest_file(item.destination, item.filename)}\t0644")
        elif item.kind == "tarball":
            rel = f"files/{item.name}/{item.filename}"
            place(staged.path, tree / rel)
            plan.append(f"tarball\t{rel}\t{item.destination}\t{item.strip_components}")
        elif item.kind in ("binary", "oci-archive", "deb"):
            rel = f"files/{item.name}/{item.filename}"
            place(staged.path, tree / rel)
            mode = item.mode or ("0755" if item.kind == "binary" else "0644")
            plan.append(f"file\t{rel}\t{_dest_file(item.destination, item.filename)}\t{mode}")
        else:
            raise BuildError(f"{item.name}: do not know how to stage kind {item.kind}")

    for wheel in wheels:
        place(wheel, tree / "wheels" / wheel.name)
    plan.append(f"dir\t{defn.agent.config_dir}\t0700")
    plan.append(f"venv\t{defn.agent.venv}\t{agent_requirement}\t{pip_wheel}")

    for unit in defn.agent.units:
        source = defn.agent.source / unit.source
        if not source.is_file():
            raise BuildError(
                f"the agent unit {source} does not exist", hint="check agent.units in the definition"
            )
        rel = f"units/{unit.source.replace('/', '_')}"
        place(source, tree / rel)
        plan.append(f"file\t{rel}\t{unit.destination}\t0644")
    for unit in defn.agent.units:
        if unit.enable:
            plan.append(f"enable\t{Path(unit.destination).name}\trequired")
    for name in defn.agent.enable:
        plan.append(f"enable\t{name}\toptional")

    info = tree / "info" / "image.json"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(json.dumps(image_info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    plan.append("file\tinfo/image.json\t/etc/nodetrust/image.json\t0644")

    if defn.user is not None:
        keys = "-"
        if defn.user.ssh_authorized_keys:
            keys = f"keys/{defn.user.name}.keys"
            (tree / "keys").mkdir(exist_ok=True)
            (tree / keys).write_text("\n".join(defn.user.ssh_authorized_keys) + "\n", encoding="utf-8")
        plan.append(
            f"user\t{defn.user.name}\t{'yes' if defn.user.sudo else 'no'}\t{defn.user.shell}\t{keys}"
        )
    if not defn.ssh.install_server:
        plan.append("sshd\tdisable")
    else:
        plan.append(f"sshd\t{'yes' if defn.ssh.allow_password else 'no'}")

    for line in plan:
        if any(not field for field in line.split("\t")):
            raise BuildError(f"staging plan line with an empty field: {line!r}")
    (tree / "plan.tsv").write_text("\n".join(plan) + "\n", encoding="utf-8")
    return plan
