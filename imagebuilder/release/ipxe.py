"""Rendering the iPXE scripts of a release from ``ipxe/*.ipxe.tmpl``.

Placeholders are ``@NAME@`` (iPXE itself expands ``${...}``). Every placeholder of a template must
get a value and every value must be used; a value is refused if iPXE or the kernel would change it
(:func:`protocol.cmdline.render_param` for the kernel parameters; URLs, digests and names are
checked against what they may hold), so the rendered script means exactly what the release says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from imagebuilder.errors import BuildError
from protocol.cmdline import CmdlineError, render_cmdline

CANONICAL_DIR = Path(__file__).resolve().parents[2] / "ipxe"
BOOT_TEMPLATE = "boot.ipxe.tmpl"
ENTRY_TEMPLATE = "entry.ipxe.tmpl"
_PLACEHOLDER = re.compile(r"@([A-Z0-9_]+)@")
_URL = re.compile(r"https?://[A-Za-z0-9.:\[\]-]+(/[A-Za-z0-9._~/%+-]*)?/")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def template_text(name: str) -> str:
    """A template from ``ipxe/`` when running from the repository, else the packaged copy."""
    canonical = CANONICAL_DIR / name
    if canonical.is_file():
        return canonical.read_text(encoding="utf-8")
    return resources.files("imagebuilder.release.templates").joinpath(name).read_text(encoding="utf-8")


def render(template: str, values: Mapping[str, str]) -> str:
    used: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise BuildError(f"iPXE template placeholder @{name}@ has no value")
        used.add(name)
        return values[name]

    text = _PLACEHOLDER.sub(replace, template)
    unused = sorted(set(values) - used)
    if unused:
        raise BuildError(f"iPXE template does not use {', '.join(unused)}")
    return text


@dataclass(frozen=True)
class BootScript:
    release: str  # the release name
    base_url: str  # where the release folder is served, ending in /
    kernel: str  # file names in the folder
    initrd: str
    kernel_sha256: str
    initrd_sha256: str
    params: tuple[tuple[str, str], ...]  # nodeimager.* and nodeagent.* kernel parameters
    architecture: str = "amd64"
    retries: int = 3
    pause_s: int = 5
    require_digest: bool = False

    def check(self) -> None:
        if _URL.fullmatch(self.base_url) is None:
            raise BuildError(
                f"release URL {self.base_url!r} must be http(s)://host[:port]/path/ ending in '/', with no "
                "query, spaces or characters iPXE would expand",
                hint="pass --base-url http://<release server>/<folder>/",
            )
        for name in (self.release, self.kernel, self.initrd):
            if _NAME.fullmatch(name) is None:
                raise BuildError(f"{name!r} is not a plain file or release name")
        for digest in (self.kernel_sha256, self.initrd_sha256):
            if _HEX64.fullmatch(digest) is None:
                raise BuildError(f"{digest!r} is not a lower-case hex SHA-256")
        if not 1 <= self.retries <= 20 or not 1 <= self.pause_s <= 600:
            raise BuildError("retries must be 1..20 and the pause 1..600 s")
        if self.architecture not in ("amd64", "arm64"):
            raise BuildError(f"architecture {self.architecture!r} is not amd64 or arm64")


def kernel_cmdline(params: Iterable[tuple[str, str]]) -> str:
    try:
        return render_cmdline(params)
    except CmdlineError as exc:
        raise BuildError(
            str(exc), hint="kernel parameters may not hold spaces, quotes, '$' or non-ASCII"
        ) from None


def render_boot(script: BootScript) -> str:
    script.check()
    return render(
        template_text(BOOT_TEMPLATE),
        {
            "RELEASE": script.release,
            "BASE_URL": script.base_url,
            "KERNEL": script.kernel,
            "INITRD": script.initrd,
            "KERNEL_SHA256": script.kernel_sha256,
            "INITRD_SHA256": script.initrd_sha256,
            "CMDLINE": kernel_cmdline(script.params),
            "RETRIES": str(script.retries),
            "PAUSE": str(script.pause_s),
            "REQUIRE_DIGEST": "yes" if script.require_digest else "no",
            "ARCH": script.architecture,
        },
    )


def render_entry(base_url: str, *, retries: int = 3, pause_s: int = 5) -> str:
    if _URL.fullmatch(base_url) is None:
        raise BuildError(f"release URL {base_url!r} must be http(s)://host[:port]/path/ ending in '/'")
    return render(
        template_text(ENTRY_TEMPLATE), {"BASE_URL": base_url, "RETRIES": str(retries), "PAUSE": str(pause_s)}
    )
