"""What makes the image a Kubernetes node: host configuration, the container runtime and the GPU stack.

Three optional keys of the definition (validated by ``schemas/definition.schema.json``), with no hook
for arbitrary scripts: every key becomes files with a mode and an owner, units enabled or masked,
packages the lock resolves, or container images imported at build time, and every one is recorded in
the manifest (``contents.node``) and checked inside the booted image by the boot test
(``imagebuilder/guest/boottest_check.py``):

``host``
    ``kernel_modules`` (``/etc/modules-load.d/90-nodetrust.conf``), ``sysctls``
    (``/etc/sysctl.d/90-nodetrust.conf``), ``swap: false`` (``swap.target`` masked, so no swap unit can
    ever start), ``cgroup: v2`` (checked: the unified hierarchy at ``/sys/fs/cgroup``), ``journald``
    size limits (``/etc/systemd/journald.conf.d/90-nodetrust.conf``), ``time_sync`` (the client's
    package and unit; no pool or fallback servers in the image: the node-pool release names its site's
    servers), ``files`` (``path``, ``content`` or ``source``, ``mode``, ``owner``) and ``units``
    (``enable``, ``mask``).
``container_runtime``
    containerd from the distribution (its packages locked like every other), configured for Kubernetes:
    the systemd cgroup driver, CRI enabled, the sandbox image, the CNI folders, registry hosts under
    ``/etc/containerd/certs.d`` (mirrors and credentials per release, in ``hosts.toml`` files: containerd
    reads them at every pull, nothing is rebuilt or restarted); ``crictl`` configured
    (``/etc/crictl.yaml``); ``images``: OCI archives of the definition's ``artifacts`` imported into
    containerd's ``k8s.io`` namespace at build time (not left as tarballs), each under its reference.
``gpu``
    the NVIDIA stack pinned by package: the driver with precompiled kernel modules for the image's kernel
    (no DKMS), nvidia-persistenced, Fabric Manager, the container toolkit (containerd's ``nvidia`` runtime,
    or CDI specifications generated at boot) and DCGM, each with the units that must be enabled.

:func:`node_spec` reads the three keys; :func:`render` turns a :class:`NodeSpec` into the files, units
and images the staging plan applies; :func:`expectations` is what the boot test checks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder.errors import BuildError, DefinitionError

MODULES_FILE = "/etc/modules-load.d/90-nodetrust.conf"
SYSCTL_FILE = "/etc/sysctl.d/90-nodetrust.conf"
JOURNALD_FILE = "/etc/systemd/journald.conf.d/90-nodetrust.conf"
TIMESYNCD_FILE = "/etc/systemd/timesyncd.conf.d/10-nodetrust-image.conf"
CHRONY_FILE = "/etc/chrony/conf.d/10-nodetrust-image.conf"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CRICTL_CONFIG = "/etc/crictl.yaml"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
IMAGE_NAMESPACE = "k8s.io"
SWAP_UNIT = "swap.target"
#: Where a node-pool release's cloud-init writes the time servers (imagebuilder/release/cloudinit.py).
RELEASE_TIME_SERVERS = {
    "systemd-timesyncd": "/etc/systemd/timesyncd.conf.d/50-nodetrust.conf",
    "chrony": "/etc/chrony/sources.d/50-nodetrust.sources",
}
TIME_UNITS = {"systemd-timesyncd": "systemd-timesyncd.service", "chrony": "chrony.service"}
DEFAULT_TIME_CLIENT = "systemd-timesyncd"  # Ubuntu's, and what an image that names none runs
#: How the time client takes servers written while it runs (cloud-init writes the release's after it started).
TIME_RELOAD = {
    "systemd-timesyncd": "/bin/systemctl try-restart systemd-timesyncd.service",
    "chrony": "/usr/bin/chronyc reload sources",
}
TIME_PATH_UNIT = "nodetrust-time-servers.path"


def time_servers_file(client: str, servers: list[str]) -> tuple[str, str]:
    """Where and what a node-pool release writes to give ``client`` the site's ``servers``."""
    if client == "chrony":
        return RELEASE_TIME_SERVERS[client], "".join(f"server {s} iburst\n" for s in servers)
    if client == "systemd-timesyncd":
        return RELEASE_TIME_SERVERS[client], "[Time]\nNTP=" + " ".join(servers) + "\n"
    raise BuildError(f"no time client {client!r}", hint=f"use one of {', '.join(sorted(TIME_UNITS))}")


UNIT_DIR = "/usr/lib/systemd/system"
DEFAULT_RUNTIME_PACKAGES = ("containerd", "runc", "containernetworking-plugins")
_OWNER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}(:[a-z_][a-z0-9_-]{0,31})?$")


@dataclass(frozen=True)
class HostFile:
    """A file the image ships at ``path``, from the definition (``content``/``source``) or rendered here."""

    path: str
    content: bytes
    mode: str = "0644"
    owner: str = "root:root"
    group: str = "host"  # what it belongs to, for the manifest and the boot test's report

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class TimeSync:
    client: str = "systemd-timesyncd"  # or chrony

    @property
    def unit(self) -> str:
        return TIME_UNITS[self.client]

    @property
    def release_file(self) -> str:
        return RELEASE_TIME_SERVERS[self.client]


@dataclass(frozen=True)
class Host:
    kernel_modules: tuple[str, ...] = ()
    sysctls: tuple[tuple[str, str], ...] = ()
    swap: bool = True  # False: masked
    cgroup: str = ""  # "v2": checked by the boot test
    journald: tuple[tuple[str, str], ...] = ()
    time_sync: TimeSync | None = None
    files: tuple[HostFile, ...] = ()
    enable: tuple[str, ...] = ()
    mask: tuple[str, ...] = ()


@dataclass(frozen=True)
class Image:
    artifact: str  # the name of an oci-archive artifact
    ref: str  # the reference it is tagged with in containerd's store


@dataclass(frozen=True)
class Runtime:
    packages: tuple[str, ...] = DEFAULT_RUNTIME_PACKAGES
    systemd_cgroup: bool = True
    sandbox_image: str = "registry.k8s.io/pause:3.10.2"
    cni_bin_dir: str = "/opt/cni/bin"
    cni_conf_dir: str = "/etc/cni/net.d"
    registry_config_path: str = "/etc/containerd/certs.d"
    crictl: bool = True
    images: tuple[Image, ...] = ()


@dataclass(frozen=True)
class GpuComponent:
    packages: tuple[str, ...] = ()
    units: tuple[str, ...] = ()


@dataclass(frozen=True)
class Gpu:
    driver: GpuComponent
    kernel_modules_package: str
    modules: tuple[str, ...] = ("nvidia", "nvidia_uvm", "nvidia_modeset")
    persistenced: GpuComponent | None = None
    fabric_manager: GpuComponent | None = None
    container_toolkit: GpuComponent | None = None
    toolkit_mode: str = "runtime"  # runtime: containerd's nvidia runtime; cdi: CDI specs generated at boot
    runtime_binary: str = "/usr/bin/nvidia-container-runtime"
    default_runtime: bool = False
    dcgm: GpuComponent | None = None

    def components(self) -> dict[str, GpuComponent]:
        found = {"driver": self.driver}
        for name in ("persistenced", "fabric_manager", "container_toolkit", "dcgm"):
            part = getattr(self, name)
            if part is not None:
                found[name] = part
        return found

    @property
    def packages(self) -> tuple[str, ...]:
        names = [self.kernel_modules_package]
        for part in self.components().values():
            names += part.packages
        return tuple(dict.fromkeys(names))

    @property
    def units(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u for part in self.components().values() for u in part.units))


@dataclass(frozen=True)
class NodeSpec:
    host: Host | None = None
    runtime: Runtime | None = None
    gpu: Gpu | None = None

    @property
    def packages(self) -> tuple[str, ...]:
        """What the three keys ask the lock for, beyond the definition's own ``packages``."""
        names: list[str] = []
        if self.runtime is not None:
            names += self.runtime.packages
        if self.host is not None and self.host.time_sync is not None:
            names.append(self.host.time_sync.client)
        if self.gpu is not None:
            names += self.gpu.packages
        return tuple(dict.fromkeys(names))

    @property
    def empty(self) -> bool:
        return self.host is None and self.runtime is None and self.gpu is None


# -- reading ---------------------------------------------------------------------------------------------


def _component(spec: Mapping[str, Any] | None) -> GpuComponent | None:
    if spec is None:
        return None
    return GpuComponent(tuple(spec.get("packages", ())), tuple(spec.get("units", ())))


def _host_file(base: Path, index: int, spec: Mapping[str, Any]) -> HostFile:
    where = f"host.files[{index}] ({spec['path']})"
    if ("content" in spec) == ("source" in spec):
        raise DefinitionError(f"{where}: give exactly one of content and source")
    if "content" in spec:
        data = str(spec["content"]).encode()
    else:
        source = Path(spec["source"])
        source = source if source.is_absolute() else (base / source)
        if source.is_symlink() or not source.is_file():
            raise DefinitionError(f"{where}: source {source} is not a regular file")
        data = source.read_bytes()
    owner = spec.get("owner", "root:root")
    if not _OWNER.match(owner):
        raise DefinitionError(f"{where}: owner {owner!r} is not user or user:group")
    return HostFile(spec["path"], data, spec.get("mode", "0644"), owner, "host files")


def node_spec(base: Path, data: Mapping[str, Any], artifacts: Mapping[str, str]) -> NodeSpec:
    """The ``host``, ``container_runtime`` and ``gpu`` keys of validated definition ``data``;
    ``artifacts`` maps artifact names to their kinds (images must name ``oci-archive`` ones)."""
    host = runtime = gpu = None
    if (h := data.get("host")) is not None:
        time_sync = h.get("time_sync")
        units = h.get("units", {})
        host = Host(
            kernel_modules=tuple(h.get("kernel_modules", ())),
            sysctls=tuple((k, str(v)) for k, v in sorted(h.get("sysctls", {}).items())),
            swap=bool(h.get("swap", True)),
            cgroup=h.get("cgroup", ""),
            journald=tuple((k, str(v)) for k, v in sorted(h.get("journald", {}).items())),
            time_sync=TimeSync(time_sync.get("client", "systemd-timesyncd"))
            if time_sync is not None
            else None,
            files=tuple(_host_file(base, i, f) for i, f in enumerate(h.get("files", ()))),
            enable=tuple(units.get("enable", ())),
            mask=tuple(units.get("mask", ())),
        )
        paths = [f.path for f in host.files]
        if dup := sorted({p for p in paths if paths.count(p) > 1}):
            raise DefinitionError(f"host.files: paths must be unique; repeated: {', '.join(dup)}")
        if clash := sorted(set(host.enable) & set(host.mask)):
            raise DefinitionError(f"host.units: {', '.join(clash)} both enabled and masked")
    if (r := data.get("container_runtime")) is not None:
        images = tuple(Image(i["artifact"], i["ref"]) for i in r.get("images", ()))
        for i, image in enumerate(images):
            kind = artifacts.get(image.artifact)
            if kind is None:
                raise DefinitionError(
                    f"container_runtime.images[{i}]: no artifact named {image.artifact!r}",
                    hint="list the OCI archive under artifacts (kind: oci-archive) and name it here",
                )
            if kind != "oci-archive":
                raise DefinitionError(
                    f"container_runtime.images[{i}]: artifact {image.artifact} is a {kind}, not an oci-archive"
                )
        refs = [i.ref for i in images]
        if dup := sorted({x for x in refs if refs.count(x) > 1}):
            raise DefinitionError(
                f"container_runtime.images: references must be unique; repeated: {', '.join(dup)}"
            )
        cni = r.get("cni", {})
        runtime = Runtime(
            packages=tuple(r.get("packages", DEFAULT_RUNTIME_PACKAGES)),
            systemd_cgroup=bool(r.get("systemd_cgroup", True)),
            sandbox_image=r.get("sandbox_image", Runtime.sandbox_image),
            cni_bin_dir=cni.get("bin_dir", Runtime.cni_bin_dir),
            cni_conf_dir=cni.get("conf_dir", Runtime.cni_conf_dir),
            registry_config_path=r.get("registry_config_path", Runtime.registry_config_path),
            crictl=bool(r.get("crictl", True)),
            images=images,
        )
        if runtime.images and runtime.sandbox_image not in refs:
            raise DefinitionError(
                f"container_runtime: the sandbox image {runtime.sandbox_image} is not among the imported images",
                hint="import the sandbox image at build time (an oci-archive artifact listed under images): a "
                "node without it pulls it at its first pod, which a rack without a registry cannot",
            )
    if (g := data.get("gpu")) is not None:
        toolkit = g.get("container_toolkit")
        driver = g["driver"]
        gpu = Gpu(
            driver=GpuComponent(tuple(driver["packages"]), tuple(driver.get("units", ()))),
            kernel_modules_package=driver["kernel_modules_package"],
            modules=tuple(driver.get("modules", Gpu.modules)),
            persistenced=_component(g.get("persistenced")),
            fabric_manager=_component(g.get("fabric_manager")),
            container_toolkit=_component(toolkit),
            toolkit_mode=(toolkit or {}).get("mode", "runtime"),
            runtime_binary=(toolkit or {}).get("runtime_binary", Gpu.runtime_binary),
            default_runtime=bool((toolkit or {}).get("default_runtime", False)),
            dcgm=_component(g.get("dcgm")),
        )
        if gpu.container_toolkit is not None and runtime is None:
            raise DefinitionError(
                "gpu.container_toolkit needs container_runtime: it configures containerd's nvidia runtime or CDI"
            )
    spec = NodeSpec(host, runtime, gpu)
    render(spec)  # a file written twice (a host file over a rendered one) is refused here, at load
    return spec


# -- rendering -------------------------------------------------------------------------------------------

_HEADER = "# nodetrust image ({what}): written by imagebuilder from the definition's {key}; see docs/building-images.md\n"


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def containerd_config(runtime: Runtime, gpu: Gpu | None) -> str:
    """containerd's configuration (version 2: containerd 1.6 and 1.7) for a kubeadm node."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    default = "runc"
    if gpu is not None and gpu.container_toolkit is not None and gpu.default_runtime:
        default = "nvidia"
    lines = [
        _HEADER.format(what="containerd for Kubernetes", key="container_runtime").rstrip(),
        "# Registry mirrors and credentials are per node-pool release: hosts.toml files under",
        f"# {runtime.registry_config_path}/<registry>/ (containerd reads them at every pull).",
        "version = 2",
        "",
        f"[{cri}]",
        f"  sandbox_image = {_toml_str(runtime.sandbox_image)}",
    ]
    if gpu is not None and gpu.container_toolkit is not None and gpu.toolkit_mode == "cdi":
        lines += ["  enable_cdi = true", '  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]']
    lines += [
        f"  [{cri}.containerd]",
        f"    default_runtime_name = {_toml_str(default)}",
        f"    [{cri}.containerd.runtimes.runc]",
        '      runtime_type = "io.containerd.runc.v2"',
        f"      [{cri}.containerd.runtimes.runc.options]",
        f"        SystemdCgroup = {'true' if runtime.systemd_cgroup else 'false'}",
    ]
    if gpu is not None and gpu.container_toolkit is not None and gpu.toolkit_mode == "runtime":
        lines += [
            f"    [{cri}.containerd.runtimes.nvidia]",
            '      runtime_type = "io.containerd.runc.v2"',
            f"      [{cri}.containerd.runtimes.nvidia.options]",
            f"        BinaryName = {_toml_str(gpu.runtime_binary)}",
            f"        SystemdCgroup = {'true' if runtime.systemd_cgroup else 'false'}",
        ]
    lines += [
        f"  [{cri}.cni]",
        f"    bin_dir = {_toml_str(runtime.cni_bin_dir)}",
        f"    conf_dir = {_toml_str(runtime.cni_conf_dir)}",
        f"  [{cri}.registry]",
        f"    config_path = {_toml_str(runtime.registry_config_path)}",
    ]
    return "\n".join(lines) + "\n"


def crictl_config() -> str:
    return (
        _HEADER.format(what="crictl", key="container_runtime")
        + f"runtime-endpoint: unix://{CONTAINERD_SOCKET}\nimage-endpoint: unix://{CONTAINERD_SOCKET}\n"
        "timeout: 10\n"
    )


@dataclass(frozen=True)
class Rendered:
    """What the staging plan applies for a :class:`NodeSpec`."""

    files: tuple[HostFile, ...] = ()
    enable: tuple[str, ...] = ()
    mask: tuple[str, ...] = ()
    images: tuple[Image, ...] = ()
    dirs: tuple[tuple[str, str], ...] = field(default=())  # (path, mode): empty folders the image ships


def render(spec: NodeSpec) -> Rendered:
    files: list[HostFile] = []
    enable: list[str] = []
    mask: list[str] = []
    dirs: list[tuple[str, str]] = []
    host, runtime, gpu = spec.host, spec.runtime, spec.gpu
    if host is not None:
        if host.kernel_modules:
            body = "".join(f"{m}\n" for m in host.kernel_modules)
            files.append(HostFile(MODULES_FILE, (_HEADER.format(what="kernel modules", key="host") + body).encode(),
                                  group="host configuration"))  # fmt: skip
        if host.sysctls:
            body = "".join(f"{k} = {v}\n" for k, v in host.sysctls)
            files.append(HostFile(SYSCTL_FILE, (_HEADER.format(what="sysctls", key="host") + body).encode(),
                                  group="host configuration"))  # fmt: skip
        if host.journald:
            keys = {"system_max_use": "SystemMaxUse", "runtime_max_use": "RuntimeMaxUse",
                    "max_retention": "MaxRetentionSec", "system_max_file_size": "SystemMaxFileSize"}  # fmt: skip
            body = "[Journal]\n" + "".join(f"{keys[k]}={v}\n" for k, v in host.journald)
            files.append(HostFile(JOURNALD_FILE, (_HEADER.format(what="journald limits", key="host") + body).encode(),
                                  group="host configuration"))  # fmt: skip
        if host.time_sync is not None:
            ts = host.time_sync
            if ts.client == "systemd-timesyncd":
                body = (
                    "# No compiled-in fallback servers: racks often have no internet. The node-pool release\n"
                    f"# writes its site's servers to {ts.release_file}.\n[Time]\nFallbackNTP=\n"
                )
                files.append(HostFile(TIMESYNCD_FILE, (_HEADER.format(what="time sync", key="host") + body).encode(),
                                      group="host configuration"))  # fmt: skip
            enable.append(ts.unit)
            # The release's cloud-init writes the servers after the client started: apply them once they exist
            # (PathExists= fires when the path unit starts if cloud-init was first, else when the file appears).
            path_unit = (
                f"[Unit]\nDescription=nodetrust: the node-pool release's time servers ({ts.release_file})\n\n"
                f"[Path]\nPathExists={ts.release_file}\n\n[Install]\nWantedBy=paths.target\n"
            )
            service = TIME_PATH_UNIT.replace(".path", ".service")
            service_unit = (
                f"[Unit]\nDescription=nodetrust: {ts.client} takes the node-pool release's time servers\n\n"
                f"[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart={TIME_RELOAD[ts.client]}\n"
            )
            for name, text in ((TIME_PATH_UNIT, path_unit), (service, service_unit)):
                files.append(HostFile(f"{UNIT_DIR}/{name}", (_HEADER.format(what="time sync", key="host") + text).encode(),
                                      group="host configuration"))  # fmt: skip
            enable.append(TIME_PATH_UNIT)
        if not host.swap:
            mask.append(SWAP_UNIT)
        files += host.files
        enable += host.enable
        mask += host.mask
    if runtime is not None:
        files.append(
            HostFile(CONTAINERD_CONFIG, containerd_config(runtime, gpu).encode(), group="container runtime")
        )
        if runtime.crictl:
            files.append(HostFile(CRICTL_CONFIG, crictl_config().encode(), group="container runtime"))
        dirs += [(runtime.registry_config_path, "0755"), (runtime.cni_conf_dir, "0755")]
        enable.append("containerd.service")
    if gpu is not None:
        enable += gpu.units
    paths = [f.path for f in files]
    if dup := sorted({p for p in paths if paths.count(p) > 1}):
        raise DefinitionError(
            f"host.files: {', '.join(dup)} is also written by the builder (from host, container_runtime or gpu)",
            hint="set it through its key instead of a file",
        )
    return Rendered(
        files=tuple(files),
        enable=tuple(dict.fromkeys(enable)),
        mask=tuple(dict.fromkeys(mask)),
        images=runtime.images if runtime is not None else (),
        dirs=tuple(dirs),
    )


def plan_lines(rendered: Rendered, tree: Path, *, image_files: Mapping[str, str]) -> list[str]:
    """Staging plan lines (cloud-init/stage.sh) for ``rendered``, its files written under ``tree/node``;
    ``image_files`` maps an imported image's artifact name to its path on the medium."""
    lines: list[str] = []
    for path, mode in rendered.dirs:
        lines.append(f"dir\t{path}\t{mode}")
    for index, host_file in enumerate(rendered.files):
        rel = f"node/{index:02d}-{Path(host_file.path).name}"
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(host_file.content)
        lines.append(f"file\t{rel}\t{host_file.path}\t{host_file.mode}")
        if host_file.owner != "root:root":
            lines.append(f"owner\t{host_file.path}\t{host_file.owner}")
    for unit in rendered.enable:
        lines.append(f"enable\t{unit}\trequired")
    for unit in rendered.mask:
        lines.append(f"mask\t{unit}")
    if missing := [i.artifact for i in rendered.images if i.artifact not in image_files]:
        raise BuildError(
            f"container_runtime.images: {', '.join(missing)} is not among the build's staged inputs",
            hint="run `imagebuilder lock` again: the lock must hold every artifact the definition imports",
        )
    if rendered.images:
        listing = "".join(f"{image_files[i.artifact]}\t{i.ref}\n" for i in rendered.images)
        (tree / "node").mkdir(parents=True, exist_ok=True)
        (tree / "node" / "images.tsv").write_text(listing, encoding="utf-8")
        lines.append(f"images\t{IMAGE_NAMESPACE}\tnode/images.tsv\t{CONTAINERD_CONFIG}")
    return lines


def expectations(spec: NodeSpec) -> dict[str, Any]:
    """``contents.node`` of the manifest: what the boot test checks inside the booted image."""
    if spec.empty:
        return {}
    rendered = render(spec)
    out: dict[str, Any] = {
        "files": [
            {"group": f.group, "path": f.path, "sha256": f.sha256, "mode": f.mode, "owner": f.owner}
            for f in rendered.files
        ],
        "enabled": list(rendered.enable),
        "masked": list(rendered.mask),
    }
    host = spec.host
    if host is not None:
        out["host"] = {
            "kernel_modules": list(host.kernel_modules),
            "sysctls": dict(host.sysctls),
            "swap": host.swap,
            "cgroup": host.cgroup,
            "time_sync": (
                {
                    "client": host.time_sync.client,
                    "unit": host.time_sync.unit,
                    "release_file": host.time_sync.release_file,
                }
                if host.time_sync is not None
                else None
            ),
        }
    if spec.runtime is not None:
        out["container_runtime"] = {
            "socket": CONTAINERD_SOCKET,
            "config": CONTAINERD_CONFIG,
            "namespace": IMAGE_NAMESPACE,
            "sandbox_image": spec.runtime.sandbox_image,
            "systemd_cgroup": spec.runtime.systemd_cgroup,
            "images": [i.ref for i in spec.runtime.images],
            "packages": list(spec.runtime.packages),
        }
    if spec.gpu is not None:
        gpu = spec.gpu
        out["gpu"] = {
            "packages": list(gpu.packages),
            "kernel_modules_package": gpu.kernel_modules_package,
            "modules": list(gpu.modules),
            "units": list(gpu.units),
            "toolkit_mode": gpu.toolkit_mode if gpu.container_toolkit is not None else None,
            "runtime_binary": gpu.runtime_binary if gpu.container_toolkit is not None else None,
        }
    return out
