"""The Linux kernel command line: split as the kernel splits it, and rendered so that it splits back.

The kernel's ``next_arg`` (``lib/cmdline.c``): whitespace (the kernel's ``isspace``, which counts
0xA0 too) separates parameters; a double quote toggles quoting, so ``"a b"`` or ``key="a b"`` keep
their space; the quotes around a parameter or its value are dropped; there are no escapes and an
apostrophe is an ordinary character; everything after a bare ``--`` belongs to init.

Both the node agent (``nodeagent.<key>=``) and the imager (``nodeimager.<key>=``) read their
parameters with :func:`kernel_params`; the release renderer writes iPXE ``kernel`` lines with
:func:`render_param`, which refuses a value the kernel (or iPXE, which expands ``${...}`` and
splits on spaces first) would not give back unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.errors import ProtocolError

__all__ = [
    "MAX_CMDLINE_BYTES",
    "CmdlineError",
    "kernel_params",
    "params_with_prefix",
    "render_cmdline",
    "render_param",
]

# The kernel keeps at most COMMAND_LINE_SIZE bytes (2048 on x86 and arm64 by default); a longer
# /proc/cmdline is not one a kernel wrote and is refused before parsing.
MAX_CMDLINE_BYTES = 4096

_KERNEL_SPACE = b" \t\n\v\f\r\xa0"  # the kernel's isspace(): lib/ctype.c marks 0xA0 as space too
# Characters a rendered value may hold: printable ASCII without the double quote (the kernel has no
# escape for it), '$' (iPXE expands ${...}), '\\', '#', '|', '&', ';' and '`' (iPXE or shells read them).
_UNSAFE = frozenset('"$\\#|&;`')


class CmdlineError(ProtocolError):
    """A kernel command line, or a parameter to render into one, is unacceptable."""


def kernel_params(data: bytes) -> list[tuple[bytes, bytes | None]]:
    """``(param, value)`` pairs of a kernel command line, split as the kernel's ``next_arg`` does.

    A parameter without ``=`` has the value None. Parsing stops at a bare ``--`` (the rest is for
    init). Input longer than :data:`MAX_CMDLINE_BYTES` is refused.
    """
    if len(data) > MAX_CMDLINE_BYTES:
        raise CmdlineError(
            f"kernel command line: {len(data)} bytes, more than a kernel keeps ({MAX_CMDLINE_BYTES})"
        )
    out: list[tuple[bytes, bytes | None]] = []
    n = len(data)
    i = 0
    while i < n and data[i] in _KERNEL_SPACE:
        i += 1
    while i < n:
        start = i
        quoted = in_quote = data[start] == ord('"')
        if quoted:
            start += 1
        j, equals = start, -1
        while j < n:
            c = data[j]
            if c in _KERNEL_SPACE and not in_quote:
                break
            if equals < 0 and c == ord("="):
                equals = j
            if c == ord('"'):
                in_quote = not in_quote
            j += 1
        end = j  # the token is data[start:end]
        last_quote = end > start and data[end - 1] == ord('"')
        value: bytes | None
        if equals < 0:
            param, value = data[start : end - 1 if quoted and last_quote else end], None
        else:
            param = data[start:equals]
            v_start, v_end = equals + 1, end
            if v_start < end and data[v_start] == ord('"'):
                v_start += 1
                if last_quote:
                    v_end = end - 1
            if quoted and last_quote:
                v_end = end - 1
            value = data[v_start : max(v_start, v_end)]
        if value is None and param == b"--":
            break
        out.append((param, value))
        i = end + 1 if end < n else end
        while i < n and data[i] in _KERNEL_SPACE:
            i += 1
    return out


def params_with_prefix(data: bytes, prefix: str) -> list[tuple[str, str | None]]:
    """The parameters whose name starts with ``prefix``, decoded as UTF-8 (prefix kept), in order."""
    raw_prefix = prefix.encode("ascii")
    out: list[tuple[str, str | None]] = []
    for raw_param, raw_value in kernel_params(data):
        if not raw_param.startswith(raw_prefix):
            continue
        try:
            param = raw_param.decode("utf-8")
            value = None if raw_value is None else raw_value.decode("utf-8")
        except UnicodeDecodeError:
            raise CmdlineError(f"kernel command line: {raw_param[:64]!r} is not UTF-8") from None
        out.append((param, value))
    return out


def render_param(name: str, value: str | None) -> str:
    """``name=value`` as one kernel parameter that :func:`kernel_params` splits back to the same pair.

    A value that the kernel or iPXE would change or split is refused with :class:`CmdlineError`: a
    space (iPXE splits its ``kernel`` line on spaces whatever the quoting, and versions differ in
    how they treat quotes), a double quote (the kernel has no escape for it), ``$`` (iPXE expands
    ``${...}``), control characters and non-ASCII. Disk hints therefore write a model's spaces as
    ``_``, as udev's ``ID_MODEL`` does; the imager treats the two alike.
    """
    if not name or not name.isascii() or any(c in _UNSAFE or not c.isprintable() or c in " =" for c in name):
        raise CmdlineError(f"{name!r} cannot be a kernel parameter name")
    if value is None:
        return name
    bad = sorted({c for c in value if c in _UNSAFE or not (c.isascii() and c.isprintable())})
    if bad:
        raise CmdlineError(
            f"{name}: the value {value!r} holds {', '.join(repr(c) for c in bad)}, which a kernel command "
            "line rendered by iPXE cannot carry"
        )
    if " " in value:
        raise CmdlineError(
            f"{name}: the value {value!r} holds a space; write it as '_' (udev's ID_MODEL does the same)"
        )
    return f"{name}={value}"


def render_cmdline(params: Iterable[tuple[str, str | None]]) -> str:
    """Several parameters rendered with :func:`render_param`, separated by single spaces."""
    return " ".join(render_param(name, value) for name, value in params)
