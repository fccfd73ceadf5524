"""``definition.yaml``: what an image is made of, validated against the shipped JSON Schema.

:func:`load_definition` reads the file, substitutes ``${VAR}`` / ``${VAR:-default}``
environment references in string values, validates the result against
``schemas/definition.schema.json`` (every error with its path, e.g.
``artifacts[2].sha256``), applies defaults and returns a frozen :class:`Definition`
resolved for the definition's architecture. Relative paths (keyrings, the agent
source) are relative to the definition's folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from imagebuilder import schemacheck
from imagebuilder.errors import DefinitionError
from imagebuilder.nodespec import NodeSpec, node_spec

SCHEMA_RESOURCE = "definition.schema.json"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
DEFAULT_KERNEL_ARGS: tuple[str, ...] = ()  # extra arguments after `---`: carried into the installed system
MAX_DEFINITION_BYTES = 1 << 20  # read no more than this before parsing


def schema() -> dict[str, Any]:
    """The definition's JSON Schema (shipped as package data, for editors too)."""
    return schemacheck.load_schema(SCHEMA_RESOURCE)


@dataclass(frozen=True)
class Checksums:
    """An upstream checksum file and, optionally, its detached signature and the signing keyring."""

    url: str
    signature: str | None = None
    keyring: Path | None = None


@dataclass(frozen=True)
class IsoSpec:
    url: str
    mirrors: tuple[str, ...] = ()
    sha256: str | None = None
    version: str = ""
    checksums: Checksums | None = None


@dataclass(frozen=True)
class Installer:
    iso: IsoSpec
    kernel: str = "casper/vmlinuz"
    initrd: str = "casper/initrd"
    kernel_args: tuple[str, ...] = DEFAULT_KERNEL_ARGS
    base_manifests: tuple[str, ...] = ()
    source_id: str = ""


@dataclass(frozen=True)
class Target:
    python: str
    glibc: str
    release: str = ""

    @property
    def python_tag(self) -> str:
        return "cp" + self.python.replace(".", "")


@dataclass(frozen=True)
class AptRepository:
    name: str
    url: str
    keyring: Path
    suite: str = ""
    components: tuple[str, ...] = ("main",)
    flat: bool = False


@dataclass(frozen=True)
class PackageRequest:
    name: str
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.name}={self.version}" if self.version else self.name


@dataclass(frozen=True)
class Kubernetes:
    installed: str
    repository: AptRepository  # url and name may hold {minor} and {version}
    staged: tuple[str, ...] = ()
    packages: tuple[str, ...] = ("kubeadm", "kubelet", "kubectl")
    deb_revision: str = "1.1"
    staged_path: str = "/opt/nodetrust/staged/kubernetes/{version}/"

    @property
    def versions(self) -> tuple[str, ...]:
        return (self.installed, *self.staged)

    def deb_version(self, version: str) -> str:
        return f"{version}-{self.deb_revision}"

    def repository_for(self, version: str) -> AptRepository:
        minor = ".".join(version.split(".")[:2])
        repo = self.repository
        return AptRepository(
            name=f"kubernetes-v{minor}",
            url=repo.url.format(minor=minor, version=version),
            keyring=repo.keyring,
            suite=repo.suite,
            components=repo.components,
            flat=repo.flat,
        )

    def staged_dir(self, version: str) -> str:
        return self.staged_path.format(version=version)


@dataclass(frozen=True)
class Artifact:
    """One artifact, resolved for the definition's architecture."""

    name: str
    version: str
    kind: str  # deb, tarball, binary, oci-archive, wheel
    url: str
    destination: str
    mirrors: tuple[str, ...] = ()
    sha256: str | None = None
    checksums: Checksums | None = None
    strip_components: int = 0
    mode: str = ""


@dataclass(frozen=True)
class Unit:
    source: str  # relative to the agent source
    destination: str
    enable: bool = False


#: Packaged units go to /usr/lib/systemd/system (the vendor layer); /etc/systemd/system stays the
#: administrator's, and ``systemctl enable`` links the unit from multi-user.target.wants there.
#: The same table as agent.systemd.FILES (the builder does not import the agent; a test compares them).
DEFAULT_UNITS = (
    Unit("agent/systemd/nodeagent.service", "/usr/lib/systemd/system/nodeagent.service", True),
    Unit(
        "agent/systemd/kubelet.service.d/10-nodeagent.conf",
        "/usr/lib/systemd/system/kubelet.service.d/10-nodeagent.conf",
    ),
    Unit("agent/systemd/nodeagent-reattest.service", "/usr/lib/systemd/system/nodeagent-reattest.service"),
    Unit("agent/systemd/nodeagent-reattest.timer", "/usr/lib/systemd/system/nodeagent-reattest.timer", True),
)


@dataclass(frozen=True)
class Agent:
    source: Path
    extras: tuple[str, ...] = ("agent",)
    venv: str = "/opt/nodeagent/venv"
    config_dir: str = "/etc/nodeagent"
    units: tuple[Unit, ...] = DEFAULT_UNITS
    enable: tuple[str, ...] = ()
    compile: tuple[str, ...] = ()
    pip: str = "pip"


@dataclass(frozen=True)
class User:
    name: str
    gecos: str = ""
    sudo: bool = True
    shell: str = "/bin/bash"
    ssh_authorized_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ssh:
    install_server: bool = True
    allow_password: bool = False


@dataclass(frozen=True)
class Watchdog:
    """Idle limits (seconds) per phase, sized for TCG; ``total`` bounds the whole VM run."""

    boot: int = 600
    install: int = 900
    late: int = 900
    shutdown: int = 300
    total: int = 4 * 3600

    def limit(self, phase: str) -> int:
        value: int = getattr(self, phase)
        return value


@dataclass(frozen=True)
class Definition:
    path: Path
    file_sha256: str
    resolved_sha256: str  # over the validated data after ${VAR} substitution: what a lock is for
    name: str
    distro: str
    architecture: str
    firmware: str
    disk_size: str
    memory_mib: int
    cpus: int
    compress: bool
    network: str
    installer: Installer
    target: Target
    apt_sources: tuple[AptRepository, ...]
    packages: tuple[PackageRequest, ...]
    kubernetes: Kubernetes | None
    artifacts: tuple[Artifact, ...]
    agent: Agent
    user: User | None
    ssh: Ssh
    watchdog: Watchdog
    node: NodeSpec = field(default_factory=NodeSpec)  # host, container_runtime, gpu (imagebuilder.nodespec)

    @property
    def disk_size_bytes(self) -> int:
        unit = {"M": 2**20, "G": 2**30}[self.disk_size[-1]]
        return int(self.disk_size[:-1]) * unit


# -- loading ---------------------------------------------------------------------------


def _substitute(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ and environ[name] != "":
                return environ[name]
            if default is not None:
                return default
            raise DefinitionError(
                f"{where or 'definition'}: ${{{name}}} is not set",
                hint=f"export {name}=... (or write ${{{name}:-default}} in the definition)",
            )

        return _ENV_REF.sub(replace, value)
    if isinstance(value, list):
        return [_substitute(v, f"{where}[{i}]", environ) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _substitute(v, f"{where}.{k}" if where else str(k), environ) for k, v in value.items()}
    return value


def validate(data: object) -> list[str]:
    """Schema errors as ``path: message`` lines, sorted by path; empty when valid."""
    return schemacheck.validate(schema(), data)


def canonical_sha256(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_definition(path: Path, *, environ: Mapping[str, str] | None = None) -> Definition:
    """Read, substitute, validate and resolve ``path``; raise :class:`DefinitionError` with every problem."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_DEFINITION_BYTES + 1)
    except OSError as exc:
        raise DefinitionError(f"cannot read the definition {path}: {exc.strerror}") from exc
    if len(raw) > MAX_DEFINITION_BYTES:
        raise DefinitionError(
            f"{path} is larger than {MAX_DEFINITION_BYTES >> 10} KiB: not a definition",
            hint="a definition is a short YAML file; check that the path names the definition",
        )
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DefinitionError(f"{path}: not valid UTF-8 YAML: {exc}") from exc
    data = _substitute(data, "", os.environ if environ is None else environ)
    problems = validate(data)
    if problems:
        listing = "\n  ".join(problems)
        raise DefinitionError(
            f"{path}: {len(problems)} problem(s):\n  {listing}",
            hint="the schema is imagebuilder/schemas/definition.schema.json; docs/building-images.md explains each field",
        )
    return _resolve(path, raw, data)


def _path(base: Path, value: str) -> Path:
    candidate = Path(value)
    return candidate if candidate.is_absolute() else (base / candidate).resolve()


def _checksums(base: Path, spec: Mapping[str, Any] | None, arch: str, where: str) -> Checksums | None:
    if not spec:
        return None
    keyring = _path(base, spec["keyring"]) if "keyring" in spec else None
    return Checksums(
        url=_for_arch(spec["url"], arch, f"{where}.url"),
        signature=_for_arch(spec["signature"], arch, f"{where}.signature") if "signature" in spec else None,
        keyring=keyring,
    )


def _for_arch(value: str | Mapping[str, str], arch: str, where: str) -> str:
    if isinstance(value, str):
        return value.replace("{arch}", arch)
    if arch not in value:
        raise DefinitionError(f"{where}: no entry for architecture {arch} (has: {', '.join(sorted(value))})")
    return value[arch]


def _repository(base: Path, spec: Mapping[str, Any], default_name: str) -> AptRepository:
    flat = bool(spec.get("flat", False))
    if not flat and not spec.get("suite"):
        raise DefinitionError(
            f"apt repository {spec.get('name', default_name)}: suite is required unless flat"
        )
    return AptRepository(
        name=spec.get("name", default_name),
        url=spec["url"],
        keyring=_path(base, spec["keyring"]),
        suite=spec.get("suite", ""),
        components=tuple(spec.get("components", ("main",))),
        flat=flat,
    )


def _artifact(base: Path, index: int, spec: Mapping[str, Any], arch: str) -> Artifact:
    where = f"artifacts[{index}] ({spec['name']})"
    sha = spec.get("sha256")
    if isinstance(sha, Mapping):
        sha = sha.get(arch)
    mirrors = tuple((spec.get("mirrors") or {}).get(arch, ()))
    return Artifact(
        name=spec["name"],
        version=spec["version"],
        kind=spec["kind"],
        url=_for_arch(spec["urls"], arch, f"{where}.urls"),
        destination=spec["destination"],
        mirrors=mirrors,
        sha256=sha,
        checksums=_checksums(base, spec.get("checksums"), arch, f"{where}.checksums"),
        strip_components=int(spec.get("strip_components", 0)),
        mode=spec.get("mode", "0755" if spec["kind"] == "binary" else ""),
    )


def _resolve(path: Path, raw: bytes, data: dict[str, Any]) -> Definition:
    base = path.resolve().parent
    arch = data["architecture"]
    inst = data["installer"]
    iso = inst["iso"]
    installer = Installer(
        iso=IsoSpec(
            url=iso["url"],
            mirrors=tuple(iso.get("mirrors", ())),
            sha256=iso.get("sha256"),
            version=iso.get("version", ""),
            checksums=_checksums(base, iso.get("checksums"), arch, "installer.iso.checksums"),
        ),
        kernel=inst.get("kernel", "casper/vmlinuz"),
        initrd=inst.get("initrd", "casper/initrd"),
        kernel_args=tuple(inst.get("kernel_args", DEFAULT_KERNEL_ARGS)),
        base_manifests=tuple(inst.get("base_manifests", ())),
        source_id=inst.get("source_id", ""),
    )
    kube = data.get("kubernetes")
    kubernetes = None
    if kube:
        if kube["installed"] in kube.get("staged", []):
            raise DefinitionError(f"kubernetes: {kube['installed']} is both installed and staged")
        kubernetes = Kubernetes(
            installed=kube["installed"],
            repository=_repository(base, kube["repository"], "kubernetes"),
            staged=tuple(kube.get("staged", ())),
            packages=tuple(kube.get("packages", ("kubeadm", "kubelet", "kubectl"))),
            deb_revision=kube.get("deb_revision", "1.1"),
            staged_path=kube.get("staged_path", "/opt/nodetrust/staged/kubernetes/{version}/"),
        )
    artifacts = tuple(_artifact(base, i, a, arch) for i, a in enumerate(data.get("artifacts", ())))
    names = [a.name for a in artifacts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DefinitionError(f"artifacts: names must be unique; repeated: {', '.join(duplicates)}")
    agent = data["agent"]
    user = data.get("user")
    node = node_spec(base, data, {a.name: a.kind for a in artifacts})
    packages = [
        PackageRequest(p) if isinstance(p, str) else PackageRequest(p["name"], p.get("version"))
        for p in data.get("packages", ())
    ]
    listed = {p.name for p in packages}
    packages += [PackageRequest(name) for name in node.packages if name not in listed]
    return Definition(
        path=path,
        file_sha256=hashlib.sha256(raw).hexdigest(),
        resolved_sha256=canonical_sha256(data),
        name=data["name"],
        distro=data.get("distro", "ubuntu"),
        architecture=arch,
        firmware=data.get("firmware", "uefi"),
        disk_size=data.get("disk_size", "20G"),
        memory_mib=int(data.get("memory_mib", 4096)),
        cpus=int(data.get("cpus", 2)),
        compress=bool(data.get("compress", False)),
        network=data.get("network", "listener"),
        installer=installer,
        target=Target(
            python=data["target"]["python"],
            glibc=data["target"]["glibc"],
            release=data["target"].get("release", ""),
        ),
        apt_sources=tuple(
            _repository(base, s, f"source{i}") for i, s in enumerate(data.get("apt_sources", ()))
        ),
        packages=tuple(packages),
        kubernetes=kubernetes,
        artifacts=artifacts,
        agent=Agent(
            source=_path(base, agent["source"]),
            extras=tuple(agent.get("extras", ("agent",))),
            venv=agent.get("venv", "/opt/nodeagent/venv"),
            config_dir=agent.get("config_dir", "/etc/nodeagent"),
            units=tuple(
                Unit(u["source"], u["destination"], bool(u.get("enable", False))) for u in agent["units"]
            )
            if "units" in agent
            else DEFAULT_UNITS,
            enable=tuple(agent.get("enable", ())),
            compile=tuple(agent.get("compile", ())),
            pip=agent.get("pip", "pip"),
        ),
        user=User(
            name=user["name"],
            gecos=user.get("gecos", ""),
            sudo=bool(user.get("sudo", True)),
            shell=user.get("shell", "/bin/bash"),
            ssh_authorized_keys=tuple(user.get("ssh_authorized_keys", ())),
        )
        if user
        else None,
        ssh=Ssh(
            install_server=bool(data.get("ssh", {}).get("install_server", True)),
            allow_password=bool(data.get("ssh", {}).get("allow_password", False)),
        ),
        watchdog=Watchdog(**data.get("watchdog", {})),
        node=node,
    )
