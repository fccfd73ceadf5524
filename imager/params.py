"""The imager's parameters: the kernel command line (what iPXE passed) and the command's flags.

================================  ==========================================================================
kernel parameter                  meaning
================================  ==========================================================================
``nodeimager.release=URL``        the release (or build) folder, ``http://`` or ``https://`` (required)
``nodeimager.key=sha256:HEX``     pin the signing key by fingerprint (else: the keys baked into the imager)
``nodeimager.image=sha256:HEX``   the QCOW2 image the release must hold (the iPXE script always sets it)
``nodeimager.format=qcow2|raw``   which of the release's images to write (default: ``qcow2``)
``nodeimager.digest=MODE``        which signed digest verifies the image: ``auto`` (default: BLAKE3 when
                                  the release signs one, else SHA-256), ``blake3`` or ``sha256``
                                  (:mod:`imager.digest`)
``nodeimager.role=ROLE``          whose cloud-init to seed: ``worker`` (default), ``control-plane-init``,
                                  ``control-plane-join``
``nodeimager.serial=`` ...        disk hints: ``serial``, ``wwn``, ``model``, ``vendor``, ``size``,
                                  ``by_path``, ``rotational`` (:mod:`imager.hints`)
``nodeimager.events=URL``         where to POST events when the release names no URL
``nodeimager.reboot=MODE``        at the end: ``reboot`` (default), ``poweroff`` or ``no``
``nodeimager.firmware=KIND``      ``uefi`` (default) or ``bios``: how the server booted (the iPXE script
                                  passes ``${platform}``); ``bios`` sets no UEFI entry and needs an
                                  image with a BIOS boot partition
``nodeagent.<key>=VALUE``         the node agent's settings for this machine, carried into its first boot
================================  ==========================================================================

The command line is split with the kernel's rules (:mod:`protocol.cmdline`); an unknown
``nodeimager.*`` parameter, or one given twice, is refused: a typo must not fall back to a default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from imager.digest import CHOICES as DIGESTS
from imager.errors import ImagerError, Reason
from imager.hints import HINT_KEYS
from protocol.cmdline import CmdlineError, params_with_prefix
from protocol.release import ROLES

PREFIX = "nodeimager."
AGENT_PREFIX = "nodeagent."
FORMATS = ("qcow2", "raw")
REBOOT_MODES = ("reboot", "poweroff", "no")
SCALAR_KEYS = ("release", "key", "image", "format", "digest", "role", "events", "reboot", "firmware")
FIRMWARES = ("uefi", "bios")
_PIN = re.compile(r"(sha256:)?[0-9a-fA-F]{64}")
_AGENT_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class Params:
    release: str = ""
    key: str = ""
    image: str = ""
    format: str = "qcow2"
    digest: str = "auto"
    role: str = "worker"
    events: str = ""
    reboot: str = "reboot"
    firmware: str = "uefi"
    hints: dict[str, str] = field(default_factory=dict)
    agent: dict[str, str] = field(default_factory=dict)


def _usage(message: str, hint: str = "see docs/bare-metal.md, 'Kernel parameters'") -> ImagerError:
    return ImagerError(Reason.usage, message, hint=hint)


def check(params: Params) -> Params:
    """Refuse values that cannot be right, naming the parameter."""
    if not params.release:
        raise _usage(
            "no release given", "boot with nodeimager.release=http://<server>/<release>/ (or --release)"
        )
    for name, value in (("key", params.key), ("image", params.image)):
        if value and _PIN.fullmatch(value) is None:
            raise _usage(f"nodeimager.{name}={value[:80]!r} is not sha256:<64 hex digits>")
    if params.format not in FORMATS:
        raise _usage(f"nodeimager.format={params.format!r} is not one of {', '.join(FORMATS)}")
    if params.digest not in DIGESTS:
        raise _usage(f"nodeimager.digest={params.digest!r} is not one of {', '.join(DIGESTS)}")
    if params.role not in ROLES:
        raise _usage(f"nodeimager.role={params.role!r} is not one of {', '.join(ROLES)}")
    if params.firmware not in FIRMWARES:
        raise _usage(f"nodeimager.firmware={params.firmware!r} is not one of {', '.join(FIRMWARES)}")
    if params.reboot not in REBOOT_MODES:
        raise _usage(f"nodeimager.reboot={params.reboot!r} is not one of {', '.join(REBOOT_MODES)}")
    return params


def from_cmdline(data: bytes, base: Params | None = None) -> Params:
    """Parameters from a kernel command line (``/proc/cmdline``), over ``base``."""
    values: dict[str, str] = {}
    hints: dict[str, str] = dict(base.hints) if base else {}
    agent: dict[str, str] = dict(base.agent) if base else {}
    seen: set[str] = set()
    try:
        ours = params_with_prefix(data, PREFIX)
        theirs = params_with_prefix(data, AGENT_PREFIX)
    except CmdlineError as exc:
        raise _usage(str(exc)) from None
    for param, value in ours:
        key = param[len(PREFIX) :].replace("-", "_")
        if key in seen:
            raise _usage(f"{param} is given twice")
        seen.add(key)
        if value is None:
            raise _usage(f"{param} has no value (write {param}=VALUE)")
        if key in SCALAR_KEYS:
            values[key] = value
        elif key in HINT_KEYS:
            hints[key] = value
        else:
            known = ", ".join(PREFIX + k for k in (*SCALAR_KEYS, *HINT_KEYS))
            raise _usage(f"unknown parameter {param}", f"known: {known}")
    for param, value in theirs:
        key = param[len(AGENT_PREFIX) :].replace("-", "_")
        if _AGENT_KEY.fullmatch(key) is None:
            raise _usage(f"{param}: not a node agent setting name")
        agent[key] = "true" if value is None else value
    merged = {**(base.__dict__ if base else {}), **values, "hints": hints, "agent": agent}
    return Params(**merged)
