"""SYSTEMCTL TEST DOUBLE: an executable named ``systemctl`` that records each call and answers like systemctl.

After the join the agent starts the image's SPIRE agent unit (``systemctl start --no-block UNIT``,
agent.after_join) through its one subprocess chokepoint, ``agent.proc.run``, which finds ``systemctl``
on PATH. The development machines run no systemd (PID 1 is not systemd here), so the fast tests put
this double first on PATH; the VM tier asks the image's real systemd. Contract:

* every call is appended to the record file as one JSON line: ``{"argv": [...]}``;
* ``start|restart|try-restart [--no-block] UNIT``: exit 0 when UNIT is one of the ``units`` given to
  :func:`install_systemctl_double`; otherwise exit 5 with systemctl's ``Unit UNIT not found.`` (its
  ``EXIT_NOTINSTALLED`` for ``org.freedesktop.systemd1.NoSuchUnit``);
* while the file ``<record>.fail`` exists, every call exits 1 with systemctl's
  ``Failed to connect to bus: No such file or directory`` (systemd unreachable: a transient failure);
* anything else: exit 1, ``unknown command`` (the agent has no business asking for it).

Install with :func:`install_systemctl_double`; read the calls with :func:`calls`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VERBS = ("start", "restart", "try-restart")


def install_systemctl_double(
    bin_dir: Path, record: Path, units: tuple[str, ...] = ("spire-agent.service",)
) -> Path:
    """``bin_dir/systemctl`` recording into ``record``; returns ``bin_dir`` (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "systemctl"
    known = ",".join(units)
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {record} {known} "$@"\n')
    script.chmod(0o755)
    return bin_dir


def calls(record: Path) -> list[list[str]]:
    if not record.exists():
        return []
    return [json.loads(line)["argv"] for line in record.read_text().splitlines() if line.strip()]


def fail_while(record: Path, failing: bool) -> None:
    """Make every call fail as if systemd were unreachable (``failing``), or answer again."""
    flag = record.with_name(record.name + ".fail")
    if failing:
        flag.write_text("systemd unreachable\n")
    else:
        flag.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    record, known, args = Path(argv[0]), set(filter(None, argv[1].split(","))), argv[2:]
    with record.open("a") as fh:
        fh.write(json.dumps({"argv": args}) + "\n")
    if record.with_name(record.name + ".fail").exists():
        print("Failed to connect to bus: No such file or directory", file=sys.stderr)
        return 1
    words = [a for a in args if a != "--no-block"]
    if len(words) != 2 or words[0] not in VERBS:
        print(f"systemctl double: unknown command {args}", file=sys.stderr)
        return 1
    if words[1] not in known:
        print(f"Failed to {words[0]} {words[1]}: Unit {words[1]} not found.", file=sys.stderr)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
