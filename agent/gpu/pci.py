"""NVIDIA PCI functions, enumerated through libudev (pyudev).

Every function with vendor ``0x10de`` is recorded with its class, device ID, the
driver bound to it, its NUMA node and its PCIe link attributes; the rules decide
which are GPUs (class 0x0300/0x0302) and which NVSwitches (0x0680).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from protocol.report import JsonValue, Observation

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "0x10de"
SOURCE = "pyudev: subsystem=pci, attribute vendor=0x10de (class, device, driver, numa_node, *_link_*)"


@dataclass(frozen=True)
class PciFunction:
    address: str
    vendor: str
    device: str
    pci_class: str
    driver: str | None
    numa_node: int | None
    current_link_speed: str | None
    current_link_width: str | None
    max_link_speed: str | None
    max_link_width: str | None

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "address": self.address,
            "vendor": self.vendor,
            "device": self.device,
            "class": self.pci_class,
            "driver": self.driver,
            "numa_node": self.numa_node,
            "current_link_speed": self.current_link_speed,
            "current_link_width": self.current_link_width,
            "max_link_speed": self.max_link_speed,
            "max_link_width": self.max_link_width,
        }


def _attr(device: Any, name: str) -> str | None:
    try:
        value = device.attributes.asstring(name)
    except (KeyError, OSError, UnicodeDecodeError):
        return None
    return str(value).strip() or None


def _numa(device: Any) -> int | None:
    text = _attr(device, "numa_node")
    if text is None:
        return None
    try:
        node = int(text)
    except ValueError:
        return None
    return node if node >= 0 else None


def scan() -> list[PciFunction]:
    """Every NVIDIA PCI function, sorted by address. Raises OSError or ImportError if libudev fails."""
    import pyudev

    context = pyudev.Context()
    functions = []
    for device in context.list_devices(subsystem="pci").match_attribute("vendor", NVIDIA_VENDOR):
        vendor = (_attr(device, "vendor") or "").lower()
        if vendor != NVIDIA_VENDOR:
            continue
        functions.append(
            PciFunction(
                address=str(device.sys_name).lower(),
                vendor=vendor,
                device=(_attr(device, "device") or "").lower(),
                pci_class=(_attr(device, "class") or "").lower(),
                driver=device.driver,
                numa_node=_numa(device),
                current_link_speed=_attr(device, "current_link_speed"),
                current_link_width=_attr(device, "current_link_width"),
                max_link_speed=_attr(device, "max_link_speed"),
                max_link_width=_attr(device, "max_link_width"),
            )
        )
    functions.sort(key=lambda f: f.address)
    log.debug("found %d NVIDIA PCI functions", len(functions))
    return functions


def observe() -> tuple[list[PciFunction], Observation]:
    """Scan, and the ``gpu.pci.inventory`` observation (with the error, if libudev failed)."""
    try:
        functions = scan()
    except (OSError, ImportError) as exc:
        log.warning("PCI enumeration failed: %s", exc)
        return [], Observation("gpu.pci.inventory", SOURCE, {"error": str(exc), "functions": []})
    return functions, Observation(
        "gpu.pci.inventory", SOURCE, {"error": None, "functions": [f.to_json() for f in functions]}
    )
