"""The iPXE scripts as rendered: every error path frees its images, retries are bounded with a pause,
the digests are checked where the build can, and the kernel line carries exactly the parameters.

What the real Debian iPXE ROM does with them is vm-tests/test_ipxe_rom.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from imagebuilder.errors import BuildError
from imagebuilder.release.ipxe import BootScript, render_boot, render_entry
from protocol.cmdline import kernel_params

REPO = Path(__file__).resolve().parents[2]
PARAMS = (
    ("nodeimager.release", "http://10.0.2.2:8080/k8s-1.36.3-amd64-h200/"),
    ("nodeimager.key", "sha256:" + "a" * 64),
    ("nodeimager.image", "sha256:" + "b" * 64),
    ("nodeimager.serial", "S-TARGET-01"),
    ("nodeagent.server", "10.0.2.2:8081"),
    ("console", "ttyS0,115200"),
)


def _script(**kw: object) -> str:
    values: dict[str, object] = {
        "release": "k8s-1.36.3-amd64-h200", "base_url": "http://10.0.2.2:8080/k8s-1.36.3-amd64-h200/",
        "kernel": "imager.vmlinuz", "initrd": "imager.initrd", "kernel_sha256": "c" * 64, "initrd_sha256": "d" * 64,
        "params": PARAMS,
    }  # fmt: skip
    values.update(kw)
    return render_boot(BootScript(**values))  # type: ignore[arg-type]


def _blocks(script: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    label = ""
    for line in script.splitlines():
        if line.startswith(":"):
            label = line[1:]
        elif line and not line.startswith("#"):
            blocks.setdefault(label, []).append(line)
    return blocks


def test_the_packaged_templates_are_the_canonical_ones() -> None:
    for name in ("boot.ipxe.tmpl", "entry.ipxe.tmpl"):
        assert (REPO / "ipxe" / name).read_text() == (
            REPO / "imagebuilder" / "release" / "templates" / name
        ).read_text(), f"copy ipxe/{name} to imagebuilder/release/templates/"


def test_every_error_path_frees_its_images_and_retries_are_bounded() -> None:
    script = _script()
    assert script.startswith("#!ipxe\n") and "@" not in script.replace("nodeimager", "")
    blocks = _blocks(script)
    for label in ("nt_fetch_failed", "nt_digest_required", "nt_bad_digest", "nt_boot_failed", "nt_give_up"):
        lines = blocks[label]
        assert any(line == "imgfree" for line in lines), f"{label} does not free the images"
        assert any(line.startswith("echo nodetrust:") for line in lines), (
            f"{label} says nothing on the console"
        )
    for label in ("nt_fetch_failed", "nt_boot_failed"):
        assert (
            any(line.startswith("sleep ") for line in blocks[label]) and blocks[label][-1] == "goto nt_fetch"
        )
    assert "set nt_max:int32 3" in script and "iseq ${nt_tries} ${nt_max} && goto nt_give_up ||" in script
    assert blocks["nt_bad_digest"][-1] == "goto nt_stop", "a digest mismatch is tampering, not worth a retry"


def test_the_digests_are_compared_where_sha256sum_exists() -> None:
    script = _script()
    assert "sha256sum --set nt_kdigest nt_kernel && goto nt_compare || goto nt_no_digest" in script
    assert f"iseq ${{nt_kdigest}} {'c' * 64} || goto nt_bad_digest" in script
    assert f"iseq ${{nt_idigest}} {'d' * 64} || goto nt_bad_digest" in script
    assert "iseq no yes && goto nt_digest_required ||" in script
    assert "iseq yes yes && goto nt_digest_required ||" in _script(require_digest=True)


def test_the_kernel_line_carries_exactly_the_parameters() -> None:
    (line,) = [x for x in _script().splitlines() if x.startswith("kernel ")]
    assert line.startswith("kernel --name nt_kernel ${nt_url}imager.vmlinuz initrd=nt_initrd ")
    args = line.split(" ", 5)[5].removesuffix(" || goto nt_fetch_failed").encode()
    parsed = [(p.decode(), (v or b"").decode()) for p, v in kernel_params(args)]
    assert parsed == [*PARAMS, ("nodeimager.firmware", "${nt_firmware}")]


@pytest.mark.parametrize(
    "change",
    [
        {"base_url": "http://x/${evil}/"},
        {"base_url": "http://x/r?q=1/"},
        {"base_url": "http://x/no-slash"},
        {"params": (("nodeimager.model", "Samsung SSD"),)},
        {"params": (("nodeagent.bundle", 'a"b'),)},
        {"kernel_sha256": "C" * 64},
        {"kernel": "../vmlinuz"},
        {"retries": 0},
    ],
)
def test_values_that_would_change_the_script_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(BuildError):
        _script(**change)


def test_the_entry_script_chains_with_autofree_and_bounded_retries() -> None:
    entry = render_entry("http://10.0.2.2:8080/r/")
    assert "chain --autofree http://10.0.2.2:8080/r/boot.ipxe && goto nt_done ||" in entry
    assert re.search(r"^dhcp && goto nt_chain \|\|$", entry, re.M)
    assert "imgfree" in _blocks(entry)["nt_chain"] and "imgfree" in _blocks(entry)["nt_give_up"]
