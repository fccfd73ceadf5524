"""``nodeserver names`` and ``nodeserver enrol``: node names bound to machines, and the enrolment registry.

A node name belongs to the EK of the first machine granted a token for it; ``names release`` frees
it (a machine was replaced). The enrolment registry lists the machines a pool with
``require_enrolment`` admits, by EK hash, with the name and pool each must join as: ``enrol
import`` reads the CSV a rack delivery comes with (``ek_hash,node_name,pool[,serial]``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import time
from pathlib import Path
from typing import Any

from protocol.k8s import node_name_problem
from server.commands.common import add_config_option, config_from
from server.errors import ConfigError, InvalidRequestError, NotFoundError
from server.store import Enrolment, Store

_EK_HASH = re.compile(r"[0-9a-f]{64}")
_POOL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
MAX_IMPORT_BYTES = 16 * 1024 * 1024
MAX_IMPORT_ROWS = 100_000


def register(sub: Any) -> None:
    names: argparse.ArgumentParser = sub.add_parser(
        "names",
        help="list or release the node names bound to machines",
        description=(
            "A node name belongs to the EK of the first machine the join broker granted a token for it: any other "
            "machine asking for it is refused (node_name_taken). List the bindings, or release one when a machine "
            "is replaced so that its successor may take the name."
        ),
    )
    nsub = names.add_subparsers(dest="names_command", metavar="ACTION", required=True)
    nl = nsub.add_parser(
        "list", help="list bound names", description="Every bound node name, its agent and since when."
    )
    add_config_option(nl)
    nl.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    nl.set_defaults(func=run_names_list)
    nr = nsub.add_parser(
        "release",
        help="release a name",
        description="Release NODE_NAME: the next machine granted a token for it owns it. Exits 1 if it is not bound.",
    )
    add_config_option(nr)
    nr.add_argument("node_name", metavar="NODE_NAME")
    nr.add_argument("--json", action="store_true", help='print {"node_name", "released"}')
    nr.set_defaults(func=run_names_release)

    enrol: argparse.ArgumentParser = sub.add_parser(
        "enrol",
        help="the enrolment registry: which machines (by EK hash) may join which pool as which node",
        description=(
            "Machines listed here must join as their enrolled node name and pool; a pool with "
            "require_enrolment: true admits no other machine. EK hashes are the hex SHA-256 of the EK's "
            "SubjectPublicKeyInfo (`nodeagent attest --print-ek-hash` on the node, or the vendor's delivery list)."
        ),
    )
    esub = enrol.add_subparsers(dest="enrol_command", metavar="ACTION", required=True)
    ea = esub.add_parser("add", help="enrol one machine", description="Enrol (or re-enrol) one machine.")
    add_config_option(ea)
    ea.add_argument("ek_hash", metavar="EK_HASH")
    ea.add_argument("node_name", metavar="NODE_NAME")
    ea.add_argument("pool", metavar="POOL")
    ea.add_argument("--serial", default="", help="the machine's serial number, for people")
    ea.add_argument("--json", action="store_true", help="print the enrolment as JSON")
    ea.set_defaults(func=run_enrol_add)
    el = esub.add_parser("list", help="list enrolments", description="Every enrolled machine.")
    add_config_option(el)
    el.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    el.set_defaults(func=run_enrol_list)
    er = esub.add_parser(
        "remove", help="remove an enrolment", description="Exits 1 if EK_HASH is not enrolled."
    )
    add_config_option(er)
    er.add_argument("ek_hash", metavar="EK_HASH")
    er.add_argument("--json", action="store_true", help='print {"ek_hash", "removed"}')
    er.set_defaults(func=run_enrol_remove)
    ei = esub.add_parser(
        "import",
        help="enrol the machines of a CSV file",
        description=(
            "Enrol every machine of FILE, a CSV with the header ek_hash,node_name,pool and optionally serial "
            "(one machine per row, as rack deliveries list them). Every row is checked first: one bad row enrols "
            "nothing, and the error names its line."
        ),
    )
    add_config_option(ei)
    ei.add_argument("file", metavar="FILE", type=Path)
    ei.add_argument("--json", action="store_true", help='print {"enrolled": N}')
    ei.set_defaults(func=run_enrol_import)


def _open(args: argparse.Namespace) -> tuple[Store, set[str]]:
    from server.app import open_store_for
    from server.pools import join_settings

    config = config_from(args)
    settings = join_settings(config.extra, base_dir=config.base_dir)
    pools = set(settings.pools) if settings is not None else set()
    return open_store_for(config), pools


def _ts(value: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(value)) if value else "-"


def run_names_list(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        bindings = store.node_names()
    finally:
        store.close()
    if args.json:
        for b in bindings:
            print(json.dumps(b.__dict__, sort_keys=True))
    elif not bindings:
        print("no bound names")
    else:
        print(f"{'NODE NAME':<40} {'SINCE':<20} AGENT")
        for b in bindings:
            print(f"{b.node_name:<40} {_ts(b.bound_at):<20} {b.agent_id}")
    return 0


def run_names_release(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        released = store.release_node_name(args.node_name)
    finally:
        store.close()
    if not released:
        raise NotFoundError(f"node name {args.node_name!r} is not bound to any machine")
    print(
        json.dumps({"node_name": args.node_name, "released": True})
        if args.json
        else f"released {args.node_name}"
    )
    return 0


def _enrolment(row: dict[str, str], where: str, pools: set[str]) -> Enrolment:
    # Spaces around a CSV field are forgiven; anything else (a newline, a tab inside) is refused.
    ek_hash = (row.get("ek_hash") or "").strip(" ").lower()
    node_name = (row.get("node_name") or "").strip(" ")
    pool = (row.get("pool") or "").strip(" ")
    serial = (row.get("serial") or "").strip(" ")
    if not _EK_HASH.fullmatch(ek_hash):
        raise InvalidRequestError(f"{where}: ek_hash {ek_hash[:80]!r} is not 64 hex characters")
    problem = node_name_problem(node_name)
    if problem is not None:
        raise InvalidRequestError(f"{where}: node name {node_name[:80]!r}: {problem}")
    if not _POOL.fullmatch(pool):
        raise InvalidRequestError(f"{where}: pool {pool[:80]!r} is not a valid pool name")
    if pools and pool not in pools:
        raise InvalidRequestError(
            f"{where}: pool {pool!r} is not configured (this server has {', '.join(sorted(pools))})"
        )
    if len(serial) > 128 or not serial.isprintable():
        raise InvalidRequestError(f"{where}: serial must be printable and at most 128 characters")
    return Enrolment(ek_hash, node_name, pool, serial, enrolled_at=int(time.time()))


def _print_enrolment(e: Enrolment, as_json: bool) -> None:
    if as_json:
        print(json.dumps(e.__dict__, sort_keys=True))
    else:
        print(f"{e.node_name:<40} {e.pool:<20} {e.serial:<20} {e.ek_hash}")


def run_enrol_add(args: argparse.Namespace) -> int:
    store, pools = _open(args)
    try:
        e = _enrolment(
            {"ek_hash": args.ek_hash, "node_name": args.node_name, "pool": args.pool, "serial": args.serial},
            "enrol add",
            pools,
        )
        store.enrol(e)
    finally:
        store.close()
    _print_enrolment(e, args.json)
    return 0


def run_enrol_list(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        enrolments = store.enrolments()
    finally:
        store.close()
    if not args.json:
        print(f"{'NODE NAME':<40} {'POOL':<20} {'SERIAL':<20} EK HASH")
    for e in enrolments:
        _print_enrolment(e, args.json)
    return 0


def run_enrol_remove(args: argparse.Namespace) -> int:
    store, _ = _open(args)
    try:
        removed = store.unenrol(args.ek_hash.strip().lower())
    finally:
        store.close()
    if not removed:
        raise NotFoundError(f"no enrolment for EK hash {args.ek_hash[:80]!r}")
    print(json.dumps({"ek_hash": args.ek_hash, "removed": True}) if args.json else f"removed {args.ek_hash}")
    return 0


def read_import(path: Path, pools: set[str]) -> list[Enrolment]:
    """Every row of an enrolment CSV, checked (nothing is enrolled unless all rows are good)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_IMPORT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    if len(raw) > MAX_IMPORT_BYTES:
        raise InvalidRequestError(f"{path} is larger than {MAX_IMPORT_BYTES} bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{path} is not UTF-8 text") from exc
    reader = csv.DictReader(io.StringIO(text))
    header = set(reader.fieldnames or ())
    if not {"ek_hash", "node_name", "pool"} <= header or header - {"ek_hash", "node_name", "pool", "serial"}:
        raise InvalidRequestError(
            f"{path}: the header must be ek_hash,node_name,pool[,serial]; got {sorted(header)}"
        )
    out: list[Enrolment] = []
    seen_hashes: dict[str, int] = {}
    seen_names: dict[str, int] = {}
    try:
        for row in reader:
            line = reader.line_num
            if len(out) >= MAX_IMPORT_ROWS:
                raise InvalidRequestError(f"{path}: more than {MAX_IMPORT_ROWS} rows")
            e = _enrolment(row, f"{path}:{line}", pools)
            for key, seen, what in (
                (e.ek_hash, seen_hashes, "EK hash"),
                (e.node_name, seen_names, "node name"),
            ):
                if key in seen:
                    raise InvalidRequestError(
                        f"{path}:{line}: {what} {key[:64]} is also on line {seen[key]}"
                    )
                seen[key] = line
            out.append(e)
    except csv.Error as exc:
        raise InvalidRequestError(f"{path}: not CSV: {exc}") from exc
    return out


def run_enrol_import(args: argparse.Namespace) -> int:
    store, pools = _open(args)
    try:
        enrolments = read_import(args.file, pools)
        store.enrol_all(enrolments)
    finally:
        store.close()
    print(
        json.dumps({"enrolled": len(enrolments)}) if args.json else f"enrolled {len(enrolments)} machine(s)"
    )
    return 0
