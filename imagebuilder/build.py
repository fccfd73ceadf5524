"""One image build, phase by phase, each timed.

1. ``check``: the definition, and a lock made for exactly it;
2. ``fetch``: every locked input from the cache (or its URLs), digest-checked: a tampered
   payload stops the build here, before any VM exists;
3. ``wheelhouse``: the agent wheel from this repository, checked against the lock's
   requirements, plus the locked wheels; pip proves offline that the set installs;
4. ``media``: kernel and initrd out of the ISO, the staging medium, the NoCloud seed;
5. ``accelerator``: KVM if it works, else TCG;
6. ``install``: the installer in a libvirt domain, watched (:mod:`imagebuilder.watch`);
7. ``provision``: the provisioning boot on an overlay of the installed base;
8. ``seal``: the image's disk assembled on this host from that overlay, read offline, deterministically
   (:mod:`imagebuilder.seal`: the lock's identifiers and ``SOURCE_DATE_EPOCH``);
9. ``image``: the compacted QCOW2; then the manifest, the trust outputs and the atomic publish.

The same definition, lock, agent source and builder give the same image, byte for byte
(docs/reproducible.md): the build id, the identifiers and every time stamp in the image come from the
lock (:mod:`imagebuilder.reproducible`).

Everything temporary lives in one work directory and the libvirt domain; both are removed
on success, failure, Ctrl-C and SIGTERM. Nothing is published unless every phase passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuilder import (
    autoinstall,
    base,
    bootmeasure,
    boottest,
    buildmanifest,
    closure,
    interrupt,
    media,
    outputs,
    reproducible,
    seal,
    staging,
    wheelhouse,
)
from imagebuilder.accel import choose_accel
from imagebuilder.cache import Cache
from imagebuilder.definition import Definition, load_definition
from imagebuilder.domain import (
    DATA_PORT,
    DomainSpec,
    domain_xml,
    find_firmware,
    kernel_cmdline,
    provision_cmdline,
)
from imagebuilder.errors import BuildError, LockError, OutputError
from imagebuilder.lock import Lock, LockedInput, check_lock, default_lock_path, load_lock, plain_name
from imagebuilder.progress import ProgressLog
from imagebuilder.reproducible import iso_time
from imagebuilder.run import run
from imagebuilder.vm import DOMAIN_PREFIX, Connection, owner_metadata, remove_orphans
from imagebuilder.watch import EventListener, ProvisionWatcher, Watcher, WatchResult

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    definition: Path
    out: Path
    cache_dir: Path
    lock: Path | None = None
    work_root: Path | None = None
    libvirt_uri: str = "qemu:///system"
    accel: str = "auto"
    key: Path | None = None
    network: str | None = None
    idle_limits: dict[str, int] = field(default_factory=dict)
    keep_work: bool = False
    base_cache: Path | None = None  # default: <cache_dir>/bases
    full: bool = False  # install the base again even when the cache has it
    boot_test: bool = True  # boot the image, check it from inside before publishing (boottest)
    progress: Path | None = None  # append machine-readable progress lines here (imagebuilder.progress)


@dataclass
class BuildResult:
    build_id: str
    folder: Path
    manifest: dict[str, Any]


class Phases:
    def __init__(self, progress: ProgressLog | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self.progress = progress or ProgressLog(None, "")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started_wall, started = time.time(), time.monotonic()
        log.info("== %s", name)
        self.progress.emit("start", name)
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        finally:
            duration = round(time.monotonic() - started, 1)
            self.records.append({"name": name, "started_at": iso_time(started_wall), "duration_s": duration})
            log.info("== %s: %.1f s", name, duration)
            self.progress.emit("end", name, duration_s=duration, outcome=outcome)

    def vm_phase(self, prefix: str) -> Callable[[str], None]:
        """A watcher's ``on_phase``: its phases reported as ``<prefix>/<phase>``."""
        return lambda phase: self.progress.emit("start", f"{prefix}/{phase}")


def _check_reachable(root: Path) -> None:
    """QEMU runs as another user under qemu:///system (libvirt-qemu): every parent must be traversable."""
    for parent in [root.resolve(), *root.resolve().parents]:
        if not os.stat(parent).st_mode & 0o001:
            raise BuildError(
                f"the work directory {root} is not reachable for QEMU: {parent} is mode "
                f"{os.stat(parent).st_mode & 0o777:04o} (others may not enter it)",
                hint="QEMU runs as its own user (libvirt-qemu) under qemu:///system: pass --work-dir on a path "
                "every parent of which others may traverse (the default is /var/tmp)",
            )


def _work_dir(opts: BuildOptions, build_id: str) -> Path:
    root = opts.work_root or Path(os.environ.get("TMPDIR", "/var/tmp"))  # noqa: S108 - a private mkdtemp below
    root.mkdir(parents=True, exist_ok=True)
    if opts.libvirt_uri.endswith("/system"):
        _check_reachable(root)
    work = Path(tempfile.mkdtemp(prefix=f"imagebuilder-{build_id}-", dir=root))
    os.chmod(work, 0o755)  # noqa: S103 - QEMU (user libvirt-qemu under qemu:///system) must reach the files in it
    return work


class Build:
    def __init__(self, opts: BuildOptions) -> None:
        self.opts = opts
        self.started = time.time()
        self.defn: Definition = load_definition(opts.definition)
        lock_path = opts.lock or default_lock_path(self.defn.path)
        self.lock: Lock = load_lock(lock_path)
        self.cache = Cache(opts.cache_dir)
        self.base_cache = base.BaseCache(opts.base_cache or opts.cache_dir / "bases")
        base.check_disk_size(self.defn)
        # the build id names the inputs (the lock); this run's VMs and work directory get a unique name of their own
        self.identity = reproducible.identity(self.lock.file_sha256, self.lock.created_at)
        self.build_id = reproducible.build_id(
            self.defn.name, self.lock.file_sha256, self.identity.source_date_epoch
        )
        self.run_id = f"{self.build_id}-{secrets.token_hex(3)}"
        self.progress = ProgressLog(opts.progress, self.build_id, self.run_id)
        self.phases = Phases(self.progress)
        self.watchdog = dataclasses.replace(self.defn.watchdog, **opts.idle_limits)
        self.network = opts.network or self.defn.network
        self.paths: dict[str, Path] = {}
        self.extra_inputs: list[dict[str, Any]] = []

    # -- phases ------------------------------------------------------------------------------

    def check(self) -> None:
        check_lock(self.defn, self.lock)
        if (self.opts.out / self.build_id).exists():
            raise OutputError(
                f"{self.opts.out / self.build_id} exists: a build of this lock is published there (a build id names "
                "its lock: the same lock builds the same image)",
                hint=f"`imagebuilder rebuild {self.opts.out / self.build_id} --key <its signer's public key>` rebuilds it and "
                "compares; or remove the "
                "folder, or pass another --out",
            )
        log.info(
            "build %s: %s, lock %s (%d inputs)",
            self.build_id,
            self.defn.path,
            self.lock.path,
            len(self.lock.inputs),
        )

    def fetch(self) -> list[staging.StagedFile]:
        files = []
        for item in self.lock.inputs:
            if item.role == "compiled":
                continue
            fetched = self.cache.fetch(
                item.name, [item.url, *item.mirrors], sha256=item.sha256, size=item.size
            )
            files.append(staging.StagedFile(item, fetched.path))
        return files

    def wheelhouse(self, work: Path, files: list[staging.StagedFile]) -> tuple[list[Path], str, str]:
        defn = self.defn
        wheel_dir = work / "wheels"
        agent_wheel, self.agent_source = wheelhouse.build_agent_wheel(defn.agent.source, wheel_dir)
        name, version, all_requires = wheelhouse.wheel_metadata(agent_wheel)
        requires = wheelhouse.requirements_for(all_requires, defn.agent.extras)
        if tuple(requires) != self.lock.agent_requires:
            changed = sorted(set(requires) ^ set(self.lock.agent_requires))
            raise LockError(
                f"the agent's requirements changed since the lock: {', '.join(changed)}",
                hint=f"run `imagebuilder lock {defn.path}`",
            )
        self.extra_inputs.append(
            {
                "name": "nodeagent",
                "kind": "wheel",
                "version": version,
                "url": defn.agent.source.as_uri(),
                "sha256": outputs.sha256_file(agent_wheel),
                "size": agent_wheel.stat().st_size,
                "destination": defn.agent.venv,
                "verified_by": "built from the repository by this build",
            }
        )
        wheels = [agent_wheel]
        for staged in files:
            if staged.item.kind == "wheel" and staged.item.role == "wheelhouse":
                dest = wheel_dir / plain_name(staged.item.filename)
                staging.place(staged.path, dest)
                wheels.append(dest)
        for item in self.lock.by_role("compiled"):
            wheels.append(self._compiled(item, wheel_dir))
        pip_wheels = [w for w in wheels if w.name.startswith("pip-")]
        if not pip_wheels:
            raise LockError("the lock has no pip wheel", hint="agent.pip names the pip to install with")
        extras = ",".join(defn.agent.extras)
        requirement = f"{name}[{extras}]=={version}" if extras else f"{name}=={version}"
        report = wheelhouse.pip_report(
            [requirement, pip_wheels[0].name.split("-")[0]],
            defn.target,
            defn.architecture,
            find_links=[wheel_dir],
            no_index=True,
        )
        installs = {item.name for item in report}
        unneeded = sorted(
            i.key
            for i in self.lock.by_role("wheelhouse")
            if i.key.startswith("wheel/") and i.name not in installs
        )
        if unneeded:
            raise LockError(
                "the lock holds wheels that the agent does not install: " + ", ".join(unneeded),
                hint="a lock holds exactly the inputs its definition implies: run `imagebuilder lock` again and "
                "review the diff (a hand-edited or foreign lock is refused)",
            )
        log.info("wheelhouse: %d wheels install offline for Python %s", len(wheels), defn.target.python)
        return wheels, requirement, pip_wheels[0].name

    def _compiled(self, item: LockedInput, wheel_dir: Path) -> Path:
        dest = wheel_dir / plain_name(item.filename)
        hit = self.cache.lookup(item.sha256, size=item.size)
        if hit is not None:
            staging.place(hit, dest)
            return dest
        log.warning(
            "%s: the wheel compiled by `imagebuilder lock` is not in this cache; compiling it again "
            "from the locked sdist (needs the package index for its build requirements)",
            item.name,
        )
        sdist = self.lock.get(f"sdist/{item.name}")
        path = self.cache.fetch(sdist.name, [sdist.url], sha256=sdist.sha256, size=sdist.size).path
        wheelhouse.check_compile_host(self.defn.target, f"{item.name}=={item.version}")
        built = wheelhouse.compile_sdist(path, wheel_dir / "compiled", filename=sdist.filename)
        shutil.move(str(built), dest)
        self.extra_inputs.append(
            {
                "name": item.name,
                "kind": "wheel",
                "version": item.version,
                "url": f"sdist:sha256:{sdist.sha256}",
                "sha256": outputs.sha256_file(dest),
                "size": dest.stat().st_size,
                "destination": self.defn.agent.venv,
                "verified_by": "compiled by this build from the locked sdist",
            }
        )
        return dest

    def media(
        self,
        work: Path,
        files: list[staging.StagedFile],
        wheels: list[Path],
        requirement: str,
        pip_wheel: str,
    ) -> None:
        """The base medium and the base's key; the staging medium."""
        defn = self.defn
        self.files = files
        self.base_keys = closure.apt_closures(defn, files, self.lock.base_packages)
        staging.check_archives(files)
        base_tree = work / "base-medium"
        pip_path = next(w for w in wheels if w.name == pip_wheel)
        staging.base_tree(base_tree, defn, files, self.base_keys, pip_wheel=pip_path)
        self.paths["base_tree"] = base_tree
        iso_sha256 = next(f.item.sha256 for f in files if f.item.key == "iso")
        seed_user_data = self._user_data(webhook=None).encode()
        self.base_material = base.base_material(
            defn,
            iso_sha256=iso_sha256,
            user_data=seed_user_data.decode(),
            medium_digest=staging.tree_digest(base_tree),
        )
        # recorded on every path (the installed base's input), as rendered without the per-build webhook token: the
        # token is a credential of one run, never published, and the rest is what every build of the lock renders
        self.extra_inputs.append(
            {
                "name": "autoinstall-user-data",
                "kind": "seed",
                "version": "",
                "url": "",
                "sha256": hashlib.sha256(seed_user_data).hexdigest(),
                "size": len(seed_user_data),
                "destination": "",
                "verified_by": "rendered by this build from cloud-init/ (the digest of the rendering without the "
                "installer's per-build webhook token)",
            }
        )
        self.base_key = base.base_key(self.base_material)
        log.info("installed base key: %s", self.base_key)
        info: dict[str, object] = {
            # not the build id: nothing of one build's run goes into the image; the lock names its inputs
            "lock_sha256": self.lock.file_sha256,
            "name": defn.name,
            "kubernetes": self._kubernetes(),
            "agent": {"venv": defn.agent.venv, "requirement": requirement},
            "artifacts": {
                a.name: {"version": a.version, "destination": a.destination} for a in defn.artifacts
            },
        }
        tree = work / "staging"
        staging.build_tree(
            tree,
            defn,
            files,
            wheels=wheels,
            pip_wheel=pip_wheel,
            agent_requirement=requirement,
            image_info=info,
            base_keys=self.base_keys,
            seal=seal.plan_lines(self.identity),
        )
        self.paths["staging"] = media.make_iso(tree, work / "staging.iso", label=media.STAGING_LABEL)
        shutil.rmtree(tree)
        self.paths["staging"].chmod(0o644)

    def _user_data(self, *, webhook: str | None) -> str:
        return autoinstall.user_data(self.defn, webhook=webhook, data_port=DATA_PORT[self.defn.architecture])

    def installer_media(self, work: Path) -> None:
        """What only the installer needs: its kernel and initrd, the base medium, the NoCloud seed."""
        defn = self.defn
        iso = next(f.path for f in self.files if f.item.key == "iso")
        self.paths["iso"] = work / "installer.iso"
        staging.place(iso, self.paths["iso"])
        self.paths["kernel"], self.paths["initrd"] = work / "vmlinuz", work / "initrd"
        media.extract(
            self.paths["iso"],
            {defn.installer.kernel: self.paths["kernel"], defn.installer.initrd: self.paths["initrd"]},
        )
        self.paths["base_medium"] = media.make_iso(
            self.paths["base_tree"], work / "base-medium.iso", label=media.STAGING_LABEL
        )
        self.token = secrets.token_hex(16)
        webhook = autoinstall.webhook_url(self.token) if self.network == "listener" else None
        user_data = self._user_data(webhook=webhook)
        (work / "user-data").write_text(user_data, encoding="utf-8")
        # the installer's instance and host name: the base's (whichever build installs it), never this build's
        self.paths["seed"] = media.make_seed(
            user_data, autoinstall.meta_data(f"nodetrust-base-{self.base_key[:16]}"), work / "seed.iso"
        )
        for key in ("kernel", "initrd", "base_medium", "seed"):
            self.paths[key].chmod(0o644)

    def _connect(self, stack: contextlib.ExitStack) -> Connection:
        """libvirt for one build VM: closed with ``stack``, its versions recorded, orphans removed."""
        conn = Connection(self.opts.libvirt_uri)
        stack.callback(conn.close)
        self.versions = conn.versions()
        remove_orphans(conn)
        return conn

    def install(self, work: Path, accel: str) -> WatchResult:
        """The installer run: the installed base on ``disk.qcow2``, its boot files on the export disk."""
        defn = self.defn
        disk = work / "disk.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), defn.disk_size])
        export = work / "export.raw"
        with export.open("wb") as fh:
            fh.truncate(base.EXPORT_SIZE)
        loader = nvram_template = nvram = None
        if defn.firmware == "uefi":
            loader, nvram_template = find_firmware(defn.architecture)
            nvram = work / "nvram.fd"
        console, data = work / "installer-console.log", work / "installer-data.log"
        self.paths["installer_console"] = console
        with contextlib.ExitStack() as stack:
            listener = None
            if self.network == "listener":
                listener = EventListener(self.token)
                stack.callback(listener.close)
            conn = self._connect(stack)
            spec = DomainSpec(
                name=DOMAIN_PREFIX + self.run_id,
                build_id=self.build_id,
                arch=defn.architecture,
                accel=accel,
                memory_mib=defn.memory_mib,
                cpus=defn.cpus,
                kernel=self.paths["kernel"],
                initrd=self.paths["initrd"],
                cmdline=kernel_cmdline(
                    defn.architecture, "ds=nocloud", defn.installer.kernel_args, accel=accel
                ),
                disk=disk,
                cdrom=self.paths["iso"],
                readonly_disks=(self.paths["seed"], self.paths["base_medium"]),
                writable_disks=((export, staging.EXPORT_SERIAL),),
                console_log=console,
                data_log=data,
                firmware=defn.firmware,
                loader=loader,
                nvram_template=nvram_template,
                nvram=nvram,
                listener_port=listener.port if listener is not None else None,
                extra=owner_metadata(),
            )
            dom = stack.enter_context(conn.domain(domain_xml(spec)))
            log.info("installing the base (console: %s)", console)
            result = Watcher(
                dom, console, data, listener, self.watchdog, on_phase=self.phases.vm_phase("install")
            ).run()
            self.webhook_events = listener.received if listener is not None else 0
        self.paths["disk"] = disk
        self.paths["export"] = export
        return result

    def store_base(self, work: Path, result: WatchResult) -> base.Base:
        """The installed disk, its kernel and initrd and the installer's console into the base cache."""
        boot = result.boot or {}
        kernel, initrd = base.read_export(self.paths["export"], boot, work / "boot")
        root = boot.get("root", "")
        if not root.startswith("UUID="):
            raise BuildError(
                f"the installer reported no root file system UUID for the provisioning boot ({root!r})",
                hint="see the console log around the `export` step of stage.sh",
            )
        record = {
            "material": self.base_material,
            "root": root,
            "created_at": iso_time(time.time()),
            "build_id": self.build_id,
            "installer": {
                "events": result.events,
                "webhook_events": getattr(self, "webhook_events", 0),
                "network": self.network,
                "phases": [
                    {"name": p.name, "started_at": iso_time(p.started_at), "duration_s": p.duration_s}
                    for p in result.phases
                ],
                "installed_size": result.installed_size,
            },
        }
        stored = self.base_cache.store(
            self.base_key,
            disk=self.paths["disk"],
            kernel=kernel,
            initrd=initrd,
            console=self.paths["installer_console"],
            record=record,
        )
        self.paths["disk"].unlink()
        self.paths["export"].unlink()
        return stored

    def provision(self, work: Path, installed: base.Base, accel: str) -> WatchResult:
        """The provisioning boot: the base's own kernel on an overlay of the base, the staging plan."""
        defn = self.defn
        # libvirt labels a domain's kernel and initrd (chown to its QEMU user): never the cached files, copies
        kernel, initrd = work / "base-vmlinuz", work / "base-initrd.img"
        shutil.copyfile(installed.kernel, kernel)
        shutil.copyfile(installed.initrd, initrd)
        # The overlay names its backing file by path: a hard link in the work directory (a copy on another file
        # system) keeps this very base under it even if a concurrent `--full` build replaces the cached one, and
        # QEMU (libvirt-qemu) can reach it there. Declared relabel='no': QEMU reads it through its 0644 mode.
        backing = base.link_into(installed.disk, work / "base.qcow2")
        overlay = work / "image.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), str(overlay)],
            hint="qemu-img could not create the overlay on the installed base")  # fmt: skip
        console, data = work / "console.log", work / "data.log"
        self.paths["console"] = console
        with contextlib.ExitStack() as stack:
            conn = self._connect(stack)
            spec = DomainSpec(
                name=DOMAIN_PREFIX + self.run_id,
                build_id=self.build_id,
                arch=defn.architecture,
                accel=accel,
                memory_mib=defn.memory_mib,
                cpus=defn.cpus,
                kernel=kernel,
                initrd=initrd,
                cmdline=provision_cmdline(
                    defn.architecture, installed.root, staging.PROVISION_HOOK, accel=accel
                ),
                disk=overlay,
                cdrom=None,
                readonly_disks=(self.paths["staging"],),
                console_log=console,
                data_log=data,
                firmware="none",
                backing=backing,
                extra=owner_metadata(),
            )
            dom = stack.enter_context(conn.domain(domain_xml(spec)))
            log.info("provisioning boot of the base %s (console: %s)", installed.key[:16], console)
            result = ProvisionWatcher(
                dom, console, data, None, self.watchdog, on_phase=self.phases.vm_phase("provision")
            ).run()
        self.paths["disk"] = overlay
        return result

    def _credentials(self) -> dict[str, bytes]:
        """This run's credentials (label -> secret): the installer's webhook token, on a full build."""
        token = getattr(self, "token", "")
        return {"this build's webhook token": token.encode()} if token else {}

    def seal_image(self, work: Path, installed: base.Base) -> seal.Sealed:
        """The image's raw disk from the provisioned overlay, read offline: the lock's identifiers and time (every
        time stamp since the base's installer started is SOURCE_DATE_EPOCH, whenever that was); refused when a
        file still names the installer's identifiers or holds a credential of the build."""
        credentials = {**boottest.BUILDER_ADDRESSES, **self._credentials()}
        clamp = reproducible.TimeClamp.of(self.identity.source_date_epoch, installed.installer_started)
        if clamp.since < clamp.epoch:
            log.info("the installed base is older than the lock: every time stamp since its installer started "
                     "(%s) becomes SOURCE_DATE_EPOCH", iso_time(clamp.since))  # fmt: skip
        source = seal.read_provisioned(self.paths["disk"], work / "seal", clamp=clamp, needles=credentials)
        sealed = seal.seal(
            source, work / "image.raw", self.identity, work=work / "seal", credentials=credentials
        )
        if not self.opts.keep_work:  # kept, the seal can be run again on it
            self.paths["disk"].unlink()
        self.paths["disk"] = sealed.disk
        return sealed

    def _kubernetes(self) -> dict[str, Any]:
        kube = self.defn.kubernetes
        if kube is None:
            return {}
        return {
            "installed": kube.installed,
            "staged": list(kube.staged),
            "staged_paths": {v: kube.staged_dir(v) for v in kube.staged},
        }

    # -- the whole build -------------------------------------------------------------------------

    def run(self) -> BuildResult:
        """The whole build; its outcome is reported as the progress log's ``result``."""
        try:
            result = self._run()
        except KeyboardInterrupt:
            self.progress.emit("result", outcome="interrupted")
            raise
        except BuildError as exc:
            self.progress.emit("result", outcome="failed", exit_code=exc.exit_code)
            raise
        except BaseException:
            self.progress.emit("result", outcome="failed", exit_code=1)
            raise
        else:
            self.progress.emit("result", outcome="published", folder=str(result.folder))
            return result
        finally:
            self.progress.close()

    def _run(self) -> BuildResult:
        phase = self.phases.phase
        with phase("check"):
            self.check()
        with contextlib.ExitStack() as stack:
            work = _work_dir(self.opts, self.build_id)
            if self.opts.keep_work:
                log.info("work directory (kept): %s", work)
            else:
                stack.callback(_remove_tree, work)
            with phase("fetch"):
                files = self.fetch()
            with phase("wheelhouse"):
                wheels, requirement, pip_wheel = self.wheelhouse(work, files)
            with phase("media"):
                self.media(work, files, wheels, requirement, pip_wheel)
            installed, installer, accel = self._base(work)
            if accel is None:
                with phase("accelerator"):
                    accel = choose_accel(
                        self.opts.accel, installed.kernel, self.defn.architecture, self.cache.root
                    )
                    log.info("accelerator: %s (%s)", *accel)
            with phase("provision"):
                result = self.provision(work, installed, accel[0])
            with phase("seal"):
                sealed = self.seal_image(work, installed)
            partial = stack.enter_context(
                outputs.partial_folder(self.opts.out, self.build_id, run_id=self.run_id)
            )
            with phase("image"):
                image = outputs.convert_image(
                    self.paths["disk"], partial / f"{self.defn.name}.qcow2", compress=self.defn.compress,
                    source_format="raw",
                )  # fmt: skip
                self.paths["disk"].unlink()
            self._console(partial / "console.log", installed)
            manifest = buildmanifest.manifest(self, partial, result, image, accel, installed=installed,
                                              installer=installer)  # fmt: skip
            buildmanifest.add_reproducible(manifest, self, sealed)
            manifest["contents"] = boottest.image_contents(self.defn, files, requirement)
            if self.defn.architecture == "amd64":
                # before the boot test (which compares the booted image's event log with it) and SHA256SUMS
                with phase("boot-measurements"):
                    reference = bootmeasure.measure_image(
                        partial / f"{self.defn.name}.qcow2", work / "boot-measurements", image=self.build_id
                    )
                    path = bootmeasure.write(partial, reference)
                    manifest["outputs"].append(outputs.file_entry(path, bootmeasure.MEDIA_TYPE))
                    manifest["boot_measurements"] = {"file": path.name, "pcrs": sorted(reference.pcrs)}
                manifest["phases"].append(self.phases.records[-1])
            # before finish_folder (SHA256SUMS covers boot-test.json); a failed check publishes nothing
            if self.opts.boot_test:
                with phase("boot-test"):
                    boottest.check_partial_folder(
                        partial, manifest, image=partial / f"{self.defn.name}.qcow2", accel=accel[0],
                        work_root=work, libvirt_uri=self.opts.libvirt_uri, keep_work=self.opts.keep_work,
                        credentials=self._credentials(),
                    )  # fmt: skip
                manifest["phases"].append(self.phases.records[-1])
            outputs.write_json(partial / "manifest.json", manifest)
            outputs.finish_folder(partial, key=self.opts.key)
            folder = interrupt.commit(lambda: outputs.publish(partial, self.opts.out / self.build_id))
        log.info("build %s done in %.0f s: %s", self.build_id, time.time() - self.started, folder)
        return BuildResult(self.build_id, folder, manifest)

    def _base(self, work: Path) -> tuple[base.Base, WatchResult | None, tuple[str, str] | None]:
        """The installed base: from the cache (incremental), else installed now and cached (full)."""
        phase = self.phases.phase
        with phase("base"):
            found = None if self.opts.full else self.base_cache.lookup(self.base_key)
        if found is not None:
            log.info("incremental build on the cached base %s (%s)", self.base_key[:16], found.folder)
            return found, None, None
        # The lock is held while installing and storing the base, not while provisioning on it.
        with self.base_cache.locked(self.base_key):
            if not self.opts.full:  # another build may have installed it while this one waited
                found = self.base_cache.lookup(self.base_key)
                if found is not None:
                    return found, None, None
            log.info("full build: installing the base %s", self.base_key[:16])
            with phase("installer-media"):
                self.installer_media(work)
            with phase("accelerator"):
                accel = choose_accel(
                    self.opts.accel, self.paths["kernel"], self.defn.architecture, self.cache.root
                )
                log.info("accelerator: %s (%s)", *accel)
            with phase("install"):
                installer = self.install(work, accel[0])
            with phase("base-store"):
                installed = self.store_base(work, installer)
        return installed, installer, accel

    def _console(self, dest: Path, installed: base.Base) -> None:
        """The published console: the installer's (from the base, whichever build made it), then the
        provisioning boot's."""
        with dest.open("wb") as out:
            out.write(
                f"==== the installer (installed base {installed.key}, build {installed.record.get('build_id', '?')})\n".encode()
            )
            with installed.console.open("rb") as fh:
                shutil.copyfileobj(fh, out)
            out.write(f"\n==== the provisioning boot (build {self.build_id})\n".encode())
            with self.paths["console"].open("rb") as fh:
                shutil.copyfileobj(fh, out)


def _remove_tree(path: Path) -> None:
    """Remove the work directory to the end, even while a second Ctrl-C arrives."""
    with interrupt.deferred():
        shutil.rmtree(path, ignore_errors=True)


def build(opts: BuildOptions) -> BuildResult:
    return Build(opts).run()
