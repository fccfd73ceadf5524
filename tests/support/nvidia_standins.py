"""Stand-in packages for the NVIDIA stack, which cannot exist on these machines (no GPU, no NVIDIA archive).

Public API::

    DRIVER_VERSION = "570.195.03"
    @dataclass class Package: name, version, files, depends, description
    packages(kernel: str) -> list[Package]     # the fixture's NVIDIA stand-ins for kernel release `kernel`

Each is named ``...-standin``, says so in its description and in every file it ships, and takes the place
of one real package of ``examples/ubuntu-2404-node.yaml`` (whose names are to be confirmed on the first
lock, like every NVIDIA name there):

* ``nvidia-headless-no-dkms-570-server-standin``: ``nvidia-smi``;
* ``linux-modules-nvidia-570-server-standin-amd64``: depends on the next (as Ubuntu's
  ``linux-modules-nvidia-570-server-generic`` meta package does on the kernel's own);
* ``linux-modules-nvidia-570-server-standin-<kernel>``:
  ``/lib/modules/<kernel>/kernel/nvidia-570srv/<module>.ko.standin`` (not loadable; depmod ignores them);
* ``nvidia-compute-utils-570-server-standin``: ``nvidia-persistenced`` and its unit;
* ``nvidia-fabricmanager-570-standin``: ``nv-fabricmanager``, its configuration and unit;
* ``nvidia-container-toolkit-standin``: ``nvidia-container-runtime``, ``nvidia-ctk``, the runtime's configuration;
* ``datacenter-gpu-manager-4-core-standin``: ``nv-hostengine``, ``dcgmi`` and the ``nvidia-dcgm`` unit.

The units carry ``ConditionPathExists=/dev/nvidiactl``: enabled as on a GPU node, and skipped (not
failed) on a machine without a GPU, which is every machine these tests run on. The real units have no
such condition; what the boot test checks is the same either way: installed, configured, enabled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRIVER_VERSION = "570.195.03"
REVISION = "0nodetrust1"
MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset")
FABRICMANAGER_CFG = b"# STAND-IN fabricmanager.cfg (nodetrust fixture)\nFABRIC_MODE=0\n"


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    files: dict[str, bytes] = field(default_factory=dict)
    depends: str = ""
    description: str = ""


def _script(name: str) -> bytes:
    return (
        f"#!/bin/sh\n# STAND-IN for NVIDIA's {name} {DRIVER_VERSION} (nodetrust fixture payload; not NVIDIA software)\n"
        f'echo "{name} {DRIVER_VERSION}: nodetrust fixture stand-in; no NVIDIA GPU here" >&2\nexit 1\n'
    ).encode()


def _unit(what: str, binary: str, extra: str = "") -> bytes:
    return (
        f"[Unit]\nDescription=STAND-IN for NVIDIA {what} (nodetrust fixture; not NVIDIA software)\n"
        "# The stand-in skips itself on a machine without a GPU (the real unit has no such condition).\n"
        f"ConditionPathExists=/dev/nvidiactl\n{extra}\n[Service]\nExecStart={binary}\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    ).encode()


def packages(kernel: str) -> list[Package]:
    version = f"{DRIVER_VERSION}-{REVISION}"
    stand_in = "STAND-IN (nodetrust fixture payload, not NVIDIA software) for"
    modules = {
        f"/lib/modules/{kernel}/kernel/nvidia-570srv/{m}.ko.standin": f"stand-in for {m}.ko {DRIVER_VERSION}\n".encode()
        for m in MODULES
    }
    toolkit_config = (
        b"# STAND-IN for nvidia-container-runtime's configuration (nodetrust fixture)\n"
        b'[nvidia-container-runtime]\nmode = "auto"\nruntimes = ["runc"]\n'
    )
    return [
        Package(
            "nvidia-headless-no-dkms-570-server-standin",
            version,
            {"/usr/bin/nvidia-smi": _script("nvidia-smi")},
            description=f"{stand_in} nvidia-headless-no-dkms-570-server",
        ),
        Package(
            "linux-modules-nvidia-570-server-standin-amd64",
            version,
            depends=f"linux-modules-nvidia-570-server-standin-{kernel} (= {version})",
            description=f"{stand_in} linux-modules-nvidia-570-server-generic (the kernel's modules)",
        ),
        Package(
            f"linux-modules-nvidia-570-server-standin-{kernel}",
            version,
            modules,
            description=f"{stand_in} linux-modules-nvidia-570-server-{kernel} (precompiled for {kernel})",
        ),
        Package(
            "nvidia-compute-utils-570-server-standin",
            version,
            {
                "/usr/bin/nvidia-persistenced": _script("nvidia-persistenced"),
                "/usr/lib/systemd/system/nvidia-persistenced.service": _unit(
                    "persistence daemon", "/usr/bin/nvidia-persistenced --user root --no-persistence-mode"
                ),
            },
            description=f"{stand_in} nvidia-compute-utils-570-server (nvidia-persistenced)",
        ),
        Package(
            "nvidia-fabricmanager-570-standin",
            version,
            {
                "/usr/bin/nv-fabricmanager": _script("nv-fabricmanager"),
                "/usr/share/nvidia/nvswitch/fabricmanager.cfg": FABRICMANAGER_CFG,
                "/usr/lib/systemd/system/nvidia-fabricmanager.service": _unit(
                    "Fabric Manager",
                    "/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg",
                ),
            },
            description=f"{stand_in} nvidia-fabricmanager-570",
        ),
        Package(
            "nvidia-container-toolkit-standin",
            "1.18.0-1",
            {
                "/usr/bin/nvidia-container-runtime": _script("nvidia-container-runtime"),
                "/usr/bin/nvidia-ctk": _script("nvidia-ctk"),
                "/etc/nvidia-container-runtime/config.toml": toolkit_config,
            },
            description=f"{stand_in} nvidia-container-toolkit",
        ),
        Package(
            "datacenter-gpu-manager-4-core-standin",
            "4.4.1-1",
            {
                "/usr/bin/nv-hostengine": _script("nv-hostengine"),
                "/usr/bin/dcgmi": _script("dcgmi"),
                "/usr/lib/systemd/system/nvidia-dcgm.service": _unit(
                    "DCGM host engine", "/usr/bin/nv-hostengine -n"
                ),
            },
            description=f"{stand_in} datacenter-gpu-manager-4-core",
        ),
    ]
