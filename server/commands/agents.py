"""``nodeserver agents``: list, ban, unban and delete attested agents (reads the store directly)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from typing import Any

from protocol.spiffe import is_agent_id
from server.commands.common import add_config_option, config_from
from server.errors import NotFoundError

_ACTIONS = {
    "ban": (
        "ban an agent: it is refused at its next attestation and join",
        "Ban the agent with this SPIFFE ID: its next attestation and every join request are refused with "
        "PERMISSION_DENIED (reason banned), even if it has never attested (a placeholder is recorded). "
        "Its live bootstrap token is revoked at once and deleted from the token backend (or, if the backend "
        "cannot be reached now, by the server's sweeper within 30 s). Its current SVID stays valid until it "
        "expires; lower agent_svid_ttl to shorten that window. An ID that no agent of this trust domain can "
        "hold (another trust domain, another attestor, a malformed hash) is refused.",
    ),
    "unban": (
        "lift a ban",
        "Lift the ban on the agent with this SPIFFE ID: it may attest and join again. "
        "Exits 1 when there is no such agent or it was not banned.",
    ),
    "delete": (
        "forget an agent (it may attest again)",
        "Delete the agent's record (first and last attestation, SVID serial): the node is a stranger again "
        "and may attest anew, as a node whose EK the server trusts. A ban is a record too: to keep a node "
        "out, ban it, do not delete it. Exits 1 when there is no such agent.",
    ),
}


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agents",
        help="list, ban, unban or delete agents",
        description=(
            "Manage attested agents in the store (the server's database: data_dir's SQLite file or PostgreSQL). "
            "Works while the server runs; a ban takes effect at the agent's next request."
        ),
    )
    asub = p.add_subparsers(dest="agents_command", metavar="ACTION", required=True)
    lp = asub.add_parser(
        "list",
        help="list agents",
        description=(
            "List every agent the store knows: SPIFFE ID, whether it is banned, its first and last attestation "
            "and when its SVID expires (UTC). --json prints one JSON object per line (JSON lines), for tooling."
        ),
    )
    add_config_option(lp)
    lp.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    lp.set_defaults(func=run_list)
    for name, (helptext, description) in _ACTIONS.items():
        ap = asub.add_parser(name, help=helptext, description=description)
        add_config_option(ap)
        ap.add_argument(
            "spiffe_id", metavar="SPIFFE_ID", help="e.g. spiffe://example.org/spire/agent/tpm/<hash>"
        )
        ap.add_argument(
            "--json", action="store_true", help='print {"action", "spiffe_id", "changed"} as one JSON object'
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

    config = config_from(args)
    try:
        parsed = SpiffeId.parse(args.spiffe_id)
    except SpiffeIdError as exc:
        raise InvalidRequestError(f"{args.spiffe_id!r} is not a SPIFFE ID: {exc}") from exc
    if args.action == "ban" and not is_agent_id(parsed, config.trust_domain):
        raise InvalidRequestError(
            f"{args.spiffe_id} can never be an agent of {config.trust_domain}: agent IDs are "
            f"spiffe://{config.trust_domain}/spire/agent/tpm/<64 hex> or .../tpm_devid/<40 hex> "
            "(see `nodeserver agents list`)"
        )
    store = open_store_for(config)
    revoked: list[str] = []
    try:
        live = store.live_token(args.spiffe_id, int(time.time())) if args.action == "ban" else None
        changed = {"ban": store.ban_agent, "unban": store.unban_agent, "delete": store.delete_agent}[
            args.action
        ](args.spiffe_id)
        if live is not None:
            revoked.append(live.token_id)
            _delete_now(config, store, live.agent_id, live.token_id, live.backend_ref)
    finally:
        store.close()
    if not changed and args.action != "ban":
        raise NotFoundError(f"no agent {args.spiffe_id} (or nothing to change)")
    if args.json:
        print(
            json.dumps(
                {
                    "action": args.action,
                    "spiffe_id": args.spiffe_id,
                    "changed": bool(changed),
                    "revoked_tokens": revoked,
                }
            )
        )
    else:
        print(f"{args.action}: {args.spiffe_id}{'' if changed else ' (already banned)'}")
        for token_id in revoked:
            print(f"revoked bootstrap token {token_id}")
    return 0


def _delete_now(config: Any, store: Any, agent_id: str, token_id: str, ref: str) -> None:
    """Delete a revoked token from the backend now; the server's sweeper retries if this fails."""
    from server.pools import join_settings
    from server.tokens.backend import open_backend

    settings = join_settings(config.extra, base_dir=config.base_dir)
    if settings is None:
        return
    try:
        open_backend(settings.token_backend, base_dir=config.base_dir).delete(token_id, ref)
        store.forget_token(agent_id, token_id)
    except Exception as exc:  # the ban stands; the sweeper deletes the token later
        print(
            f"note: token {token_id} is revoked; deleting it from the backend failed ({exc}); the server retries"
        )
