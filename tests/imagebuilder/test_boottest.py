"""The boot test without a VM: what the image must hold (from a manifest), the seed, the in-guest
checks that judge the image as shipped, the reports on the data port, the verdict, the command."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from imagebuilder import boottest, cli, media
from imagebuilder.boottest import EARLY, LATE, Check, Verdict, expect_from_manifest, verdict_from_reports
from imagebuilder.definition import load_definition
from imagebuilder.errors import BootTestFailed, OutputError
from imagebuilder.guest import boottest_check
from imagebuilder.lock import LockedInput
from imagebuilder.staging import StagedFile

REPO = Path(__file__).resolve().parents[2]
QCOW2_MAGIC = b"QFI\xfb" + bytes(60)


def _item(key: str, kind: str, path: Path, **extra: object) -> StagedFile:
    item = LockedInput(key=key, name=key.rsplit("/", 1)[-1], kind=kind, version="1.14.1", url="http://x/" + path.name,
                       sha256=hashlib.sha256(path.read_bytes()).hexdigest(), size=path.stat().st_size, role="stage",
                       filename=path.name, **extra)  # type: ignore[arg-type]  # fmt: skip
    return StagedFile(item, path)


@pytest.fixture
def manifest(payload_root: Path) -> dict[str, Any]:
    defn = load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )
    spire = payload_root / "spire/v1.14.1/spire-1.14.1-linux-amd64-musl.tar.gz"
    kubeadm = payload_root / "k8s/core:/stable:/v1.37/deb/amd64/kubeadm_1.37.2-1.1_amd64.deb"
    files = [
        _item("artifact/spire-agent", "tarball", spire, destination="/opt/spire/1.14.1/", strip_components=1),
        _item("kubernetes/1.37.2/kubeadm", "deb", kubeadm, destination="/opt/nodetrust/staged/kubernetes/1.37.2/"),
    ]  # fmt: skip
    return {
        "build_id": "fixture-node-1",
        "name": "fixture-node",
        "architecture": "amd64",
        "packages": [
            {"name": "bash", "version": "5.2.15-2+b7", "architecture": "amd64", "extra": "dropped"},
            {"name": "kubeadm", "version": "1.36.3-1.1", "architecture": "amd64"},
        ],
        "contents": boottest.image_contents(defn, files, "nodetrust[agent]==0.1.0"),
        "outputs": [{"name": "fixture-node.qcow2", "media_type": "application/x-qemu-disk"}],
    }


def test_expect_json_comes_from_the_manifest(manifest: dict[str, Any], payload_root: Path) -> None:
    expect = expect_from_manifest(manifest)
    assert expect["data_port"] == "/dev/ttyS1"
    assert expect["build_id"] == "fixture-node-1"
    assert expect["kubernetes"] == {
        "installed": "1.36.3",
        "packages": ["kubeadm", "kubelet", "kubectl"],
        "staged": {
            "1.34.2": "/opt/nodetrust/staged/kubernetes/1.34.2/",
            "1.35.3": "/opt/nodetrust/staged/kubernetes/1.35.3/",
            "1.37.2": "/opt/nodetrust/staged/kubernetes/1.37.2/",
        },
    }
    assert expect["agent"] == {
        "distribution": "nodetrust",
        "version": "0.1.0",
        "venv": "/opt/nodeagent/venv",
        "config_dir": "/etc/nodeagent",
        "units": ["nodeagent.service", "nodeagent-reattest.timer"],
        "service": "nodeagent.service",
    }
    assert expect["packages"][0] == {"name": "bash", "version": "5.2.15-2+b7", "architecture": "amd64"}
    by_path = {e["path"]: e for e in expect["files"]}
    kubeadm = by_path["/opt/nodetrust/staged/kubernetes/1.37.2/kubeadm_1.37.2-1.1_amd64.deb"]
    deb = payload_root / "k8s/core:/stable:/v1.37/deb/amd64/kubeadm_1.37.2-1.1_amd64.deb"
    assert kubeadm == {
        "group": "kubernetes 1.37.2 (staged)",
        "path": kubeadm["path"],
        "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
        "mode": "0644",
    }
    spire = [e for e in expect["files"] if e["group"] == "spire-agent 1.14.1"]
    assert any(e["path"] == "/opt/spire/1.14.1/bin/spire-agent" and e["mode"] == "0755" for e in spire)
    unit = by_path["/usr/lib/systemd/system/nodeagent.service"]
    assert (
        unit["sha256"] == hashlib.sha256((REPO / "agent/systemd/nodeagent.service").read_bytes()).hexdigest()
    )
    names = boottest.expected_checks(expect)
    assert names[:4] == [
        "image/machine-id",
        "image/ssh-host-keys",
        "image/agent-config",
        "image/build-leftovers",
    ]
    assert {"files/spire-agent 1.14.1", "files/kubernetes 1.37.2 (staged)", "files/nodeagent units"} <= set(
        names
    )
    assert names[-2:] == ["packages", "cloud-init"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m: m.pop("contents"), "contents"),
        (lambda m: m["contents"]["agent"].pop("venv"), "contents.agent.venv"),
        (lambda m: m["contents"]["kubernetes"].pop("staged"), "contents.kubernetes.staged"),
        (lambda m: m["contents"]["files"].append({"group": "x", "path": "/x"}), "contents.files[")
        ,
        (lambda m: m.update(architecture="riscv64"), "riscv64"),
    ],
)  # fmt: skip
def test_a_manifest_without_what_the_test_needs(manifest: dict[str, Any], change: Any, named: str) -> None:
    change(manifest)
    with pytest.raises(OutputError, match=r"manifest\.json") as err:
        expect_from_manifest(manifest)
    assert named in err.value.message


@pytest.mark.subprocess  # xorriso writes and reads the ISO
def test_the_seed(manifest: dict[str, Any], tmp_path: Path, cloud_init_schema: None) -> None:
    expect = expect_from_manifest(manifest)
    seed = boottest.make_seed(expect, tmp_path / "seed.iso", label="fixture-node")
    names = ("user-data", "meta-data", boottest.SCRIPT, boottest.EXPECT)
    media.extract(seed, {name: tmp_path / "out" / name for name in names})
    out = tmp_path / "out"
    user_data = (out / "user-data").read_text()
    assert user_data.startswith("#cloud-config\n")
    cloud = json.loads(user_data.split("\n", 1)[1])
    relay_start, command = cloud["bootcmd"]  # the relay to the host's NTP server first, then the checker
    assert relay_start[:2] == ["sh", "-c"] and "systemd-run --unit=nodetrust-relay.service" in relay_start[2]
    assert relay_start[2].endswith("10.0.2.100:8080 --udp 123 --default-route")
    # the time servers where a node-pool release writes them, for the image's time client
    assert expect["node"]["host"]["time_sync"]["servers"] == ["127.0.0.1"]
    assert cloud["write_files"] == [{"path": "/etc/systemd/timesyncd.conf.d/50-nodetrust.conf", "owner": "root:root",
                                     "permissions": "0644", "content": "[Time]\nNTP=127.0.0.1\n"}]  # fmt: skip
    from imagebuilder.release.cloudinit import validate_schema

    validate_schema(out / "user-data")  # cloud-init's own schema accepts it
    assert command[:2] == ["sh", "-c"]
    assert f"mount -r -L CIDATA {boottest.SEED_MOUNT}" in command[2].replace("$d", boottest.SEED_MOUNT)
    assert f"python3 $d/{boottest.SCRIPT} early $d" in command[2]
    assert "instance-id: boottest-fixture-node-" in (out / "meta-data").read_text()
    assert (out / boottest.SCRIPT).read_text() == (REPO / "imagebuilder/guest/boottest_check.py").read_text()
    assert json.loads((out / boottest.EXPECT).read_text()) == expect


# -- the checker's judgement of the image as shipped (run here on a fake root) ---------------------


def _root(tmp_path: Path, *, machine_id: str, key_age_s: float | None) -> Path:
    root = tmp_path / "root"
    (root / "etc/ssh").mkdir(parents=True)
    (root / "etc/machine-id").write_text(machine_id)
    old = time.time() - 3600
    os.utime(root / "etc/machine-id", (old, old))
    if key_age_s is not None:
        key = root / "etc/ssh/ssh_host_ed25519_key"
        key.write_text("key")
        os.utime(key, (time.time() - key_age_s, time.time() - key_age_s))
    return root


def test_the_checker_fails_a_shipped_machine_id_and_ssh_host_key(tmp_path: Path) -> None:
    root = _root(tmp_path, machine_id="0123456789abcdef0123456789abcdef\n", key_age_s=3600)
    btime = time.time() - 60
    machine_id = boottest_check.check_machine_id(root, btime)
    assert not machine_id["ok"] and "shipped a machine id (01234567..." in machine_id["detail"]
    keys = boottest_check.check_ssh_host_keys(root, btime)
    assert not keys["ok"] and "ssh_host_ed25519_key" in keys["detail"]


def test_the_checker_passes_an_image_generalised_for_this_boot(tmp_path: Path) -> None:
    root = _root(tmp_path, machine_id="", key_age_s=10)  # a key made at this boot
    btime = time.time() - 60
    (root / "run/systemd").mkdir(parents=True)
    (root / "run/systemd/first-boot").touch()
    assert boottest_check.check_machine_id(root, btime)["ok"]
    keys = boottest_check.check_ssh_host_keys(root, btime)
    assert keys["ok"] and "1 made at this boot" in keys["detail"]


def test_the_checker_fails_an_image_that_kept_what_the_build_used(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "var/lib").mkdir(parents=True)
    clean = boottest_check.check_build_leftovers(root)
    assert clean["ok"] and "none of 7" in clean["detail"]
    (root / "var/lib/nodetrust-build/pip").mkdir(parents=True)
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/policy-rc.d").symlink_to("/nonexistent")  # a dangling link counts too
    left = boottest_check.check_build_leftovers(root)
    assert not left["ok"]
    assert (
        left["detail"]
        == "the image ships what the build used: /var/lib/nodetrust-build, /usr/sbin/policy-rc.d"
    )


# -- reports and the verdict ---------------------------------------------------------------------


def _report_lines(tmp_path: Path, expect: dict[str, Any], failing: tuple[str, ...] = ()) -> list[str]:
    """The data port as the real checker writes it (its report function, into a file)."""
    port = tmp_path / "data.log"
    guest = {**expect, "data_port": str(port), "console": str(tmp_path / "console.log")}
    checks = [
        boottest_check._check(n, n not in failing, f"detail of {n}")
        for n in boottest.expected_checks(expect)
    ]
    early = [c for c in checks if c["name"].startswith("image/")]
    lines = []
    boottest_check.report(guest, EARLY, early, {"boot_time": 1.0})
    lines += port.read_text().splitlines()
    boottest_check.report(guest, LATE, checks, {"boot_time": 1.0, "kernel": "6.1.0-fixture"})
    lines += port.read_text().splitlines()
    return [line + "\r" for line in lines]  # the serial port's line endings


def test_a_complete_passing_report(manifest: dict[str, Any], tmp_path: Path) -> None:
    expect = expect_from_manifest(manifest)
    verdict = verdict_from_reports(["[    1.0] noise", *_report_lines(tmp_path, expect)], expect)
    assert verdict.passed, verdict.render()
    assert [c.name for c in verdict.checks] == boottest.expected_checks(expect)
    assert verdict.kernel == "6.1.0-fixture"
    assert "PASS agent/service: detail of agent/service" in (tmp_path / "console.log").read_text()


def test_a_failed_check_fails_the_verdict(manifest: dict[str, Any], tmp_path: Path) -> None:
    expect = expect_from_manifest(manifest)
    verdict = verdict_from_reports(_report_lines(tmp_path, expect, failing=("image/machine-id",)), expect)
    assert not verdict.passed
    assert [c.name for c in verdict.failed] == ["image/machine-id"]
    text = verdict.render()
    assert "FAIL image/machine-id: detail of image/machine-id" in text
    assert text.endswith(f"boot test FAILED: 1 of {len(verdict.checks)} checks failed: image/machine-id")
    assert verdict.to_json()["passed"] is False


def test_a_digest_mismatch_fails_closed(manifest: dict[str, Any], tmp_path: Path) -> None:
    expect = expect_from_manifest(manifest)
    lines = _report_lines(tmp_path, expect)
    lines[1] = (
        lines[1].replace('"ok":false', '"ok":true').replace("detail of packages", "detail of packageS")
    )
    verdict = verdict_from_reports(lines, expect)
    assert not verdict.passed
    names = [c.name for c in verdict.failed]
    assert "report/digest" in names and "report/late" in names
    assert "does not match its JSON" in next(c.detail for c in verdict.failed if c.name == "report/digest")


def test_a_missing_report_fails_closed(manifest: dict[str, Any], tmp_path: Path) -> None:
    expect = expect_from_manifest(manifest)
    early_only = _report_lines(tmp_path, expect)[:1]
    verdict = verdict_from_reports(early_only, expect, console_tail="[  99.0] login:")
    assert [c.name for c in verdict.failed] == ["report/late"]
    assert "--- last console lines ---\n[  99.0] login:" in verdict.render()
    nothing = verdict_from_reports([], expect, problem="the boot test: the VM ran longer than 1800 s")
    assert {c.name for c in nothing.failed} == {"report/early", "report/late", "boot"}
    assert not Verdict([]).passed  # no checks at all is never a pass


def test_a_report_missing_an_expected_check_fails(manifest: dict[str, Any], tmp_path: Path) -> None:
    expect = expect_from_manifest(manifest)
    fewer = {**expect, "files": [e for e in expect["files"] if not e["group"].startswith("spire-agent")]}
    verdict = verdict_from_reports(_report_lines(tmp_path, fewer), expect)
    assert [c.name for c in verdict.failed] == ["report/complete"]
    assert "files/spire-agent 1.14.1" in verdict.failed[0].detail


def test_parse_report_ignores_other_lines_and_rejects_non_json() -> None:
    assert boottest.parse_report("NODETRUST-BOOTTESTING x y") == ("", None, "")
    text = "not json"
    marker, report, problem = boottest.parse_report(
        f"{LATE} {hashlib.sha256(text.encode()).hexdigest()} {text}"
    )
    assert (marker, report) == (LATE, None) and "not JSON" in problem


# -- the build's hook ---------------------------------------------------------------------------------


def _verdict(*failing: str) -> Verdict:
    checks = [Check(n, n not in failing, "d") for n in ("image/machine-id", "agent/service", "cloud-init")]
    return Verdict(checks, image="fixture-node.qcow2", accel="tcg", duration_s=100.0)


def test_the_build_hook_writes_the_report_into_the_unpublished_folder(
    manifest: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boottest, "run_boot_test", lambda opts: _verdict())
    partial = tmp_path / ".partial-b1"
    partial.mkdir()
    boottest.check_partial_folder(partial, manifest, image=partial / "x.qcow2", accel="tcg", work_root=tmp_path,
                                  libvirt_uri="test:///default")  # fmt: skip
    report = partial / boottest.REPORT
    assert json.loads(report.read_text())["passed"] is True
    entry = next(o for o in manifest["outputs"] if o["name"] == boottest.REPORT)
    assert entry["sha256"] == hashlib.sha256(report.read_bytes()).hexdigest()
    assert manifest["boot_test"] == {"passed": True, "report": boottest.REPORT, "checks": 3}


def test_the_build_hook_publishes_nothing_on_a_failed_check(
    manifest: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boottest, "run_boot_test", lambda opts: _verdict("agent/service"))
    partial = tmp_path / ".partial-b1"
    partial.mkdir()
    with pytest.raises(BootTestFailed, match="agent/service") as err:
        boottest.check_partial_folder(partial, manifest, image=partial / "x.qcow2", accel="tcg",
                                      work_root=tmp_path, libvirt_uri="test:///default")  # fmt: skip
    assert err.value.exit_code == 12 and "--no-test" in err.value.hint
    assert not (partial / boottest.REPORT).exists()


# -- the command ----------------------------------------------------------------------------------------


@pytest.fixture
def folder(manifest: dict[str, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "fixture-node.qcow2").write_bytes(QCOW2_MAGIC)
    return folder


def _no_vm(opts: boottest.BootTestOptions) -> Verdict:
    raise AssertionError("the command booted a VM on bad input")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda f: f / "missing", "no such file or folder"),
        (lambda f: (f / "manifest.json").unlink() or f, "no such manifest"),
        (lambda f: (f / "manifest.json").unlink() or (f / "manifest.json").mkdir() or f, "cannot read the manifest"),
        (lambda f: (f / "manifest.json").write_text("{") and f, "the manifest is not JSON"),
        (lambda f: (f / "fixture-node.qcow2").write_bytes(b"raw") and f, "not a QCOW2 image"),
        (lambda f: (f / "fixture-node.qcow2").unlink() or f, "the manifest's image is not in the folder"),
        (lambda f: (f / "manifest.json").write_text('{"outputs": []}') and f, "exactly one .qcow2"),
        (lambda f: (f / "manifest.json").write_text(
            json.dumps({"outputs": [{"name": "fixture-node.qcow2", "media_type": "application/x-qemu-disk"}]})
        ) and f, "contents is missing"),
        (lambda f: f / "fixture-node.qcow2" if (f / "manifest.json").unlink() is None else f, "no manifest.json next"),
        # the boot reference the manifest names: listed once, beside it, with the listed digest
        (lambda f: _with_measurements(f, _on_disk(f), b"{}", listed=b"other"), "is not the one the manifest lists"),
        (lambda f: _with_measurements(f, _on_disk(f), b"{}", drop=True), "not beside it"),
        (lambda f: (f / "manifest.json").write_text(json.dumps({**_on_disk(f), "boot_measurements": {"file": "../x"}}))
         and f, "which its outputs do not list"),
    ],
)  # fmt: skip
def test_the_command_on_bad_input(
    folder: Path,
    setup: Any,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(boottest, "run_boot_test", _no_vm)
    target = setup(folder)
    assert cli.main(["test", str(target), "--accel", "tcg"]) == 8
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("failing", "code"), [((), 0), (("cloud-init",), 1)])
def test_the_command_exit_status_and_reports(
    folder: Path,
    tmp_path: Path,
    failing: tuple[str, ...],
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[boottest.BootTestOptions] = []

    def fake(opts: boottest.BootTestOptions) -> Verdict:
        seen.append(opts)
        return _verdict(*failing)

    monkeypatch.setattr(boottest, "run_boot_test", fake)
    report = tmp_path / "report.json"
    assert (
        cli.main(
            ["test", str(folder), "--accel", "tcg", "--report", str(report), "--work-dir", str(tmp_path)]
        )
        == code
    )
    assert seen[0].image == folder / "fixture-node.qcow2" and seen[0].accel == "tcg"
    out = capsys.readouterr().out
    assert ("boot test passed" in out) == (code == 0)
    assert ("FAIL cloud-init: d" in out) == (code == 1)
    assert json.loads(report.read_text())["passed"] is (code == 0)
    assert sorted(p.name for p in folder.iterdir()) == [
        "fixture-node.qcow2",
        "manifest.json",
    ]  # never written
    assert cli.main(["test", str(folder / "fixture-node.qcow2"), "--accel", "tcg", "--json"]) == code
    assert json.loads(capsys.readouterr().out)["checks"][2]["ok"] is (code == 0)


def test_the_command_never_writes_into_the_signed_folder(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(boottest, "run_boot_test", _no_vm)
    assert cli.main(["test", str(folder), "--accel", "tcg", "--report", str(folder / "boot-test.json")]) == 8
    assert "whose files SHA256SUMS and the signature cover" in capsys.readouterr().err


def test_a_crashing_late_part_still_reports_and_powers_off(
    manifest: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect = expect_from_manifest(manifest)
    port = tmp_path / "data.log"
    (tmp_path / boottest.EXPECT).write_text(
        json.dumps({**expect, "data_port": str(port), "console": str(tmp_path / "console.log")})
    )
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(boottest_check, "STATE", tmp_path)  # no early.json: the late part crashes

    def fake_run(*argv: str, timeout: float = 0) -> tuple[int, str]:
        ran.append(argv)
        return 0, ""

    monkeypatch.setattr(boottest_check, "_run", fake_run)
    assert boottest_check.main(["nodetrust-boottest.py", "late"]) == 1
    assert ran == [("systemctl", "poweroff", "--no-block")]
    verdict = verdict_from_reports(port.read_text().splitlines(), expect)
    assert not verdict.passed
    assert verdict.failed[0].name == "checker" and "early.json" in verdict.failed[0].detail
    assert verdict.failed[-1].name == "report/complete"


def test_the_swtpm_socket_path_fits_a_unix_socket(tmp_path: Path) -> None:
    from imagebuilder.bootvm import BootSpec, BootVm

    spec = BootSpec(image=tmp_path / "x.qcow2", seed=None, accel="tcg")
    short = BootVm(spec, tmp_path / "vm", label="t")
    assert short._socket_path(tmp_path / "vm") == tmp_path / "vm" / "swtpm.sock"
    deep = tmp_path / ("d" * 120)
    vm = BootVm(spec, deep, label="t")
    path = vm._socket_path(deep)
    assert (
        len(str(path).encode()) < 108
        and path.parent.is_dir()
        and path.parent.stat().st_mode & 0o777 == 0o711
    )
    vm.__exit__(None, None, None)
    assert not path.parent.exists()


def _on_disk(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    return data


def _with_measurements(
    folder: Path, manifest: dict[str, Any], data: bytes, *, listed: bytes | None = None, drop: bool = False
) -> Path:
    if not drop:  # drop: the manifest names the file, the folder lacks it
        (folder / "boot-measurements.json").write_bytes(data)
    digest = hashlib.sha256(data if listed is None else listed).hexdigest()
    manifest = {
        **manifest,
        "outputs": [*manifest["outputs"], {"name": "boot-measurements.json", "sha256": digest}],
        "boot_measurements": {"file": "boot-measurements.json", "pcrs": [4, 8, 9]},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_command_gives_the_boot_test_the_measurements_beside_the_manifest_it_names(
    folder: Path, manifest: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the image tested with --manifest still gets the build's boot reference (from beside the
    manifest), checked against the digest the manifest lists."""
    _with_measurements(folder, manifest, b'{"reference": 1}')
    seen: list[boottest.BootTestOptions] = []

    def fake(opts: boottest.BootTestOptions) -> Verdict:
        seen.append(opts)
        return _verdict()

    monkeypatch.setattr(boottest, "run_boot_test", fake)
    copy = tmp_path / "copy.qcow2"
    copy.write_bytes(QCOW2_MAGIC)
    assert cli.main(["test", str(copy), "--manifest", str(folder / "manifest.json"), "--accel", "tcg"]) == 0
    assert cli.main(["test", str(folder), "--accel", "tcg"]) == 0
    assert [o.measurements for o in seen] == [b'{"reference": 1}'] * 2
