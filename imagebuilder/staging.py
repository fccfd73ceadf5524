"""The two media a build hands to ``cloud-init/stage.sh``, and the plans it follows.

A build puts things into the target in two runs of the same script (``stage.sh``), each
from its own ISO 9660 medium labelled ``NTSTAGE`` with its own ``plan.tsv``:

* the **base medium**, for the installer's late-command: the OS packages the definition
  asks for (and their dependency closure), the pinned pip unpacked and byte-compiled for
  the staging plan's venv step (under ``/var/lib/nodetrust-build``, which generalisation
  removes from the image), the provisioning hook (``cloud-init/provision-init.sh``), the
  export of the base's kernel and initrd to the builder, the base's package list, ``fstrim``.
  What it holds decides the installed base, which builds cache and reuse
  (:mod:`imagebuilder.base`): :func:`tree_digest` is part of the base's key;
* the **staging medium**, for the provisioning boot of that base: the installed
  Kubernetes version (apt, held), the staged Kubernetes debs, the artifacts, the agent's
  venv and units, ``/etc/nodetrust/image.json``, the admin user, the sshd policy, the
  package list, generalisation and ``fstrim``.

Tree of a medium::

    stage.sh                 cloud-init/stage.sh
    plan.tsv                 what stage.sh does, in order (see the head of stage.sh)
    provision-init           cloud-init/provision-init.sh (base medium only)
    apt/                     a flat apt repository
    staged/...               Kubernetes debs of the staged versions
    files/<artifact>/...     tarballs, binaries, OCI archives, debs to stage
    wheels/                  the agent wheel, its dependencies, pip
    units/                   systemd units and drop-ins of the agent
    node/                    the node's host, container runtime and GPU files (imagebuilder.nodespec) and
                             images.tsv, the OCI archives (under files/) imported into containerd's store
    keys/<user>.keys         authorized SSH keys
    info/image.json          /etc/nodetrust/image.json in the target

Files come from verified cache entries (hard links where possible) and from the build.
:func:`staged_files` lists every file the staging plan puts at a fixed path, with its
digest: the manifest carries it and the boot test checks it inside the booted image.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from imagebuilder import aptrepo, nodespec
from imagebuilder.autoinstall import PROVISION_INIT, STAGE_SCRIPT, template_text
from imagebuilder.bootmeasure import BOOT_INFO
from imagebuilder.definition import Definition
from imagebuilder.errors import BuildError
from imagebuilder.lock import LockedInput, plain_name
from imagebuilder.outputs import sha256_file
from imagebuilder.seal import BOLT_SCRIPT, PlanLines

#: Where the installer puts the provisioning hook in the base; it removes itself when it is done.
PROVISION_HOOK = "/usr/lib/nodetrust/provision-init"
#: The serial of the raw disk the installer writes the base's kernel and initrd to.
EXPORT_SERIAL = "nodetrust-export"


@dataclass(frozen=True)
class StagedFile:
    """One locked input and where its verified content lies on this host."""

    item: LockedInput
    path: Path


def place(source: Path, dest: Path) -> None:
    """Hard-link (cache entries are never modified) or copy ``source`` to ``dest``, mode 0644."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(
        missing_ok=True
    )  # whatever was there (a link of ours included) is replaced, never written through
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


def _write_plan(tree: Path, plan: list[str]) -> list[str]:
    for line in plan:
        if any(not field for field in line.split("\t")):
            raise BuildError(f"staging plan line with an empty field: {line!r}")
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in line):
            raise BuildError(f"staging plan line with a control character: {line!r}")
    (tree / "plan.tsv").write_text("\n".join(plan) + "\n", encoding="utf-8")
    return plan


def _start(tree: Path) -> None:
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "stage.sh").write_text(template_text(STAGE_SCRIPT), encoding="utf-8")
    (tree / "stage.sh").chmod(0o755)


# -- the base medium --------------------------------------------------------------------------


def base_tree(
    tree: Path,
    defn: Definition,
    files: Sequence[StagedFile],
    base_keys: AbstractSet[str],
    *,
    pip_wheel: Path | None = None,
) -> list[str]:
    """The installer's medium: OS packages, a compiled pip, the provisioning hook, the boot files' export."""
    _start(tree)
    plan: list[str] = []
    apt_items = [f for f in files if f.item.role == "apt" and f.item.key in base_keys]
    if apt_items:
        for staged in apt_items:
            place(staged.path, tree / "apt" / plain_name(staged.item.filename))
        aptrepo.make_flat_repo(tree / "apt")
        names = {f.item.name for f in apt_items}
        install = [str(p) for p in defn.packages if p.name in names]
        if install:
            plan.append("apt\t" + " ".join(install))
    if pip_wheel is not None:
        place(pip_wheel, tree / "wheels" / pip_wheel.name)
        plan.append(f"pip\t{pip_wheel.name}")
    (tree / "provision-init").write_text(template_text(PROVISION_INIT), encoding="utf-8")
    plan.append(f"file\tprovision-init\t{PROVISION_HOOK}\t0755")
    plan += [f"export\t{EXPORT_SERIAL}", "report", "trim"]
    return _write_plan(tree, plan)


def tree_digest(tree: Path) -> str:
    """SHA-256 over every file of a tree: relative path, executable bit, content digest."""
    digest = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        rel = path.relative_to(tree).as_posix()
        executable = "x" if path.stat().st_mode & stat.S_IXUSR else "-"
        content = hashlib.sha256(path.read_bytes()).hexdigest()
        digest.update(f"{rel}\0{executable}\0{content}\n".encode())
    return digest.hexdigest()


# -- the staging medium ------------------------------------------------------------------------


def build_tree(
    tree: Path,
    defn: Definition,
    files: Sequence[StagedFile],
    *,
    wheels: Sequence[Path],
    pip_wheel: str,
    agent_requirement: str,
    image_info: dict[str, object],
    base_keys: AbstractSet[str] = frozenset(),
    seal: PlanLines | None = None,
) -> list[str]:
    """Write the staging tree (everything but the base's packages); return the plan lines. With ``seal`` (a
    reproducible image, :mod:`imagebuilder.seal`): its time first, its identifiers before the boot loader,
    its scrub list and the export at the end instead of ``trim``."""
    _start(tree)
    plan: list[str] = list(seal.first) if seal is not None else []
    if seal is not None:
        script = resources.files("imagebuilder.guest").joinpath(BOLT_SCRIPT).read_text(encoding="utf-8")
        (tree / BOLT_SCRIPT).write_text(script, encoding="utf-8")
    kube = defn.kubernetes

    apt_items = [f for f in files if f.item.role == "apt" and f.item.key not in base_keys]
    if apt_items:
        for staged in apt_items:
            place(staged.path, tree / "apt" / plain_name(staged.item.filename))
        aptrepo.make_flat_repo(tree / "apt")
        names = {f.item.name for f in apt_items}
        install = [str(p) for p in defn.packages if p.name in names]
        if kube is not None:
            install += [f"{p}={kube.deb_version(kube.installed)}" for p in kube.packages]
        if install:
            plan.append("apt\t" + " ".join(install))
        if kube is not None:
            plan.append("hold\t" + " ".join(kube.packages))

    imported = _imported(defn)
    image_files: dict[str, str] = {}  # artifact -> its path on the medium, for the node's image import
    for staged in files:
        item = staged.item
        if item.role != "stage":
            continue
        if item.kind == "oci-archive" and item.name in imported:
            # imported into containerd's store by the node plan below, never left in the image as a tarball
            rel = f"files/{plain_name(item.name, 'name')}/{plain_name(item.filename)}"
            place(staged.path, tree / rel)
            image_files[item.name] = rel
            continue
        if item.kind == "deb" and item.key.startswith("kubernetes/"):
            rel = f"staged/{plain_name(item.key.split('/')[1], 'version')}/{plain_name(item.filename)}"
            place(staged.path, tree / rel)
            plan.append(f"file\t{rel}\t{_dest_file(item.destination, item.filename)}\t0644")
        elif item.kind == "tarball":
            rel = f"files/{plain_name(item.name, 'name')}/{plain_name(item.filename)}"
            place(staged.path, tree / rel)
            plan.append(f"tarball\t{rel}\t{item.destination}\t{item.strip_components}")
        elif item.kind in ("binary", "oci-archive", "deb"):
            rel = f"files/{plain_name(item.name, 'name')}/{plain_name(item.filename)}"
            place(staged.path, tree / rel)
            plan.append(f"file\t{rel}\t{_dest_file(item.destination, item.filename)}\t{_mode(item)}")
        else:
            raise BuildError(f"{item.name}: do not know how to stage kind {item.kind}")

    for wheel in wheels:
        place(wheel, tree / "wheels" / wheel.name)
    plan.append(f"dir\t{defn.agent.config_dir}\t0700")
    plan.append(f"venv\t{defn.agent.venv}\t{agent_requirement}\t{pip_wheel}")

    for unit in defn.agent.units:
        rel = f"units/{unit.source.replace('/', '_')}"
        place(_unit_source(defn, unit.source), tree / rel)
        plan.append(f"file\t{rel}\t{unit.destination}\t0644")
    for unit in defn.agent.units:
        if unit.enable:
            plan.append(f"enable\t{Path(unit.destination).name}\trequired")
    for name in defn.agent.enable:
        plan.append(f"enable\t{name}\toptional")
    # the node: host configuration, the container runtime (its images imported last), the GPU stack's units
    plan += nodespec.plan_lines(nodespec.render(defn.node), tree, image_files=image_files)

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
    if seal is not None:
        plan += seal.before_bootloader
    if defn.architecture == "amd64":
        # The measured boot chain (imagebuilder.bootmeasure), once nothing else changes /boot.
        plan.append(f"bootloader\t{BOOT_INFO}")
    plan += ["report", "generalise"]
    plan += seal.last if seal is not None else ["trim"]
    return _write_plan(tree, plan)


def _imported(defn: Definition) -> set[str]:
    """The artifacts the container runtime imports at build time (not staged as files)."""
    runtime = defn.node.runtime
    return {image.artifact for image in runtime.images} if runtime is not None else set()


def _mode(item: LockedInput) -> str:
    return item.mode or ("0755" if item.kind == "binary" else "0644")


def _unit_source(defn: Definition, source: str) -> Path:
    """A unit file of the agent source: a regular file inside it, never a link to a host file."""
    path = defn.agent.source / source
    if path.is_symlink() or not path.resolve().is_relative_to(defn.agent.source.resolve()):
        raise BuildError(
            f"the agent unit {path} is a symbolic link or lies outside {defn.agent.source}: refused",
            hint="a unit is copied into the image: keep it a regular file in the agent source (agent.units)",
        )
    if not path.is_file():
        raise BuildError(f"the agent unit {path} does not exist", hint="check agent.units in the definition")
    return path


# -- what the staging plan puts where ---------------------------------------------------------------


def _tar_refusal(member: tarfile.TarInfo, parts: list[str], links: set[str]) -> str:
    """Why the staging plan must not extract ``member`` into the target (empty: it may)."""
    if member.name.startswith("/"):
        return "has an absolute name"
    if ".." in parts:
        return "has a .. component"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in member.name):
        return "has a control character in its name"
    for depth in range(1, len(parts)):
        if "/".join(parts[:depth]) in links:
            return f"lies under the symbolic link {'/'.join(parts[:depth])} (extracting it would write through the link)"
    if member.ischr() or member.isblk() or member.isfifo():
        return "is a device or a FIFO"
    if member.islnk():
        target = [p for p in member.linkname.split("/") if p not in ("", ".")]
        if member.linkname.startswith("/") or ".." in target:
            return f"is a hard link to {member.linkname!r}, outside the archive"
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return "is of a type the staging plan does not extract"
    return ""


@functools.lru_cache(maxsize=64)
def _tar_members(staged: StagedFile) -> tuple[dict[str, Any], ...]:
    """What an artifact tarball puts where, after checking every member (:func:`_tar_refusal`):
    a tarball with a member that is absolute, has ``..``, is a device or FIFO, a hard link out of the
    archive, or lies under one of its own symbolic links is refused before any VM runs."""
    item = staged.item
    strip = item.strip_components
    out: list[dict[str, Any]] = []
    links: set[str] = set()
    try:
        with tarfile.open(staged.path) as archive:
            for member in archive:
                parts = [p for p in member.name.split("/") if p not in ("", ".")]
                why = _tar_refusal(member, parts, links)
                if why:
                    raise BuildError(
                        f"{item.name}: {staged.path.name}: member {member.name!r} {why}: refused",
                        hint="the staging plan extracts artifact tarballs into the image as they are; this one "
                        "could write outside its destination. Check the upstream tarball (its digest is locked)",
                    )
                if member.issym():
                    links.add("/".join(parts))
                if len(parts) <= strip:
                    continue
                path = item.destination.rstrip("/") + "/" + "/".join(parts[strip:])
                entry: dict[str, Any] = {"group": f"{item.name} {item.version}", "path": path}
                if member.isfile():
                    handle = archive.extractfile(member)
                    if handle is None:
                        continue
                    digest = hashlib.sha256()
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
                    entry |= {"sha256": digest.hexdigest(), "mode": f"{member.mode & 0o7777:04o}"}
                elif member.issym():
                    entry["link"] = member.linkname
                else:
                    continue
                out.append(entry)
    except (tarfile.TarError, OSError) as exc:
        raise BuildError(f"{item.name}: cannot read {staged.path.name} as a tar archive: {exc}") from exc
    return tuple(out)


def check_archives(files: Sequence[StagedFile]) -> None:
    """Read every artifact tarball once, before any VM: a member that could land outside its
    destination fails the build here (:func:`_tar_members`)."""
    for staged in files:
        if staged.item.role == "stage" and staged.item.kind == "tarball":
            _tar_members(staged)


def staged_files(defn: Definition, files: Sequence[StagedFile]) -> list[dict[str, Any]]:
    """Every file the staging plan puts at a fixed path: ``group`` (what it belongs to), ``path``,
    ``sha256`` and ``mode`` (or ``link`` for a symbolic link), sorted by path."""
    out: list[dict[str, Any]] = []
    imported = _imported(defn)
    for staged in files:
        item = staged.item
        if item.role != "stage" or (item.kind == "oci-archive" and item.name in imported):
            continue
        if item.kind == "tarball":
            out += list(_tar_members(staged))
            continue
        if item.kind == "deb" and item.key.startswith("kubernetes/"):
            group = f"kubernetes {item.key.split('/')[1]} (staged)"
            mode = "0644"
        else:
            group = f"{item.name} {item.version}"
            mode = _mode(item)
        path = _dest_file(item.destination, item.filename)
        out.append({"group": group, "path": path, "sha256": item.sha256, "mode": mode})
    for unit in defn.agent.units:
        source = _unit_source(defn, unit.source)
        out.append(
            {
                "group": "nodeagent units",
                "path": unit.destination,
                "sha256": sha256_file(source),
                "mode": "0644",
            }
        )
    return sorted(out, key=lambda e: str(e["path"]))
