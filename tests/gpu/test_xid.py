"""XIDs from the kernel log: parsing, the /dev/kmsg record format, the journal-or-kmsg choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.gpu.xid import JOURNAL, KMSG, observe, parse_xids, read_kernel_log
from agent.host import Host

# Collectors run programs (journalctl, containerd, kubelet) or the agent itself through agent.proc.
pytestmark = pytest.mark.subprocess

LINES = [
    "NVRM: Xid (PCI:0000:5D:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics SM Warp Exception",
    "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 22013, Non-fatal, Link 47 Minion Link DLREQ interrupt",
    "NVRM: Xid (PCI:0000:9a:00): 94",
]


def test_parse_counts_per_address_and_xid() -> None:
    assert parse_xids(LINES) == [
        {
            "address": "0000:18:00",
            "xid": 13,
            "count": 1,
            "message": "pid=4242, name=python3, Graphics SM Warp Exception",
        },
        {
            "address": "0000:5d:00",
            "xid": 79,
            "count": 2,
            "message": "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        },
        {"address": "0000:9a:00", "xid": 94, "count": 1, "message": None},
    ]


def test_kmsg_records_and_continuations(tmp_path: Path) -> None:
    kmsg = tmp_path / "dev" / "kmsg"
    kmsg.parent.mkdir()
    kmsg.write_text(
        "6,0,0,-;Linux version 6.8.0\n"
        "4,77,9000,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE (double bit error) ECC error\n"
        " SUBSYSTEM=pci\n"
        " DEVICE=+pci:0000:18:00.0\n"
    )
    log = read_kernel_log(Host(tmp_path))  # journalctl --root finds no journal there
    assert (log.source, log.complete, log.error) == (KMSG, True, None)
    assert log.lines == [
        "Linux version 6.8.0",
        "NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE (double bit error) ECC error",
    ]
    kmsg.write_text("6,5120,0,-;the ring buffer wrapped\n")
    assert read_kernel_log(Host(tmp_path)).complete is False


def test_unreadable_log_is_an_observation_not_an_exception(tmp_path: Path) -> None:
    obs = observe(Host(tmp_path))
    assert obs.observations["events"] == []
    assert "kmsg: No such file or directory" in str(obs.observations["error"])


def test_this_machine_kernel_log_is_readable() -> None:
    """The live path: the journal when it holds kernel messages, else /dev/kmsg; never empty when readable."""
    log = read_kernel_log(Host())
    assert log.source in (JOURNAL, KMSG)
    assert log.lines or log.error, "a booted kernel has logged something"
