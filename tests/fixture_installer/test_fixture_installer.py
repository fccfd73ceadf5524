"""Boot the fixture installer ISO for real (QEMU, TCG, OVMF) and hold it to subiquity's contract where no
build goes: the two ways a seed that is not quite an autoinstall stops at a prompt.

1. No ``autoinstall`` on the kernel command line: the confirmation prompt.
2. A seed without an ``autoinstall`` key: the interactive language screen.

The double's autoinstall itself (paired webhook events ending in SUCCESS, late-commands, the staging
medium, ``packages`` from an apt source, power-off, a first boot to multi-user with cloud-init done) is
the session's full build (vm-tests/test_build.py: its watcher follows the event stream, its boot test is
the first boot), and a late-command that fails (FAIL events, error-commands, the installer waiting) is
vm-tests/test_failures.py's installer error: one install each, not two.

Each test boots one VM at a time. Times are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.installer.seed import make_seed
from tests.fixture_installer.conftest import BootFiles, new_disk
from tests.fixture_installer.qemu import GUEST_SERVICE, Listener, Vm, one_vm

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]

BOOT_TO_INSTALLER_TIMEOUT = 600.0
WEBHOOK = f"http://{GUEST_SERVICE}/events"
# A hashed password for "ubuntu" (SHA-512 crypt); never used to log in.
PASSWORD_HASH = (
    "$6$nodetrust$6Zt6oQ0eE8kRzvX0tYvO1b3m0hq0iL9r3oH1c2rX6m4o8O8iS6ZfH2uJc1pV3q9yQmM4vT0sW2nB5dA7eK9gL."
)


def user_data(autoinstall: dict[str, Any]) -> str:
    return "#cloud-config\n" + yaml.safe_dump({"autoinstall": autoinstall}, sort_keys=False)


def base_autoinstall(**extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "version": 1,
        "storage": {"layout": {"name": "direct"}},
        "identity": {"hostname": "node0", "username": "ubuntu", "password": PASSWORD_HASH},
        "ssh": {"install-server": True, "allow-pw": False},
        "reporting": {"builder": {"type": "webhook", "endpoint": WEBHOOK, "level": "INFO"}},
        "shutdown": "poweroff",
    }
    config.update(extra)
    return config


def test_without_autoinstall_argument_asks_for_confirmation(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    config = base_autoinstall(**{"early-commands": ["echo early-before-prompt"]})
    listener.files["/seed/user-data"] = user_data(config).encode()
    listener.files["/seed/meta-data"] = b"instance-id: fixture-prompt\n"
    vm = Vm(
        "prompt",
        tmp_path,
        drives=[(new_disk(tmp_path / "node.qcow2"), "disk"), (boot_files.iso, "cdrom")],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append=f"ds=nocloud;s=http://{GUEST_SERVICE}/seed/ console=ttyS0,115200 quiet no_timer_check",
        listener_port=listener.port,
    )
    with one_vm(vm):
        vm.wait_console(r"Continue with autoinstall\? \(yes\|no\)", BOOT_TO_INSTALLER_TIMEOUT)
        print(f"\nconfirmation prompt after {vm.elapsed():.0f} s")
        console = vm.console()
    assert "GET /seed/user-data" in listener.requests
    assert "early-before-prompt" in console.split("Continue with autoinstall?")[0]
    assert "subiquity/Install/install" not in console
    assert not [e for e in listener.snapshot() if e["name"].startswith("subiquity/Install")]


def test_seed_without_autoinstall_key_falls_back_to_interactive(
    boot_files: BootFiles, listener: Listener, tmp_path: Path
) -> None:
    seed = make_seed(
        "#cloud-config\nhostname: not-an-autoinstall\n",
        "instance-id: fixture-ui\n",
        tmp_path / "seed.img",
        fmt="vfat",
    )
    vm = Vm(
        "interactive",
        tmp_path,
        drives=[(new_disk(tmp_path / "node.qcow2"), "disk"), (boot_files.iso, "cdrom"), (seed, "seed")],
        kernel=boot_files.kernel,
        initrd=boot_files.initrd,
        append="autoinstall ds=nocloud console=ttyS0,115200 quiet no_timer_check",
    )
    with one_vm(vm):
        vm.wait_console(r"Use UP, DOWN and ENTER keys to select your language\.", BOOT_TO_INSTALLER_TIMEOUT)
        print(f"\nlanguage screen after {vm.elapsed():.0f} s")
        console = vm.console()
    assert "Willkommen! Bienvenue! Welcome!" in console
    assert "start: subiquity/" not in console
