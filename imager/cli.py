"""``nodeimager``: write a verified node image to the right disk (the boot environment's program).

Commands: ``run`` (the whole imaging, what the boot environment starts), ``verify`` (the release's
signature and manifest only, nothing written), ``disks`` (every disk and why it may or may not be
the target, nothing written). Parameters come from the kernel command line (``/proc/cmdline``,
as iPXE passed them) and from flags, which win. docs/bare-metal.md is the guide.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from protocol.version import add_version_argument

log = logging.getLogger(__name__)

EXIT_STATUSES = """exit status:
  0  done: the image is written, checked, the boot entry set (run), the release verifies (verify)
  1  internal error (a bug: report it with the console log)
  2  usage: a parameter or flag is missing or malformed
  3  network: a fetch failed or timed out
  4  release refused: source scheme, redirect, signature, key pin, digest, size or manifest
  5  image refused: QCOW2 backing file, external data file, encryption, format, too large, memory
  6  no disk: the hints match none or several, or the policy refuses to guess
  7  writing failed, or the disk does not read back as the verified image
  8  the written disk fails its checks (GPT, partitions that resolve on another disk)
  9  the UEFI boot entry could not be created
On every failure after the disk was chosen, the disk is left unbootable (its partition tables
wiped at both ends) and no boot entry points at it."""

HINT_FLAGS = ("serial", "wwn", "model", "vendor", "size", "by_path", "rotational")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _add_release(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--release", metavar="URL", help="the release folder (nodeimager.release=)")
    parser.add_argument("--key", metavar="sha256:HEX", help="pin the signing key (nodeimager.key=)")
    parser.add_argument(
        "--image", metavar="sha256:HEX", help="the QCOW2 image the release must hold (nodeimager.image=)"
    )
    parser.add_argument("--keys-dir", type=Path, default=Path("/etc/nodeimager/keys"),
                        help="trusted public keys (*.pub) baked into the boot environment (default: %(default)s)")  # fmt: skip


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cmdline", type=Path, default=Path("/proc/cmdline"),
                        help="the kernel command line to read parameters from (default: %(default)s; "
                        "/dev/null for none)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")


def _add_disk(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("/"),
                        help="where sys/, run/udev/, proc/ and dev/ are (default: %(default)s)")  # fmt: skip
    for name in HINT_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=f"hint_{name}", metavar="VALUE",
                            help=f"disk hint {name} (nodeimager.{name}=)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeimager",
        description="Fetch a signed node release, verify it, choose the target disk by stable identity, "
        "write the image so that the disk is bootable only once every byte is verified, set the UEFI "
        "boot entry and reboot. Guide: docs/bare-metal.md.",
        epilog=EXIT_STATUSES,
        formatter_class=_Formatter,
    )
    add_version_argument(parser, "nodeimager")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="image this machine (what the boot environment runs)", epilog=EXIT_STATUSES,
                         formatter_class=_Formatter)  # fmt: skip
    _add_release(run)
    _add_disk(run)
    _add_common(run)
    run.add_argument(
        "--format", choices=("qcow2", "raw"), help="which image of the release to write (nodeimager.format=)"
    )
    run.add_argument(
        "--digest",
        choices=("auto", "sha256", "blake3"),
        help="which signed digest verifies the image (nodeimager.digest=; default auto: BLAKE3 when the "
        "release signs one, else SHA-256)",
    )
    run.add_argument("--role", help="whose cloud-init to seed (nodeimager.role=)")
    run.add_argument("--events", metavar="URL", help="POST events here when the release names no URL")
    run.add_argument(
        "--reboot", choices=("reboot", "poweroff", "no"), help="what to do when done (nodeimager.reboot=)"
    )
    run.add_argument("--scratch-dir", type=Path, default=Path("/run/nodeimager"),
                     help="memory-backed folder for a QCOW2 download (default: %(default)s)")  # fmt: skip
    run.add_argument(
        "--efivars", type=Path, default=Path("/sys/firmware/efi/efivars"), help=argparse.SUPPRESS
    )
    verify = sub.add_parser("verify", help="verify the release's signature and manifest; write nothing",
                            epilog=EXIT_STATUSES, formatter_class=_Formatter)  # fmt: skip
    _add_release(verify)
    _add_common(verify)
    disks = sub.add_parser("disks", help="list the disks and why each may or may not be the target; write nothing",
                           epilog=EXIT_STATUSES, formatter_class=_Formatter)  # fmt: skip
    _add_disk(disks)
    _add_common(disks)
    disks.add_argument(
        "--policy", choices=("refuse", "smallest"), default="refuse", help="the no-hint policy to apply"
    )
    return parser


def _params(args: argparse.Namespace) -> Any:
    from imager.errors import ImagerError, Reason
    from imager.params import Params, from_cmdline

    try:
        with args.cmdline.open("rb") as fh:
            data = fh.read(8192)
    except OSError as exc:
        raise ImagerError(Reason.usage, f"{args.cmdline}: {exc.strerror}") from None
    params = from_cmdline(data)
    changes: dict[str, Any] = {}
    for name in ("release", "key", "image", "format", "digest", "role", "events", "reboot", "firmware"):
        value = getattr(args, name, None)
        if value:
            changes[name] = value
    hints = dict(params.hints)
    for name in HINT_FLAGS:
        value = getattr(args, f"hint_{name}", None)
        if value:
            hints[name] = value
    result: Params = replace(params, **changes, hints=hints)
    return result


def _console(what: str, total: int) -> Any:
    from imager.progress import Progress

    return Progress(what, total)


def cmd_run(args: argparse.Namespace) -> int:
    from imager.efi import EfiVars
    from imager.events import Events, machine_identity
    from imager.flow import Imaging
    from imager.http import Fetcher
    from imager.inventory import SysfsInventory
    from imager.params import check
    from imager.run import run

    params = check(_params(args))
    imaging = Imaging(params=params, inventory=SysfsInventory(args.root), firmware=EfiVars(args.efivars),
                      fetcher=Fetcher(), events=Events(machine=machine_identity()), keys_dir=args.keys_dir,
                      scratch_dir=args.scratch_dir, console=_console)  # fmt: skip
    result = imaging.run()
    if args.json:
        print(json.dumps(result.as_json(), sort_keys=True))
    else:
        print(f"nodeimager: {result.release} written to {result.disk.describe() if result.disk else '?'}; "
              f"boot entry Boot{result.boot_entry or 0:04X} first")  # fmt: skip
    if params.reboot != "no":
        from imager.errors import Reason

        sys.stdout.flush()
        run(
            ["reboot" if params.reboot == "reboot" else "poweroff", "-f"], reason=Reason.internal, timeout=60
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from imager.errors import ImagerError, Reason
    from imager.http import Fetcher
    from imager.source import open_source

    params = _params(args)
    if not params.release:
        raise ImagerError(Reason.usage, "no release given", hint="pass --release URL")
    source = open_source(
        Fetcher(), params.release, keys_dir=args.keys_dir, key_pin=params.key, image_pin=params.image
    )
    view = source.view
    if args.json:
        print(json.dumps({"ok": True, "kind": view.kind, "name": view.name, "build_id": view.build_id,
                          "signer": source.statement.key_id,
                          "images": [{"name": i.name, "format": i.format, "sha256": i.sha256, "size": i.size,
                                      "blake3": i.blake3} for i in view.images]}, sort_keys=True))  # fmt: skip
    else:
        print(f"OK {view.kind} {view.name} (build {view.build_id}), signed by {source.statement.key_id}")
        for image in view.images:
            fast = f" blake3:{image.blake3}" if image.blake3 else ""
            print(f"image  {image.name} ({image.format}, {image.size} bytes) sha256:{image.sha256}{fast}")
    return 0


def cmd_disks(args: argparse.Namespace) -> int:
    from imager.errors import ImagerError
    from imager.hints import parse_hints
    from imager.inventory import SysfsInventory
    from imager.select import choose, judge

    params = _params(args)
    hints = parse_hints(params.hints)
    disks = SysfsInventory(args.root).disks()
    chosen = None
    try:
        chosen, verdicts = choose(disks, hints, policy=args.policy)
        error = None
    except ImagerError as exc:
        verdicts, error = judge(disks, hints), exc
    if args.json:
        print(json.dumps({"ok": error is None, "chosen": chosen.identity() if chosen else None,
                          "reason": str(error.reason) if error else None,
                          "disks": [v.as_json() for v in verdicts]}, sort_keys=True))  # fmt: skip
    else:
        for verdict in verdicts:
            print(verdict.line().strip())
        print(
            f"chosen: {chosen.describe()}" if chosen else f"chosen: none ({error.reason if error else ''})"
        )
    return 0 if error is None else error.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    from imager.errors import ImagerError

    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="nodeimager: %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    handler = {"run": cmd_run, "verify": cmd_verify, "disks": cmd_disks}[args.command]
    try:
        return handler(args)
    except ImagerError as exc:
        if args.json:
            print(json.dumps({"ok": False, "reason": str(exc.reason), "error": exc.message, "hint": exc.hint,
                              "exit_code": exc.exit_code, **exc.details}, sort_keys=True))  # fmt: skip
        print(f"nodeimager: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"nodeimager: hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nodeimager: interrupted (the target disk, if one was chosen, was wiped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
