"""``imagebuilder release`` and the imager on what it makes: a release folder the imager verifies with
the pinned key, whose image lands on the hinted disk with the node-pool cloud-init in a CIDATA seed.

Oracles: cloud-init's own ``schema`` command (Debian's package, unpacked), the real ``kubeadm config
validate`` (the peers build; that test is in the peers tier), blkid and mtools reading the seed back.
"""

from __future__ import annotations

import base64
import dataclasses
import email
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuilder.errors import BuildError
from imagebuilder.release import cloudinit
from imagebuilder.trust import write_trust_outputs
from imager import digest
from imager.errors import ImagerError, Reason
from imager.gpt import read_gpt
from imager.params import Params
from protocol.release import Image
from tests.imager.conftest import BUILD_ID, TARGET_SERIAL, Keys, Machine, has_partition_table, sh
from tests.imager.server import Fault, ReleaseServer, tls_certificate
from tests.support.measuredboot import fixture_boot

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]


def _kubeadm() -> str:
    from tests.support.peers import binary

    return str(binary("kubeadm"))


def _release(
    tmp_path: Path, build: Path, keys: dict[str, Keys], server: ReleaseServer, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``imagebuilder release`` as an operator runs it (``extra``: more flags, e.g. ``--kubeadm PATH``)."""
    imager = tmp_path / "imager-env"
    imager.mkdir(exist_ok=True)
    (imager / "vmlinuz").write_bytes(b"MZ kernel stand-in")
    (imager / "initrd.img").write_bytes(b"070701 initramfs stand-in")
    bundle = tls_certificate(tmp_path)[0]
    argv = [sys.executable, "-m", "imagebuilder.cli", "release", str(build), "--build-key", str(keys["release"].pub),
            "--key", str(keys["release"].key), "--out", str(tmp_path / "srv"), "--base-url", f"{server.url}/",
            "--imager", str(imager), "--pool", "h200", "--server", "10.0.2.2:8081", "--trust-domain", "nodetrust.test",
            "--bundle", str(bundle), "--ntp", "10.0.2.2", "--control-plane-endpoint", "cp.nodetrust.test:6443",
            "--hint", "model=fixture_nvme*", "--events-url", f"{server.url}/events",
            "--raw", "--json", *extra]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def test_a_release_folder_is_signed_validated_and_never_changed(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    build = build_folder(raw=False, name="node-build")
    made = _release(tmp_path, build, keys, server)
    assert made.returncode == 0, made.stderr
    out = json.loads(made.stdout)
    folder = Path(out["folder"])
    assert folder.name == "k8s-1.36.3-amd64-h200" and out["key"] == keys["release"].fingerprint
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["boot.ipxe", "entry.ipxe", "imager.vmlinuz", "imager.initrd", "node-debian-12.qcow2",
                            "node-debian-12.raw", "worker.user-data", "control-plane-init.user-data",
                            "control-plane-join.user-data", "release.json", "signing-key.pub", "SHA256SUMS",
                            "signature.dsse.json", "node-debian-12.qcow2.sha256-chunks",
                            "node-debian-12.raw.sha256-chunks"])  # fmt: skip
    subprocess.run(["sha256sum", "--check", "--strict", "--quiet", "SHA256SUMS"], cwd=folder, check=True)
    # each image's chunk list is what coreutils computes for its 64 MiB slices, and release.json names it;
    # its BLAKE3 is what b3sum (the BLAKE3 authors' own tool) prints for it
    entries = json.loads((folder / "release.json").read_text())["images"]
    listed = {i["name"]: i["chunks"] for i in entries}
    b3sum = subprocess.run(
        ["b3sum", "--no-names", *listed], cwd=folder, capture_output=True, text=True, check=True
    )
    assert [i["blake3"] for i in entries] == b3sum.stdout.split()
    for image, chunks in listed.items():
        assert chunks["name"] == f"{image}.sha256-chunks" and chunks["chunk_size"] == 64 << 20
        sliced = subprocess.run(["split", "-b", str(64 << 20), "--filter=sha256sum", image], cwd=folder,
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert (folder / chunks["name"]).read_text() == "".join(
            line.split()[0] + "\n" for line in sliced.splitlines()
        )
    # the imager's own verification, pinning the key as the boot script does
    verify = subprocess.run([sys.executable, "-m", "imager", "verify", "--cmdline", "/dev/null", "--release", out["url"],
                             "--key", out["key"], "--keys-dir", str(tmp_path / "none"), "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["kind"] == "release"
    boot = (folder / "boot.ipxe").read_text()
    release = json.loads((folder / "release.json").read_text())
    assert (
        f"nodeimager.key={out['key']}" in boot
        and f"nodeimager.image=sha256:{release['images'][0]['sha256']}" in boot
    )
    assert release["imager"]["kernel"]["sha256"] in boot and release["kubernetes"]["version"] == "1.36.3"
    # the worker cloud-init only writes configuration
    worker = yaml.safe_load((folder / "worker.user-data").read_text())
    assert list(worker) == ["write_files"]
    agent = yaml.safe_load(
        next(f["content"] for f in worker["write_files"] if f["path"] == cloudinit.AGENT_CONFIG)
    )
    assert agent == {"server": "10.0.2.2:8081", "trust_domain": "nodetrust.test", "pool": "h200",
                     "bundle": cloudinit.AGENT_BUNDLE}  # fmt: skip
    # the control plane: kubeadm v1beta4 with the release's version, which the real kubeadm accepts
    init = yaml.safe_load((folder / "control-plane-init.user-data").read_text())
    docs = list(yaml.safe_load_all(init["write_files"][0]["content"]))
    assert [d["kind"] for d in docs] == ["InitConfiguration", "ClusterConfiguration"]
    assert docs[1]["kubernetesVersion"] == "v1.36.3" and init["runcmd"][0][:2] == ["kubeadm", "init"]
    join = yaml.safe_load((folder / "control-plane-join.user-data").read_text())
    assert "controlPlane" in yaml.safe_load(join["write_files"][0]["content"])
    # never changed in place
    again = _release(tmp_path, build, keys, server)
    assert again.returncode == 8 and "never changed in place" in again.stderr


def test_a_tampered_build_gives_no_release(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    build = build_folder(raw=False, name="node-build")
    with (build / "node-debian-12.qcow2").open("r+b") as fh:
        fh.seek(100000)
        fh.write(b"\xff")
    made = _release(tmp_path, build, keys, server)
    assert made.returncode == 5 and "sha256 mismatch" in made.stderr
    assert not [p for p in (tmp_path / "srv").iterdir() if p.name.startswith(("k8s-", ".k8s-"))]


def _with_boot_measurements(build: Path, key: Path, raw: bytes) -> str:
    """Add a boot-measurements.json to a signed build folder the way a build lists it, and sign it again."""
    (build / "boot-measurements.json").write_bytes(raw)
    manifest = json.loads((build / "manifest.json").read_text())
    digest = hashlib.sha256(raw).hexdigest()
    manifest["outputs"].append({"name": "boot-measurements.json", "sha256": digest, "size": len(raw),
                                "media_type": "application/vnd.nodetrust.boot-measurements+json"})  # fmt: skip
    manifest["boot_measurements"] = {"file": "boot-measurements.json", "pcrs": [4, 8, 9]}
    (build / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    write_trust_outputs(build, key=key)
    return digest


def test_a_release_carries_the_builds_boot_reference_values_for_the_pools(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    """The build's boot-measurements.json is a release file, signed with the rest, and release.json names it
    with the PCRs it checks: what a server's pool pins (its sha256) comes from the release an operator ships."""
    build = build_folder(raw=False, name="node-build")
    reference = tmp_path / "reference.json"
    fixture_boot().write_reference(reference, image=BUILD_ID)
    digest = _with_boot_measurements(build, keys["release"].key, reference.read_bytes())
    made = _release(tmp_path, build, keys, server)
    assert made.returncode == 0, made.stderr
    folder = Path(json.loads(made.stdout)["folder"])
    release = json.loads((folder / "release.json").read_text())
    assert release["boot_measurements"] == {"name": "boot-measurements.json", "sha256": digest,
                                            "size": reference.stat().st_size, "pcrs": [4, 8, 9]}  # fmt: skip
    assert (folder / "boot-measurements.json").read_bytes() == reference.read_bytes()
    assert f"{digest}  boot-measurements.json" in (folder / "SHA256SUMS").read_text()
    statement = json.loads(
        base64.b64decode(json.loads((folder / "signature.dsse.json").read_text())["payload"])
    )
    assert {"name": "boot-measurements.json", "digest": {"sha256": digest}} in statement["subject"]


def test_a_release_refuses_boot_measurements_that_do_not_load(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    build = build_folder(raw=False, name="node-build")
    _with_boot_measurements(build, keys["release"].key, b'{"schema": 1, "pcrs": "none"}')
    made = _release(tmp_path, build, keys, server)
    assert made.returncode == 8 and "the build's boot measurements do not load" in made.stderr, made.stderr
    assert not [p for p in (tmp_path / "srv").iterdir() if p.name.startswith(("k8s-", ".k8s-"))]


def test_cloud_init_schema_and_our_checks_refuse_what_they_should(
    cloud_init_schema: None, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.user-data"
    bad.write_text("#cloud-config\nwrite_files: 3\n")
    with pytest.raises(BuildError, match="schema validation refuses"):
        cloudinit.validate_schema(bad)
    with pytest.raises(BuildError, match="only writes configuration"):
        cloudinit.check_worker("#cloud-config\nwrite_files: []\npackages: [htop]\n")
    with pytest.raises(BuildError):
        cloudinit.check_kubeadm(
            [{"apiVersion": "kubeadm.k8s.io/v1beta3", "kind": "JoinConfiguration"}], ["JoinConfiguration"]
        )


def test_a_release_carries_the_pool_profile_for_the_nodes_own_checks(
    cloud_init_schema: None, tmp_path: Path
) -> None:
    """The node judges the kubelet skew against the pool's control plane only if it has the pool's profile."""
    bundle = tls_certificate(tmp_path)[0].read_text()
    profile = "name: domino-gpu\npreset: domino-gpu\nnode: {control_plane_version: '1.35'}\n"
    pool = cloudinit.PoolConfig(server="10.0.2.2:8081", trust_domain="nodetrust.test", pool="domino-gpu",
                                bundle_pem=bundle, ntp=("10.0.2.2",), profile=profile)  # fmt: skip
    text = cloudinit.worker_user_data(pool)
    cloudinit.check_worker(text)
    (tmp_path / "user-data").write_text(text)
    cloudinit.validate_schema(tmp_path / "user-data")
    files = {f["path"]: f for f in yaml.safe_load(text)["write_files"]}
    assert files[cloudinit.AGENT_POOL_PROFILE]["content"] == profile
    assert files[cloudinit.TIMESYNCD]["content"] == "[Time]\nNTP=10.0.2.2\n"
    with pytest.raises(BuildError, match="not a pool profile"):
        cloudinit.worker_user_data(
            cloudinit.PoolConfig(
                server="10.0.2.2:8081",
                trust_domain="t.test",
                pool="p",
                bundle_pem=bundle,
                profile="name: p\nnode: {control_plane_versio: '1.35'}\n",
            )
        )


def test_a_release_writes_the_sites_configuration_files_and_agent_settings(
    cloud_init_schema: None, tmp_path: Path
) -> None:
    """``--file`` and ``--agent-setting``: configuration only, under /etc, bounded, never the release's own files."""
    from imagebuilder.commands.release import _files, _settings

    bundle = tls_certificate(tmp_path)[0].read_text()
    conflist = '{"cniVersion": "1.0.0", "name": "site", "plugins": [{"type": "bridge"}]}\n'
    (tmp_path / "site.conflist").write_text(conflist)
    files = _files([f"/etc/cni/net.d/10-site.conflist={tmp_path / 'site.conflist'}"])
    settings = _settings(["devid_enrol=true", "spire_agent_unit=spire-agent.service", "deadline_s=900"])
    assert settings == {"devid_enrol": True, "spire_agent_unit": "spire-agent.service", "deadline_s": 900}
    pool = cloudinit.PoolConfig(server="10.0.2.2:8081", trust_domain="nodetrust.test", pool="cpu",
                                bundle_pem=bundle, agent_settings=settings, files=files)  # fmt: skip
    text = cloudinit.worker_user_data(pool)
    cloudinit.check_worker(text)
    (tmp_path / "user-data").write_text(text)
    cloudinit.validate_schema(tmp_path / "user-data")
    written = {f["path"]: f for f in yaml.safe_load(text)["write_files"]}
    assert written["/etc/cni/net.d/10-site.conflist"] == {
        "path": "/etc/cni/net.d/10-site.conflist", "permissions": "0644", "owner": "root:root", "content": conflist,
    }  # fmt: skip
    agent = yaml.safe_load(written[cloudinit.AGENT_CONFIG]["content"])
    assert agent["devid_enrol"] is True and agent["deadline_s"] == 900 and agent["pool"] == "cpu"

    def refused(match: str, **change: Any) -> None:
        base: dict[str, Any] = {
            "server": "10.0.2.2:8081",
            "trust_domain": "t.test",
            "pool": "p",
            "bundle_pem": bundle,
        }
        with pytest.raises(BuildError, match=match):
            cloudinit.worker_user_data(cloudinit.PoolConfig(**{**base, **change}))

    refused("under /etc", files=(("/usr/lib/systemd/system/evil.service", "[Service]\n"),))
    refused("under /etc", files=(("/etc/../usr/bin/kubeadm", "x"),))
    refused("under /etc", files=(("etc/relative", "x"),))
    refused("writes that file itself", files=((cloudinit.AGENT_CONFIG, "server: evil:1\n"),))
    refused("given twice", files=(("/etc/a.conf", "1"), ("/etc/a.conf", "2")))
    refused("at most", files=(("/etc/big.conf", "x" * (cloudinit.MAX_FILE_BYTES + 1)),))
    refused("in all", files=tuple((f"/etc/f{i}.conf", "x" * cloudinit.MAX_FILE_BYTES) for i in range(9)))
    refused("NUL", files=(("/etc/bin.conf", "a\0b"),))
    refused("from its own option", agent_settings={"server": "evil:1"})
    refused("not a setting name", agent_settings={"Bad-Key": 1})
    refused("at most 4096", agent_settings={"pool_profile": "x" * 5000})
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    with pytest.raises(BuildError, match="not UTF-8"):
        _files([f"/etc/x.conf={tmp_path / 'binary'}"])
    with pytest.raises(BuildError, match="not DEST=SRC"):
        _files(["/etc/x.conf"])
    with pytest.raises(BuildError, match="No such file"):
        _files([f"/etc/x.conf={tmp_path / 'absent'}"])


def test_the_time_servers_go_where_the_images_time_client_reads_them(
    cloud_init_schema: None, tmp_path: Path
) -> None:
    """An image that runs chrony gets its servers in chrony's sources folder, not in timesyncd's (which
    chrony never reads); the manifest says which client the image runs."""
    from imagebuilder.release.folder import _time_client

    bundle = tls_certificate(tmp_path)[0].read_text()
    pool = cloudinit.PoolConfig(server="10.0.2.2:8081", trust_domain="nodetrust.test", pool="cpu",
                                bundle_pem=bundle, ntp=("10.0.0.1", "ntp2.site.example"))  # fmt: skip
    text = cloudinit.worker_user_data(pool, "chrony")
    cloudinit.check_worker(text)
    (tmp_path / "user-data").write_text(text)
    cloudinit.validate_schema(tmp_path / "user-data")
    files = {f["path"]: f for f in yaml.safe_load(text)["write_files"]}
    assert cloudinit.TIMESYNCD not in files
    chrony = files["/etc/chrony/sources.d/50-nodetrust.sources"]
    assert chrony["content"] == "server 10.0.0.1 iburst\nserver ntp2.site.example iburst\n"
    assert (chrony["permissions"], chrony["owner"]) == ("0644", "root:root")
    chrony_image = {"contents": {"node": {"host": {"time_sync": {"client": "chrony"}}}}}
    assert _time_client(chrony_image) == "chrony"
    assert _time_client({"contents": {"node": {}}}) == _time_client({}) == "systemd-timesyncd"
    with pytest.raises(BuildError, match="no time client 'ntpd'"):
        cloudinit.worker_user_data(pool, "ntpd")


def _published(
    tmp_path: Path,
    build_folder: Callable[..., Path],
    keys: dict[str, Keys],
    server: ReleaseServer,
    **params: Any,
) -> tuple[Path, dict[str, Any], Params]:
    """A release of a fresh build folder, served; the imager's parameters for it (key and image pinned)."""
    made = _release(tmp_path, build_folder(raw=False, name="node-build"), keys, server)
    assert made.returncode == 0, made.stderr
    out = json.loads(made.stdout)
    folder = Path(out["folder"])
    release = json.loads((folder / "release.json").read_text())
    pinned = Params(release=out["url"], key=out["key"], image=f"sha256:{release['images'][0]['sha256']}",
                    hints={"serial": TARGET_SERIAL}, reboot="no", **params)  # fmt: skip
    return folder, release, pinned


def test_the_imager_writes_a_release_and_seeds_its_node_pool_cloud_init(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    machine: Callable[..., Machine], tmp_path: Path,
) -> None:  # fmt: skip
    folder, _release_json, params = _published(
        tmp_path, build_folder, keys, server, agent={"node_name": "gpu-rack3-u12"}
    )
    m = machine()
    result = m.image(params, keys_dir=None)
    target = m.node("nvme0n1")
    assert result.seed_partition is not None
    seed = next(e for e in read_gpt(target).entries if e.number == result.seed_partition)
    label = (
        sh("blkid", "-p", "-o", "value", "-s", "LABEL", "--offset", str(seed.offset), str(target))
        .stdout.decode()
        .strip()
    )
    assert label == "CIDATA"
    user_data = sh("mtype", "-i", f"{target}@@{seed.offset}", "::user-data").stdout
    meta = yaml.safe_load(sh("mtype", "-i", f"{target}@@{seed.offset}", "::meta-data").stdout)
    assert meta["local-hostname"] == "gpu-rack3-u12" and meta["instance-id"].startswith("nodetrust-")
    # user-data: the signed worker cloud-init unchanged, then the per-machine agent drop-in, as cloud-init reads it
    message = email.message_from_bytes(user_data)
    payloads = [
        p.get_payload(decode=True) for p in message.walk() if p.get_content_type() == "text/cloud-config"
    ]
    parts = [p for p in payloads if isinstance(p, bytes)]
    assert message.is_multipart() and len(parts) == 2
    assert parts[0] == (folder / "worker.user-data").read_bytes()
    netboot = yaml.safe_load(parts[1])
    assert netboot["write_files"][0]["path"] == "/etc/nodeagent/config.d/50-netboot.yaml"
    assert yaml.safe_load(netboot["write_files"][0]["content"]) == {"node_name": "gpu-rack3-u12"}
    (tmp_path / "netboot.cfg").write_bytes(parts[1])
    cloudinit.validate_schema(tmp_path / "netboot.cfg")
    # the release names the events URL: the server received the whole story
    assert [e["event"] for e in server.recorder.events] == [
        "verified",
        "disk-chosen",
        "written",
        "boot-entry",
        "done",
    ]
    assert server.recorder.events[1]["disk"]["serial"] == TARGET_SERIAL


def test_the_raw_image_is_checked_by_its_signed_chunk_list_which_is_itself_checked(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    machine: Callable[..., Machine], tmp_path: Path,
) -> None:  # fmt: skip
    folder, release, params = _published(tmp_path, build_folder, keys, server, format="raw", digest="sha256")
    raw = next(i for i in release["images"] if i["format"] == "raw")
    listed = f"/{folder.name}/{raw['chunks']['name']}"
    # a chunk list that is not the signed one: refused before the image is fetched or the disk written
    server.faults[listed] = Fault(flip=10)
    m = machine()
    error = m.refused(params, keys_dir=None)
    assert error.reason == Reason.digest_mismatch and raw["chunks"]["name"] in error.message, error.message
    assert f"/{folder.name}/{raw['name']}" not in [p for _, p, _ in server.recorder.requests]
    assert not has_partition_table(m.node("nvme0n1"))
    # the signed list: the image is written, every chunk checked
    del server.faults[listed]
    m = machine()
    result = m.image(params, keys_dir=None)
    assert result.written is not None and result.written.sha256 == raw["sha256"]
    gets = [p for m_, p, _ in server.recorder.requests if m_ == "GET"]
    assert gets.index(listed) < len(gets) - 1 - gets[::-1].index(f"/{folder.name}/{raw['name']}")
    assert result.written.digest == "sha256"


@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
def test_by_default_the_image_is_verified_with_its_signed_blake3(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    machine: Callable[..., Machine], tmp_path: Path, fmt: str,
) -> None:  # fmt: skip
    """``nodeimager.digest=auto``: the release signs a BLAKE3 beside the SHA-256, and the imager verifies with it
    (no chunk list fetched); a flipped byte is refused by it, naming it, and nothing bootable is left."""
    folder, release, params = _published(tmp_path, build_folder, keys, server, format=fmt)
    image = next(i for i in release["images"] if i["format"] == fmt)
    path = f"/{folder.name}/{image['name']}"
    server.faults[path] = Fault(flip=(3 << 20) + 5)
    m = machine()
    error = m.refused(params, keys_dir=None)
    assert error.reason == Reason.digest_mismatch and error.message.startswith(
        f"{image['name']}: blake3 mismatch"
    )
    assert image["blake3"] in error.message and not has_partition_table(m.node("nvme0n1"))
    del server.faults[path]
    m = machine()
    result = m.image(params, keys_dir=None)
    assert result.written is not None and result.written.digest == "blake3"
    assert result.as_json()["digest"] == "blake3"  # what `nodeimager run --json` prints
    assert result.written.sha256 == image["sha256"]
    assert f"/{folder.name}/{image['chunks']['name']}" not in [p for _, p, _ in server.recorder.requests]
    # a release that signs no BLAKE3 cannot be made to look as if it did: digest=blake3 is refused
    unsigned = dataclasses.replace(_view_image(image), blake3=None)
    with pytest.raises(ImagerError) as caught:
        digest.choose("blake3", unsigned)
    assert caught.value.reason == Reason.release_format and "signs no BLAKE3" in caught.value.message
    assert digest.choose("auto", unsigned).algorithm == "sha256"


def _view_image(entry: dict[str, Any]) -> Image:
    return Image(entry["name"], entry["sha256"], entry["size"], entry["format"], entry.get("virtual_size"),
                 None, entry.get("blake3"))  # fmt: skip


@pytest.mark.peers
def test_the_real_kubeadm_accepts_the_control_plane_documents_and_refuses_a_broken_one(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    """``imagebuilder release --kubeadm``: `kubeadm config validate` (the peers' kubeadm v1.36.3) on both."""
    made = _release(
        tmp_path, build_folder(raw=False, name="node-build"), keys, server, "--kubeadm", _kubeadm()
    )
    assert made.returncode == 0, made.stderr
    broken = tmp_path / "kubeadm.yaml"
    broken.write_text(
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: banana\n"
    )
    with pytest.raises(BuildError, match="kubeadm config validate"):
        cloudinit.validate_kubeadm(broken, _kubeadm())


def test_rebuild_verifies_the_folder_with_the_publishers_key_before_anything(
    cloud_init_schema: None, build_folder: Callable[..., Path], server: ReleaseServer, keys: dict[str, Keys],
    tmp_path: Path,
) -> None:  # fmt: skip
    """`imagebuilder rebuild --key`: a build or release folder whose signature or files do not verify is refused
    with exit 5 before any build starts (the digests it would compare are the publisher's, or nothing)."""
    from imagebuilder.commands.rebuild import read_published, verify_published
    from imagebuilder.errors import VerificationError

    build = build_folder(raw=False, name="node-build")
    made = _release(tmp_path, build, keys, server)
    assert made.returncode == 0, made.stderr
    release = Path(json.loads(made.stdout)["folder"])
    verify_published(read_published(build), keys["release"].pub)
    verify_published(read_published(release), keys["release"].pub)
    for folder in (build, release):
        with pytest.raises(VerificationError):
            verify_published(read_published(folder), keys["other"].pub)
    worker = release / "worker.user-data"
    worker.write_text(worker.read_text() + "# edited after signing\n")
    with pytest.raises(
        VerificationError, match=r"worker.user-data: missing, or not the file the signed release"
    ):
        verify_published(read_published(release), keys["release"].pub)
    # the command: refused before the definition, the lock or a VM is looked at
    refused = subprocess.run(
        [sys.executable, "-m", "imagebuilder.cli", "rebuild", str(release), "--key", str(keys["release"].pub),
         "--definition", str(tmp_path / "absent.yaml"), "--lock", str(tmp_path / "absent.json")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert refused.returncode == 5, refused.stderr
    assert "worker.user-data" in refused.stderr and "absent.yaml" not in refused.stderr
    missing_key = subprocess.run([sys.executable, "-m", "imagebuilder.cli", "rebuild", str(build)], cwd=REPO,
                                 capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert missing_key.returncode == 2 and "--key" in missing_key.stderr
