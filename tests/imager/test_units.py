"""The imager's pieces one by one: the shared command-line splitter, DSSE against the builder's signer,
the QCOW2 header check on images qemu-img made, hints, disk selection on fabricated and real sysfs,
the EFI load-option parser, the HTTP rules."""

from __future__ import annotations

import os
import struct
import subprocess
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imagebuilder.sign import generate_keypair, sign_envelope
from imager import digest
from imager.efi import parse_load_option
from imager.errors import ImagerError, Reason
from imager.hints import merge, mismatches, parse_hints
from imager.http import Fetcher, check_url
from imager.inventory import SysfsInventory
from imager.params import Params, check, from_cmdline
from imager.qcow2 import check_header, container_format
from imager.select import choose, exclusions
from protocol.cmdline import CmdlineError, kernel_params, render_cmdline, render_param
from protocol.dsse import IN_TOTO_PAYLOAD_TYPE, load_public_key, parse_envelope, verify_envelope
from protocol.errors import SignatureError
from protocol.release import Image
from tests.imager.conftest import MiB, sh
from tests.imager.server import Fault, ReleaseServer, tls_certificate
from tests.imager.sysfs import FakeDisk, FakePart, make_machine

# -- the kernel command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'a "b c" d=e', [(b"a", None), (b"b c", None), (b"d", b"e")]),
        (b'nodeagent.bundle="/etc/a b.pem" x', [(b"nodeagent.bundle", b"/etc/a b.pem"), (b"x", None)]),
        (b'"k=v w"', [(b"k", b"v w")]),
        (b"it's=fine", [(b"it's", b"fine")]),
        (b"a -- nodeimager.release=x", [(b"a", None)]),
        (b"  a\t\xa0b  ", [(b"a", None), (b"b", None)]),
    ],
)
def test_the_splitter_follows_the_kernels_next_arg(
    line: bytes, expected: list[tuple[bytes, bytes | None]]
) -> None:
    """lib/cmdline.c: double quotes group and are dropped, no escapes, '--' ends, isspace() includes 0xA0."""
    assert kernel_params(line) == expected


@given(st.lists(st.tuples(st.from_regex(r"nodeimager\.[a-z_]{1,12}", fullmatch=True),
                          st.from_regex(r"[A-Za-z0-9._:/=,@%+*-]{0,40}", fullmatch=True)), max_size=8))  # fmt: skip
def test_rendered_parameters_split_back_to_the_same_pairs(pairs: list[tuple[str, str]]) -> None:
    line = render_cmdline(pairs).encode()
    assert [(p.decode(), (v or b"").decode()) for p, v in kernel_params(line)] == pairs


@pytest.mark.parametrize("value", ['a"b', "${net0/ip}", "a b", "tab\there", "caf\u00e9", "x;y", "a|b"])
def test_values_ipxe_or_the_kernel_would_change_are_refused(value: str) -> None:
    with pytest.raises(CmdlineError):
        render_param("nodeimager.model", value)


def test_imager_parameters_from_a_kernel_command_line() -> None:
    line = (
        b"BOOT_IMAGE=x quiet nodeimager.release=http://10.0.2.2:8080/r/ nodeimager.serial=S1 nodeimager.size=100GB- "
        b'"nodeagent.node_name=gpu-01" nodeagent.pool=h200 nodeimager.reboot=no -- nodeimager.x=1'
    )
    params = check(from_cmdline(line))
    assert params.release == "http://10.0.2.2:8080/r/" and params.reboot == "no"
    assert params.hints == {"serial": "S1", "size": "100GB-"}
    assert params.agent == {"node_name": "gpu-01", "pool": "h200"}


@pytest.mark.parametrize(
    "line",
    [b"nodeimager.relase=http://x/", b"nodeimager.serial=a nodeimager.serial=b", b"nodeimager.release",
     b"nodeimager.release=http://x/ nodeimager.key=sha256:12", b"nodeimager.release=http://x/ nodeimager.role=boss",
     b"nodeimager.release=http://x/ nodeimager.digest=md5"],
    ids=["typo", "twice", "no-value", "bad-pin", "bad-role", "bad-digest"],
)  # fmt: skip
def test_bad_parameters_are_usage_errors(line: bytes) -> None:
    with pytest.raises(ImagerError) as caught:
        check(from_cmdline(line))
    assert caught.value.reason == Reason.usage and caught.value.exit_code == 2


def test_the_digest_choice_falls_back_to_sha256_only_where_that_was_asked_or_blake3_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    signed = Image("node.raw", "a" * 64, 1 << 30, "raw", 1 << 30, None, "b" * 64)
    assert digest.choose("auto", signed) == digest.Check("blake3", "b" * 64)
    assert digest.choose("blake3", signed) == digest.Check("blake3", "b" * 64)
    assert digest.choose("sha256", signed) == digest.Check("sha256", "a" * 64)
    # an imager without the module (an older boot environment): auto verifies the SHA-256, blake3 refuses
    monkeypatch.setattr(digest, "available", lambda algorithm: algorithm == "sha256")
    assert digest.choose("auto", signed) == digest.Check("sha256", "a" * 64)
    with pytest.raises(ImagerError) as caught:
        digest.choose("blake3", signed)
    assert caught.value.reason == Reason.tool_missing


def test_the_blake3_hasher_is_the_reference_one() -> None:
    """BLAKE3 of the empty input and of 1 MiB + 1 byte, against b3sum (the BLAKE3 authors' command)."""
    data = os.urandom((1 << 20) + 1)
    for sample in (b"", data):
        hasher = digest.new("blake3", threads=2)
        hasher.update(sample)
        printed = sh("b3sum", "--no-names", input_bytes=sample).stdout.split()[0].decode()
        assert hasher.hexdigest() == printed
    assert (
        digest.new("blake3").hexdigest()
        == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        digest.new("md5")


# -- DSSE: what the builder signs, the imager verifies -----------------------------------------------------


@pytest.mark.parametrize("kind", ["ecdsa-p256", "ed25519"])
def test_protocol_verifies_what_imagebuilder_signs_and_nothing_else(kind: str) -> None:
    from cryptography.hazmat.primitives import serialization

    private_pem, public_pem = generate_keypair(kind)
    private = serialization.load_pem_private_key(private_pem, password=None)
    envelope = sign_envelope(IN_TOTO_PAYLOAD_TYPE, b'{"x":1}', private)  # type: ignore[arg-type]
    key = load_public_key(public_pem)
    assert verify_envelope(envelope, [key]).payload == b'{"x":1}'
    other = load_public_key(generate_keypair("ed25519")[1])
    with pytest.raises(SignatureError) as caught:
        verify_envelope(envelope, [other])
    assert caught.value.reason == "untrusted-key"
    tampered = {**envelope, "payload": envelope["payload"][:-4] + "eDJ9"}
    with pytest.raises(SignatureError) as caught:
        verify_envelope(tampered, [key])
    assert caught.value.reason == "bad-signature"
    with pytest.raises(SignatureError) as caught:
        parse_envelope(b"{" * (2 << 20))
    assert caught.value.reason == "malformed"


# -- QCOW2 headers qemu-img made ------------------------------------------------------------------------------


def _qcow2(tmp_path: Path, *options: str, size: str = "64M") -> bytes:
    path = tmp_path / f"q{len(list(tmp_path.iterdir()))}.qcow2"
    argv = ("qemu-img", "create", "-q", "-f", "qcow2", *options, str(path), size)
    for _ in range(2):
        # LUKS creation times PBKDF2 on the CPU first, and on a loaded machine qemu-img can fail
        # with "Unable to get accurate CPU usage": a fixture's hiccup, tried again (then reported).
        if subprocess.run(argv, capture_output=True, check=False, timeout=120).returncode == 0:
            return path.read_bytes()[: 2 << 20]
    sh(*argv)
    return path.read_bytes()[: 2 << 20]


def test_plain_qcow2_v2_and_v3_pass(tmp_path: Path) -> None:
    assert check_header(_qcow2(tmp_path), name="x", disk_size=64 * MiB).virtual_size == 64 * MiB
    assert check_header(_qcow2(tmp_path, "-o", "compat=0.10"), name="x", disk_size=1 << 30).version == 2
    assert check_header(
        _qcow2(tmp_path, "-o", "compression_type=zstd,extended_l2=on"), name="x", disk_size=1 << 30
    )


@pytest.mark.parametrize(
    ("options", "disk", "reason"),
    [
        (["-o", "encrypt.format=luks,encrypt.key-secret=s", "--object", "secret,id=s,data=pw"], 1 << 30, Reason.qcow2_encrypted),
        ([], 32 * MiB, Reason.image_too_large),
    ],
    ids=["luks-encrypted", "larger-than-the-disk"],
)  # fmt: skip
def test_qcow2_refusals(tmp_path: Path, options: list[str], disk: int, reason: Reason) -> None:
    with pytest.raises(ImagerError) as caught:
        check_header(_qcow2(tmp_path, *options), name="x", disk_size=disk)
    assert caught.value.reason == reason


def test_a_dirty_or_unknown_feature_qcow2_and_a_raw_declared_qcow2_are_refused(tmp_path: Path) -> None:
    head = bytearray(_qcow2(tmp_path))
    for bits, reason in ((1, Reason.qcow2_features), (1 << 7, Reason.qcow2_features)):
        edited = bytearray(head)
        struct.pack_into(">Q", edited, 72, bits)
        with pytest.raises(ImagerError) as caught:
            check_header(bytes(edited), name="x", disk_size=1 << 30)
        assert caught.value.reason == reason
    with pytest.raises(ImagerError) as caught:
        check_header(bytes(1024), name="x", disk_size=1 << 30)
    assert caught.value.reason == Reason.image_format
    assert container_format(bytes(head)) == "QCOW2" and container_format(bytes(512)) is None


# -- hints and selection ---------------------------------------------------------------------------------------


def test_hint_matching_names_each_mismatch() -> None:
    disk = SysfsInventory(make_machine(Path("/tmp") / f"m-{uuid.uuid4().hex}", [
        FakeDisk("nvme0n1", 960_000_000_000, serial="S1", wwn="0x5000c500abcdef01", model="Samsung SSD PM1733",
                 by_path="pci-0000:41:00.0-nvme-1")], node_files=False)).disks()[0]  # fmt: skip
    assert not mismatches(parse_hints({"serial": "S1", "wwn": "5000C500ABCDEF01", "model": "samsung_ssd*",
                                       "size": "960GB", "by_path": "/dev/disk/by-path/pci-0000:41:00.0-nvme-1",
                                       "rotational": "false"}), disk)  # fmt: skip
    why = mismatches(parse_hints({"serial": "S2", "size": "1TB-2TB", "rotational": "true"}), disk)
    assert len(why) == 3 and "serial is S1, not S2" in why
    with pytest.raises(ImagerError):
        merge({"model": "A"}, {"model": "B"})
    with pytest.raises(ImagerError):
        parse_hints({"name": "sda"})


def _server(tmp_path: Path) -> list[FakeDisk]:
    eight = [FakeDisk(f"nvme{i}n1", 3_840_000_000_000, serial=f"S{i}", model="PM1733") for i in range(8)]
    return [
        FakeDisk("sda", 480_000_000_000, serial="BOSS-1", model="BOSS-N1", bus="ata", major=8),
        *eight,
        FakeDisk("sdb", 32_000_000_000, serial="USB", removable=True, major=8),
        FakeDisk("sr0", 1_000_000, cdrom=True, fs_type="iso9660", major=11),
        FakeDisk("loop0", 100 * MiB, kind="loop", major=7),
        FakeDisk("zram0", 4 << 30, major=252),
        FakeDisk("md0", 1 << 40, kind="md", major=9),
        FakeDisk("sdc", 1 << 40, fs_type="linux_raid_member", holders=("md0",), major=8),
        FakeDisk("sdd", 1 << 40, partitions=[FakePart(1, "LVM2_member", holders=("dm-0",))], major=8),
        FakeDisk("sde", 1 << 40, read_only=True, major=8),
        FakeDisk("sdf", 1 << 40, swap=True, major=8),
        FakeDisk("sdg", 1 << 40, logical_block_size=4096, major=8),
    ]


def test_never_a_target_whatever_the_hints(tmp_path: Path) -> None:
    disks = SysfsInventory(make_machine(tmp_path, _server(tmp_path), node_files=False)).disks()
    tokens = {d.name: [t for t, _ in exclusions(d)] for d in disks}
    assert tokens["sdb"] == ["removable"] and tokens["sr0"] == ["optical", "boot-medium"]
    assert tokens["loop0"] == ["loop"] and tokens["zram0"] == ["zram"] and tokens["md0"] == ["md"]
    assert tokens["sdc"] == ["raid-member", "in-use"] and tokens["sdd"] == ["in-use"]
    assert (
        tokens["sde"] == ["read-only"] and tokens["sdf"] == ["mounted"] and tokens["sdg"] == ["sector-size"]
    )
    assert tokens["sda"] == [] and all(tokens[f"nvme{i}n1"] == [] for i in range(8))


def test_exactly_one_match_or_a_refusal(tmp_path: Path) -> None:
    disks = SysfsInventory(make_machine(tmp_path, _server(tmp_path), node_files=False)).disks()
    assert choose(disks, parse_hints({"serial": "S5"}))[0].name == "nvme5n1"
    assert choose(disks, parse_hints({}), policy="smallest")[0].name == "sda"  # the smallest of >= 4 GiB
    for hints, reason in (({"model": "PM1733"}, Reason.ambiguous), ({"serial": "USB"}, Reason.no_match),
                          ({}, Reason.no_hint)):  # fmt: skip
        with pytest.raises(ImagerError) as caught:
            choose(disks, parse_hints(hints))
        assert caught.value.reason == reason
        assert len(caught.value.details["candidates"]) == len(disks)
    without_boss = [d for d in disks if d.name != "sda"]
    with pytest.raises(ImagerError) as caught:
        choose(without_boss, parse_hints({}), policy="smallest")  # eight of the same size: ambiguous
    assert caught.value.reason == Reason.ambiguous


def test_this_machines_own_sysfs_reads_and_its_system_disk_is_never_a_target() -> None:
    """The real /sys of this machine: sizes as the kernel says, the disk holding / excluded as mounted,
    loop, zram and RAM devices excluded as what they are."""
    disks = SysfsInventory(Path("/")).disks()
    assert disks, "no block devices in /sys/block"
    root_dev = next(
        line.split()[2]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    holding_root = [
        d for d in disks if d.major_minor == root_dev or any(p.major_minor == root_dev for p in d.partitions)
    ]
    for disk in disks:
        assert disk.size == int(Path(f"/sys/block/{disk.name}/size").read_text()) * 512
        tokens = [token for token, _ in exclusions(disk)]
        if disk in holding_root:
            assert "mounted" in tokens, disk.describe()
        if disk.name.startswith(("loop", "zram", "ram")):
            assert disk.kind in tokens, disk.describe()


# -- EFI load options -----------------------------------------------------------------------------------------


def test_a_load_option_names_its_partition_and_loader() -> None:
    guid = uuid.uuid4()
    description = "nodetrust k8s\0".encode("utf-16-le")
    hd = struct.pack("<BBHIQQ16sBB", 4, 1, 42, 1, 2048, 32768, guid.bytes_le, 2, 2)
    path = "\\EFI\\BOOT\\BOOTX64.EFI\0".encode("utf-16-le")
    file_node = struct.pack("<BBH", 4, 4, 4 + len(path)) + path
    end = struct.pack("<BBH", 0x7F, 0xFF, 4)
    paths = hd + file_node + end
    option = struct.pack("<IH", 1, len(paths)) + description + paths
    assert parse_load_option(option) == ("nodetrust k8s", guid, "\\EFI\\BOOT\\BOOTX64.EFI")


# -- HTTP rules --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://user:pw@h/x", "http:///x", "http://h:99999/x"])
def test_urls_without_a_host_with_credentials_or_a_bad_port_are_refused(url: str) -> None:
    with pytest.raises(ImagerError) as caught:
        check_url(url)
    assert caught.value.reason == Reason.scheme_refused


def test_a_stream_resumes_with_range_after_a_cut(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 4096)
    with ReleaseServer(tmp_path) as srv:
        srv.faults["/f.bin"] = Fault(truncate=300_000, times=1)
        got = bytearray()

        class Sink:
            buf = bytearray(65536)

            def buffer(self) -> memoryview:
                return memoryview(self.buf)

            def filled(self, n: int) -> None:
                got.extend(self.buf[:n])

        Fetcher(attempts=3, pause_s=0).stream(f"{srv.url}/f.bin", name="f", size=1 << 20, sink=Sink())
        assert bytes(got) == (tmp_path / "f.bin").read_bytes()
        assert [r[2] for r in srv.recorder.requests] == ["", "bytes=300000-"]


class _Collect:
    def __init__(self) -> None:
        self.buf = bytearray(1 << 20)
        self.got = bytearray()

    def buffer(self) -> memoryview:
        return memoryview(self.buf)

    def filled(self, n: int) -> None:
        self.got.extend(self.buf[:n])


def test_a_server_that_stops_sending_mid_body_is_a_network_failure_not_a_hang(tmp_path: Path) -> None:
    """The Content-Length-framed plain-HTTP body is read with MSG_WAITALL on a blocking socket: its
    SO_RCVTIMEO must still end a read that gets no byte, as the socket timeout does elsewhere."""
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 8192)
    with ReleaseServer(tmp_path) as srv:
        srv.faults["/f.bin"] = Fault(truncate=300_000, stall=5.0)
        sink = _Collect()
        with pytest.raises(ImagerError) as caught:
            Fetcher(attempts=1, timeout_s=1).stream(f"{srv.url}/f.bin", name="f", size=2 << 20, sink=sink)
        assert caught.value.reason == Reason.network
        assert "broke off at byte 300000" in caught.value.message and "timed out" in caught.value.message
        assert bytes(sink.got) == (tmp_path / "f.bin").read_bytes()[:300_000]


@pytest.mark.parametrize("fault", [Fault(), Fault(no_length=True)], ids=["content-length", "until-close"])
def test_a_body_streams_whole_whether_framed_by_length_or_by_close(tmp_path: Path, fault: Fault) -> None:
    (tmp_path / "f.bin").write_bytes(os.urandom(3 << 20) + b"tail")
    with ReleaseServer(tmp_path) as srv:
        srv.faults["/f.bin"] = fault
        sink = _Collect()
        Fetcher(attempts=1).stream(f"{srv.url}/f.bin", name="f", size=(3 << 20) + 4, sink=sink)
        assert bytes(sink.got) == (tmp_path / "f.bin").read_bytes()


def test_a_redirect_from_https_to_http_is_refused(tmp_path: Path) -> None:
    cert = tls_certificate(tmp_path)
    with ReleaseServer(tmp_path, tls=cert) as srv:
        assert srv.url.startswith("https://")
        (tmp_path / "ok").write_bytes(b"fine")
        assert (
            Fetcher(attempts=1, cafile=str(cert[0])).get_small(f"{srv.url}/ok", name="ok", limit=10)
            == b"fine"
        )
        srv.faults["/x"] = Fault(redirect="http://127.0.0.1:1/x")
        with pytest.raises(ImagerError) as caught:
            Fetcher(attempts=1, cafile=str(cert[0])).get_small(f"{srv.url}/x", name="x", limit=10)
        assert caught.value.reason == Reason.redirect_refused
        with pytest.raises(ImagerError) as caught:
            Fetcher(attempts=1).get_small(f"{srv.url}/ok", name="ok", limit=10)  # not a trusted CA
        assert caught.value.reason == Reason.network and "not trusted" in caught.value.message


def test_the_release_url_must_be_given() -> None:
    with pytest.raises(ImagerError):
        check(Params())
