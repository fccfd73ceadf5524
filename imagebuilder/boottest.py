"""The boot test: boot a built image once and let it check itself from the inside.

``imagebuilder test`` (and ``imagebuilder build`` before it publishes, unless ``--no-test``)
boots the image in a throw-away VM (:mod:`imagebuilder.bootvm`: UEFI, an swtpm TPM, user-mode
networking with no route out, the image behind a copy-on-write overlay, never written) with a
NoCloud seed (label ``CIDATA``) that holds:

* ``user-data``: a ``bootcmd`` that mounts the seed and runs the checker's ``early`` part;
* ``nodetrust-boottest.py``: the in-guest checker (:mod:`imagebuilder.guest.boottest_check`,
  standard library only, run by the image's own ``python3``);
* ``nodecheck.py``: its node checks (:mod:`imagebuilder.guest.nodecheck`), imported by the checker;
* ``expect.json``: what the image must hold, derived from the build's ``manifest.json``
  (:func:`expect_from_manifest`): the Kubernetes version installed and held and the staged
  versions with their folders, every staged file with its digest and mode (the SPIRE agent,
  its TPM plugin, OVN-Kubernetes, the staged Kubernetes debs, the agent's units), the agent's
  venv, version, configuration folder and enabled units, the package list, and the node: the host
  configuration, the container runtime and its imported images, the GPU stack
  (:func:`imagebuilder.nodespec.expectations`).

The guest reports on its data port (the second serial port, a file on the host): one line per
part, ``NODETRUST-BOOTTEST-EARLY <sha256> <json>`` and ``NODETRUST-BOOTTEST <sha256> <json>``,
and a ``PASS``/``FAIL`` line per check on its console; then it powers off. The host fails
closed (:func:`verdict_from_reports`): a missing report, a digest that does not match its JSON,
a check the expectation asks for that the report lacks, a boot that hangs or runs too long: each
is a failed check, with the last console lines.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from imagebuilder import imagescan, media, nodespec, outputs
from imagebuilder.autoinstall import WEBHOOK_PREFIX
from imagebuilder.bootvm import BootSpec, BootVm
from imagebuilder.definition import Definition
from imagebuilder.domain import DATA_PORT, GUEST_FORWARD
from imagebuilder.errors import BootTestFailed, OutputError, VmError
from imagebuilder.guest import relay
from imagebuilder.guest.nodecheck import check_names as node_check_names
from imagebuilder.sntp import SntpServer
from imagebuilder.staging import StagedFile, staged_files

log = logging.getLogger(__name__)

EARLY = "NODETRUST-BOOTTEST-EARLY"
LATE = "NODETRUST-BOOTTEST"
SCRIPT = "nodetrust-boottest.py"
NODE_SCRIPT = "nodecheck.py"  # imported by SCRIPT, from the same folder
EXPECT = "expect.json"
REPORT = "boot-test.json"
REPORT_MEDIA_TYPE = "application/json"
SEED_MOUNT = "/run/nodetrust-boottest-seed"
#: Sized for TCG on a shared 2-core machine (a boot of the fixture image takes about 2 minutes).
IDLE_S = 600.0
TOTAL_S = 1800.0
POWEROFF_S = 120.0
CONSOLE_TAIL = 40
NTP_PORT = 123
GUEST_NTP_SERVER = "127.0.0.1"  # the guest's end of the relay to the host's NTP server (imagebuilder.sntp)
CREDENTIALS_CHECK = "image/build-credentials"
#: made by the host: the credential search before the boot, the event log's comparison after it
HOST_CHECKS = (CREDENTIALS_CHECK, "measured-boot/reference")
#: what every build's credentials include: the address only a build's installer reports to (with its token)
BUILDER_ADDRESSES = {"the builder's webhook address (with a build's token)": WEBHOOK_PREFIX.encode()}
EARLY_CHECKS = ("image/machine-id", "image/ssh-host-keys", "image/agent-config", "image/build-leftovers")


# -- what the image must hold ---------------------------------------------------------------------


def image_contents(defn: Definition, files: Sequence[StagedFile], agent_requirement: str) -> dict[str, Any]:
    """The manifest's ``contents``: what the staging plan put into the image, for the boot test."""
    name, _, version = agent_requirement.partition("==")
    units = [Path(u.destination).name for u in defn.agent.units if u.enable]
    services = [u for u in units if u.endswith(".service")]
    kube = defn.kubernetes
    return {
        "kubernetes": {
            "installed": kube.installed,
            "packages": list(kube.packages),
            "staged": {v: kube.staged_dir(v) for v in kube.staged},
        }
        if kube is not None
        else {},
        "files": staged_files(defn, files),
        "agent": {
            "distribution": name.split("[")[0],
            "version": version,
            "venv": defn.agent.venv,
            "config_dir": defn.agent.config_dir,
            "units": units,
            "service": services[0] if services else "",
        },
        "node": nodespec.expectations(defn.node),
    }


def _need(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise OutputError(
            f"manifest.json: {where}{key} is missing or not a {kind.__name__}",
            hint="the boot test needs the `contents` an imagebuilder build writes into the manifest: "
            "rebuild the image with this imagebuilder",
        )
    return value


def expect_from_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``expect.json`` for the checker, from a build manifest; :class:`OutputError` names a missing field."""
    contents = _need(manifest, "contents", dict, "")
    agent = _need(contents, "agent", dict, "contents.")
    for key in ("distribution", "version", "venv", "config_dir", "service"):
        _need(agent, key, str, "contents.agent.")
    _need(agent, "units", list, "contents.agent.")
    kube = _need(contents, "kubernetes", dict, "contents.")
    if kube:
        _need(kube, "installed", str, "contents.kubernetes.")
        _need(kube, "packages", list, "contents.kubernetes.")
        _need(kube, "staged", dict, "contents.kubernetes.")
    files = _need(contents, "files", list, "contents.")
    for i, entry in enumerate(files):
        if (
            not isinstance(entry, dict)
            or not {"group", "path"} <= set(entry)
            or not ("link" in entry or "sha256" in entry)
        ):
            raise OutputError(f"manifest.json: contents.files[{i}] needs group, path and sha256 or link")
    packages = _need(manifest, "packages", list, "")
    arch = _need(manifest, "architecture", str, "")
    if arch not in DATA_PORT:
        raise OutputError(f"manifest.json: architecture {arch!r} is not one the builder knows")
    node = json.loads(json.dumps(contents.get("node") or {}))
    time_sync = (node.get("host") or {}).get("time_sync")
    if isinstance(time_sync, dict):
        time_sync["servers"] = [GUEST_NTP_SERVER]  # the boot test's, as a node-pool release names a site's
    return {
        "build_id": str(manifest.get("build_id", "")),
        # a build that predicted its boot measurements: the guest reports its event log, the host compares
        "measured_boot": bool(manifest.get("boot_measurements")),
        "data_port": DATA_PORT[arch],
        "console": "/dev/console",
        "kubernetes": kube,
        "files": files,
        "agent": agent,
        "node": node,
        "packages": [
            {"name": p["name"], "version": p["version"], "architecture": p["architecture"]} for p in packages
        ],
    }


def expected_checks(expect: Mapping[str, Any]) -> list[str]:
    """The names of the checks a complete report holds for ``expect``."""
    names = [*EARLY_CHECKS, CREDENTIALS_CHECK]
    if expect.get("kubernetes"):
        names += ["kubernetes/installed", "kubernetes/held", "kubernetes/staged"]
    names += [f"files/{group}" for group in sorted({str(e["group"]) for e in expect.get("files", [])})]
    names += ["agent/venv", "agent/units", "agent/tpm", "agent/service"]
    names += node_check_names(expect.get("node") or {})
    names += ["packages", "cloud-init"]
    if expect.get("measured_boot"):
        names += ["measured-boot/event-log", "measured-boot/reference"]
    return names


# -- the seed --------------------------------------------------------------------------------------


def checker_source(name: str = "boottest_check.py") -> str:
    return resources.files("imagebuilder.guest").joinpath(name).read_text(encoding="utf-8")


def user_data(expect: Mapping[str, Any] | None = None) -> str:
    """cloud-config: the relay to the host's NTP server and the checker's early part (``bootcmd``), and
    the time servers where a node-pool release writes them (``write_files``)."""
    command = (
        f"d={SEED_MOUNT}; mkdir -p $d && mount -r -L CIDATA $d && python3 $d/{SCRIPT} early $d "
        "|| echo 'nodetrust-boottest: FAIL the boot test seed could not be mounted or run' > /dev/console; "
        "umount $d 2>/dev/null; true"
    )
    cloud: dict[str, Any] = {"bootcmd": [["sh", "-c", command]]}
    time_sync = (((expect or {}).get("node") or {}).get("host") or {}).get("time_sync") or {}
    if time_sync.get("servers"):
        cloud["bootcmd"].insert(0, relay.bootcmd(GUEST_FORWARD, udp_ports=[NTP_PORT], default_route=True))
        path, content = nodespec.time_servers_file(str(time_sync["client"]), list(time_sync["servers"]))
        cloud["write_files"] = [
            {"path": path, "owner": "root:root", "permissions": "0644", "content": content}
        ]
    return "#cloud-config\n" + json.dumps(cloud, indent=2) + "\n"


def meta_data(label: str) -> str:
    return f"instance-id: boottest-{label}-{secrets.token_hex(4)}\nlocal-hostname: boottest\n"


def make_seed(expect: Mapping[str, Any], out: Path, *, label: str = "image") -> Path:
    """The NoCloud seed ISO: user-data, meta-data, the checker and expect.json."""
    with tempfile.TemporaryDirectory(prefix="imagebuilder-boottest-seed-") as tmp:
        tree = Path(tmp)
        (tree / "user-data").write_text(user_data(expect), encoding="utf-8")
        (tree / "meta-data").write_text(meta_data(label), encoding="utf-8")
        (tree / SCRIPT).write_text(checker_source(), encoding="utf-8")
        (tree / NODE_SCRIPT).write_text(checker_source("nodecheck.py"), encoding="utf-8")
        (tree / EXPECT).write_text(json.dumps(expect, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        seed = media.make_iso(tree, out, label=media.SEED_LABEL)
    seed.chmod(0o644)
    return seed


# -- the verdict -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class Verdict:
    checks: list[Check]
    image: str = ""
    build_id: str = ""
    accel: str = ""
    duration_s: float = 0.0
    kernel: str = ""
    console_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": "https://nodetrust.dev/boot-test/v1",
            "passed": self.passed,
            "image": self.image,
            "build_id": self.build_id,
            "accelerator": self.accel,
            "duration_s": self.duration_s,
            "kernel": self.kernel,
            "checks": [c.to_json() for c in self.checks],
        }
        if not self.passed:
            data["console_tail"] = self.console_tail
        return data

    def render(self) -> str:
        lines = [f"{'PASS' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        if self.passed:
            lines.append(
                f"boot test passed: {len(self.checks)} checks ({self.duration_s:.0f} s, {self.accel})"
            )
        else:
            if self.console_tail:
                lines += ["--- last console lines ---", self.console_tail, "---"]
            names = ", ".join(c.name for c in self.failed) or "no checks reported"
            lines.append(
                f"boot test FAILED: {len(self.failed)} of {len(self.checks)} checks failed: {names}"
            )
        return "\n".join(lines)


def parse_report(line: str) -> tuple[str, dict[str, Any] | None, str]:
    """``(marker, report, problem)`` of one data-port line; ``marker`` is empty for other lines.

    The report is None (and ``problem`` says why) when its digest does not match or it is not JSON."""
    marker, _, rest = line.strip().partition(" ")
    if marker not in (EARLY, LATE):
        return "", None, ""
    digest, _, text = rest.partition(" ")
    actual = hashlib.sha256(text.encode()).hexdigest()
    if digest != actual:
        return (
            marker,
            None,
            f"{marker} report's sha256 {digest[:16]}... does not match its JSON ({actual[:16]}...)",
        )
    try:
        report = json.loads(text)
    except ValueError as exc:
        return marker, None, f"{marker} report is not JSON: {exc}"
    if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
        return marker, None, f"{marker} report has no list of checks"
    return marker, report, ""


def _checks(report: Mapping[str, Any]) -> list[Check]:
    out = []
    for item in report.get("checks", []):
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            out.append(Check(item["name"], item.get("ok") is True, str(item.get("detail", ""))))
        else:
            out.append(Check("report", False, f"a malformed check in the report: {item!r}"[:300]))
    return out


def verdict_from_reports(
    lines: Sequence[str], expect: Mapping[str, Any], *, problem: str = "", console_tail: str = ""
) -> Verdict:
    """The verdict from the data port's lines, failing closed: every check ``expect`` asks for must be
    reported and pass, both reports must be present with matching digests."""
    reports: dict[str, dict[str, Any]] = {}
    checks: list[Check] = []
    for line in lines:
        marker, report, bad = parse_report(line)
        if bad:
            checks.append(Check("report/digest" if "sha256" in bad else "report/format", False, bad))
        elif marker and report is not None:
            reports[marker] = report
    late, early = reports.get(LATE), reports.get(EARLY)
    if late is not None:
        checks += _checks(late)
    elif early is not None:
        checks += _checks(early)
    if early is None:
        checks.append(
            Check("report/early", False, f"no valid {EARLY} report on the data port: the checker's early part "
                  "did not run at cloud-init's bootcmd (is cloud-init installed and enabled in the image?)")
        )  # fmt: skip
    if late is None:
        checks.append(
            Check("report/late", False, f"no valid {LATE} report on the data port: the late checks did not run "
                  "(multi-user.target or cloud-init's final stage was not reached?)")
        )  # fmt: skip
    elif early is not None and _checks(early) != _checks(late)[: len(_checks(early))]:
        checks.append(
            Check("report/early", False, "the late report does not carry the early checks unchanged")
        )
    reported = {c.name for c in checks}
    missing = [n for n in expected_checks(expect) if n not in reported and n not in HOST_CHECKS]
    if missing and late is not None:
        checks.append(
            Check("report/complete", False, "checks missing from the report: " + ", ".join(missing))
        )
    if problem:
        checks.append(Check("boot", False, problem))
    verdict = Verdict(checks, build_id=str(expect.get("build_id", "")), console_tail=console_tail)
    if late is not None:
        verdict.kernel = str(late.get("kernel", ""))
        if isinstance(late.get("event_log"), str):
            verdict.extra["event_log"] = late["event_log"]
    return verdict


def corroborate_boot(verdict: Verdict, measurements_raw: bytes) -> None:
    """The build's predicted boot measurements against the event log the booted image reported: one check,
    failed with the PCR and the event that differ (the build then publishes nothing)."""
    from imagebuilder.bootmeasure import corroborate
    from protocol.errors import ProtocolError
    from protocol.measurements import load

    encoded = verdict.extra.pop("event_log", "")
    if not encoded:
        return  # measured-boot/event-log already failed (or the report is missing): nothing to compare
    try:
        reference = load(measurements_raw)
        problems = corroborate(reference, base64.b64decode(encoded, validate=True))
    except (ProtocolError, ValueError) as exc:
        problems = [f"cannot compare: {exc}"]
    detail = (
        f"the booted image measured what the build predicted in PCRs {', '.join(str(p) for p in sorted(reference.pcrs))}"
        if not problems
        else "the booted image measured something else than the build predicted: " + "; ".join(problems[:4])
    )
    verdict.checks.append(Check("measured-boot/reference", not problems, detail))


# -- running it ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootTestOptions:
    image: Path
    manifest: Mapping[str, Any]
    accel: str  # kvm | tcg (already chosen)
    work_root: Path
    libvirt_uri: str = "qemu:///system"
    keep_work: bool = False
    idle_s: float = IDLE_S
    total_s: float = TOTAL_S
    memory_mib: int = 2048
    cpus: int = 2
    measurements: bytes | None = (
        None  # the build's boot-measurements.json: the guest's event log must match it
    )
    # label -> secret: credentials of the build the image must not carry (the build's own, or --credentials)
    credentials: Mapping[str, bytes] = field(default_factory=dict)


def credentials_check(image: Path, work: Path, credentials: Mapping[str, bytes]) -> Check:
    """``image/build-credentials``: none of ``credentials`` (and no builder address) in any allocated byte of the
    image, plain or base64 (:mod:`imagebuilder.imagescan`). The secrets are never printed, only their labels."""
    secrets = {**BUILDER_ADDRESSES, **credentials}
    found = imagescan.scan_image(image, work, secrets)
    if not found:
        return Check(CREDENTIALS_CHECK, True, f"none of {len(secrets)} credential(s) and builder addresses in the "
                     f"image's bytes ({', '.join(sorted(secrets))})")  # fmt: skip
    where = "; ".join(f"{label} in {', '.join(places[:6])}" for label, places in sorted(found.items()))
    return Check(CREDENTIALS_CHECK, False, f"the image carries a credential of the build: {where}")


def run_boot_test(opts: BootTestOptions) -> Verdict:
    """Boot ``opts.image`` once and return the verdict (raises only when the VM cannot be started)."""
    if not opts.image.is_file():
        raise OutputError(f"{opts.image}: no such image", hint="pass a build folder or its .qcow2")
    expect = expect_from_manifest(opts.manifest)
    opts.work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="boottest-", dir=opts.work_root))
    os.chmod(work, 0o755)  # noqa: S103 - QEMU (another user) reads the overlay and the seed here
    started = time.monotonic()
    lines: list[str] = []
    problem = ""
    tail = ""
    stack = contextlib.ExitStack()
    try:
        credentials = credentials_check(opts.image, work / "scan", opts.credentials)
        log.info(
            "boot test: %s %s: %s",
            "PASS" if credentials.ok else "FAIL",
            credentials.name,
            credentials.detail,
        )
        seed = make_seed(expect, work / "seed.iso", label=str(opts.manifest.get("name", "image")))
        ntp = stack.enter_context(SntpServer.start())
        forward = stack.enter_context(relay.host_relay({}, {NTP_PORT: ntp.port}))
        spec = BootSpec(
            image=opts.image,
            seed=seed,
            accel=opts.accel,
            arch=str(opts.manifest.get("architecture", "amd64")),
            memory_mib=opts.memory_mib,
            cpus=opts.cpus,
            listener_port=forward,
        )

        def on_console(line: str) -> None:
            if "nodetrust-boottest:" in line:  # the checks come again in the verdict: progress only
                said = line[line.find("nodetrust-boottest:") :]
                level = logging.DEBUG if said.split()[1:2] in (["PASS"], ["FAIL"]) else logging.INFO
                log.log(level, "%s", said)

        def on_data(line: str) -> bool:
            lines.append(line)
            if line.startswith(EARLY + " "):
                log.info("boot test: the early checks reported; waiting for the late ones")
            return line.startswith(LATE + " ")

        with BootVm(spec, work / "vm", label="boottest", libvirt_uri=opts.libvirt_uri) as vm:
            log.info("boot test: booting %s (%s; console: %s)", opts.image.name, opts.accel, vm.console)

            try:
                vm.follow(
                    on_console=on_console, on_data=on_data, idle_s=opts.idle_s, total_s=opts.total_s,
                    what="the boot test",
                )  # fmt: skip
                vm.wait_stopped(POWEROFF_S)
            except VmError as exc:
                problem = exc.message.split("\n", 1)[0]
            tail = _console_tail(vm.console)
        log.debug("boot test: the NTP server answered %d request(s)", ntp.answered)
    finally:
        stack.close()
        if opts.keep_work:
            log.info("boot test work directory (kept): %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    verdict = verdict_from_reports(lines, expect, problem=problem, console_tail=tail)
    verdict.checks.insert(len([c for c in verdict.checks if c.name in EARLY_CHECKS]), credentials)
    if expect["measured_boot"]:
        if opts.measurements is None:
            verdict.checks.append(Check("measured-boot/reference", False, "the manifest names boot measurements "
                                        "but the build's boot-measurements.json was not given to the boot test"))  # fmt: skip
        else:
            corroborate_boot(verdict, opts.measurements)
    verdict.image = opts.image.name
    verdict.accel = opts.accel
    verdict.duration_s = round(time.monotonic() - started, 1)
    return verdict


def _console_tail(path: Path, n: int = CONSOLE_TAIL) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(line.replace("\r", "") for line in text.splitlines()[-n:])


def write_report(path: Path, verdict: Verdict) -> None:
    outputs.write_json(path, verdict.to_json())


# -- the build's hook --------------------------------------------------------------------------------


def check_partial_folder(
    partial: Path,
    manifest: dict[str, Any],
    *,
    image: Path,
    accel: str,
    work_root: Path,
    libvirt_uri: str,
    keep_work: bool = False,
    credentials: Mapping[str, bytes] | None = None,
) -> Verdict:
    """Run the boot test on a build's unpublished folder; write ``boot-test.json`` into it and list it in
    ``manifest``'s outputs (so SHA256SUMS and the signature cover it). Raises :class:`BootTestFailed`
    when a check failed: the build then publishes nothing."""
    reference = partial / "boot-measurements.json"
    verdict = run_boot_test(
        BootTestOptions(
            image=image, manifest=manifest, accel=accel, work_root=work_root, libvirt_uri=libvirt_uri,
            keep_work=keep_work, measurements=reference.read_bytes() if reference.is_file() else None,
            credentials=dict(credentials or {}),
        )
    )  # fmt: skip
    for line in verdict.render().splitlines():
        log.info("boot test: %s", line)
    if not verdict.passed:
        raise BootTestFailed(
            "the boot test failed, nothing was published:\n" + verdict.render(),
            hint="fix what the failed checks name (docs/building-images.md, `Boot test`); "
            "--no-test skips the boot test",
        )
    write_report(partial / REPORT, verdict)
    manifest["outputs"] = [o for o in manifest.get("outputs", []) if o.get("name") != REPORT]
    manifest["outputs"].append(outputs.file_entry(partial / REPORT, REPORT_MEDIA_TYPE))
    manifest["boot_test"] = {"passed": True, "report": REPORT, "checks": len(verdict.checks)}
    return verdict
