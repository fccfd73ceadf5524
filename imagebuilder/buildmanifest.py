"""The build folder's ``manifest.json``: what one build read, ran and made (docs/building-images.md, Outputs).

:func:`manifest` writes the record of the run from a finished :class:`imagebuilder.build.Build` (its inputs,
phases, tools, the installed base it provisioned and the installer run that made it);
:func:`add_reproducible` adds what makes the image reproducible (docs/reproducible.md).
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imagebuilder import base, outputs, seal
from imagebuilder.reproducible import iso_time
from imagebuilder.run import tool_version
from imagebuilder.watch import WatchResult

if TYPE_CHECKING:
    from imagebuilder.build import Build

BUILDER_ID = "https://nodetrust.dev/imagebuilder@v1"


def builder_version() -> str:
    try:
        return importlib.metadata.version("nodetrust")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def manifest(
    build: Build,
    folder: Path,
    result: WatchResult,
    image: dict[str, Any],
    accel: tuple[str, str],
    *,
    installed: base.Base,
    installer: WatchResult | None,
) -> dict[str, Any]:
    defn = build.defn
    inputs = [
        {
            "name": i.name,
            "kind": i.kind,
            "version": i.version,
            "url": i.url,
            "sha256": i.sha256,
            "size": i.size,
            "destination": i.destination,
            "verified_by": i.verified_by,
            "role": i.role,
        }
        for i in build.lock.inputs
    ]
    inputs.extend(build.extra_inputs)
    image_path = folder / f"{defn.name}.qcow2"
    outputs_list = [
        outputs.file_entry(image_path, outputs.QCOW2_MEDIA_TYPE),
        outputs.file_entry(folder / "console.log", "text/plain"),
    ]
    phases = list(build.phases.records)
    if installer is not None:
        phases += [
            {
                "name": f"install/{p.name}",
                "started_at": iso_time(p.started_at),
                "duration_s": p.duration_s,
            }
            for p in installer.phases
        ]
    phases += [
        {
            "name": f"provision/{p.name}",
            "started_at": iso_time(p.started_at),
            "duration_s": p.duration_s,
        }
        for p in result.phases
    ]
    made_by = installed.record.get("installer", {})
    tools = {
        "imagebuilder": builder_version(),
        "python": platform.python_version(),
        "qemu-img": tool_version("qemu-img").removeprefix("qemu-img version "),
        "xorriso": tool_version("xorriso", "-version"),
        **getattr(build, "versions", {}),
    }
    return {
        "schema": outputs.MANIFEST_SCHEMA,
        "build_id": build.build_id,
        "name": defn.name,
        "distro": defn.distro,
        "architecture": defn.architecture,
        "started_at": iso_time(build.started),
        "finished_at": iso_time(time.time()),
        "builder": {"id": BUILDER_ID, "version": builder_version(), "host": socket.gethostname()},
        "definition": {
            "path": str(build.opts.definition),
            "sha256": defn.file_sha256,
            "resolved_sha256": defn.resolved_sha256,
        },
        "lock": {"path": str(build.lock.path), "sha256": build.lock.file_sha256},
        "inputs": sorted(inputs, key=lambda i: (i["kind"], i["name"], i.get("version", ""))),
        "outputs": outputs_list,
        "packages": sorted(result.packages, key=lambda p: (p["name"], p["architecture"])),
        "kubernetes": {"installed": defn.kubernetes.installed, "staged": list(defn.kubernetes.staged)}
        if defn.kubernetes
        else {},
        "artifacts": {a.name: {"version": a.version, "destination": a.destination} for a in defn.artifacts},
        "agent": {
            "venv": defn.agent.venv,
            "config_dir": defn.agent.config_dir,
            "source": build.agent_source.to_json(),
        },
        "phases": phases,
        "tools": tools,
        "installed_size": result.installed_size,
        "image": image,
        "accelerator": {"name": accel[0], "why": accel[1]},
        "installer": {
            "ran": installer is not None,
            "events": installer.events if installer is not None else made_by.get("events", 0),
            "webhook_events": getattr(build, "webhook_events", 0)
            if installer is not None
            else made_by.get("webhook_events", 0),
            "network": build.network if installer is not None else made_by.get("network", build.network),
        },
        "build_path": "full" if installer is not None else "incremental",
        "base": {
            "key": installed.key,
            "sha256": installed.sha256,
            "size": installed.record["files"]["base.qcow2"]["size"],
            "created_at": installed.record.get("created_at", ""),
            "created_by": installed.record.get("build_id", ""),
            "installed_size": made_by.get("installed_size"),
        },
    }


def add_reproducible(manifest: dict[str, Any], build: Build, sealed: seal.Sealed) -> None:
    """What makes the image reproducible, in its manifest; the installed size of the sealed file system."""
    manifest["reproducible"] = {
        "source_date_epoch": build.identity.source_date_epoch,
        "identity": build.identity.to_json(),
        "seal": {
            "entries": sealed.entries,
            "layout": sealed.layout.to_json(),
        },
    }
    manifest["installed_size"] = sealed.assembled.root_used_bytes
    manifest["tools"].update(sealed.assembled.tools)
