"""``nodeserver agents``: list, ban, unban and delete attested agents (reads the store directly)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from server.commands.common import add_config_option, config_from
from server.errors import NotFoundError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agents",
        help="list, ban, unban or delete agents",
        description="Manage attested agents in the store.",
    )
    asub = p.add_subparsers(dest="agents_command", metavar="ACTION", required=True)
    lp = asub.add_parser("list", help="list agents")
    add_config_option(lp)
    lp.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    lp.set_defaults(func=run_list)
    for name, helptext in (
        ("ban", "ban an agent: it is refused at its next attestation and join"),
        ("unban", "lift a ban"),
        ("delete", "forget an agent (it may attest again)"),
    ):
        ap = asub.add_parser(name, help=helptext)
        add_config_option(ap)
        ap.add_argument(
            "spiffe_id", metavar="SPIFFE_ID", help="e.g. spiffe://example.org/spire/agent/tpm/<hash>"
        )
        ap.set_defaults(func=run_action, action=name)


def _ts(value: int) -> str:
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


def run_list(args: argparse.Namespace) -> int:
    from server.app import open_store_for

    store = open_store_for(config_from(args))
    try:
        agents = store.list_agents()
    finally:
        store.close()
    if args.json:
        for a in agents:
            print(json.dumps({**a.__dict__, "selectors": list(a.selectors)}, sort_keys=True))
        return 0
    if not agents:
        print("no agents")
        return 0
    print(f"{'SPIFFE ID':<90} {'BANNED':<6} {'FIRST ATTESTED':<20} {'LAST ATTESTED':<20} SVID EXPIRES")
    for a in agents:
        banned = "yes" if a.banned else "no"
        first, last = _ts(a.first_attested_at), _ts(a.last_attested_at)
        print(f"{a.spiffe_id:<90} {banned:<6} {first:<20} {last:<20} {_ts(a.svid_expires_at)}")
    return 0


def run_action(args: argparse.Namespace) -> int:
    from protocol.errors import SpiffeIdError
    from protocol.spiffe import SpiffeId
    from server.app import open_store_for
    from server.errors import InvalidRequestError

    try:
        SpiffeId.parse(args.spiffe_id)
    except SpiffeIdError as exc:
        raise InvalidRequestError(f"{args.spiffe_id!r} is not a SPIFFE ID: {exc}") from exc
    store = open_store_for(config_from(args))
    try:
        changed = {"ban": store.ban_agent, "unban": store.unban_agent, "delete": store.delete_agent}[
            args.action
        ](args.spiffe_id)
    finally:
        store.close()
    if not changed and args.action != "ban":
        raise NotFoundError(f"no agent {args.spiffe_id} (or nothing to change)")
    print(f"{args.action}: {args.spiffe_id}{'' if changed else ' (already banned)'}")
    return 0
