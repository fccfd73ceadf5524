"""``nodeagent attest``: prove this node's TPM identity and obtain an agent X509-SVID.

Reads the same layers as ``nodeagent run`` (config.yaml, config.d, the kernel command line, the
environment, then its flags): see docs/settings.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agent.config import TABLE, add_arguments, config_for
from agent.errors import ConfigError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "attest",
        help="attest this node's TPM to the server and store the agent SVID",
        description=(
            "Attest this node with its TPM to a SPIRE-compatible server (ours, or SPIRE with the tpm plugin): "
            "send the EK and a freshly certified AK, answer the credential challenge, and store the returned "
            "X509-SVID and its key (0600) in the state directory. Prints the SPIFFE ID and the SVID expiry. "
            "Settings come from /etc/nodeagent/config.yaml and config.d/*.yaml, then nodeagent.<key>=<value> on "
            "the kernel command line, then NODEAGENT_<KEY> variables, then these flags (docs/settings.md)."
        ),
    )
    add_arguments(p, "attest")
    p.add_argument(
        "--print-ek-hash",
        action="store_true",
        help="only print the EK hash (for the server's hash allowlist) and exit",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.tpm.attestor import TpmAttestor

    config, _ = config_for(args, "attest")
    if args.print_ek_hash:
        with TpmAttestor(config.tcti, ek_alg=config.ek_alg) as tpm:
            ek = tpm.read_ek()
        from protocol.tpm_payload import pub_hash

        ek_hash = pub_hash(ek.spki_der)
        print(json.dumps({"ek_hash": ek_hash}) if args.json else ek_hash)
        return 0
    missing = [TABLE.by_name[k] for k in ("server", "trust_domain") if not getattr(config, k)]
    if missing:
        raise ConfigError(
            "missing " + ", ".join(s.key for s in missing),
            hint="set "
            + "; ".join(f"{s.flag}, {s.env}, {s.cmdline}= or {s.key} in config.yaml" for s in missing)
            + " (see `nodeagent attest --help`)",
        )
    try:
        bundle = Path(config.bundle).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the bundle {config.bundle}: {exc.strerror}",
            hint="copy it from `nodeserver bundle`, or set bundle (--bundle)",
        ) from exc
    from agent.attest_client import ServerTarget, attest

    try:
        target = ServerTarget.parse(config.server, config.trust_domain, bundle)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="use HOST:PORT, e.g. attest.example.org:8081") from exc
    svid = attest(
        target,
        tcti=config.tcti,
        state_dir=Path(config.state_dir),
        ek_alg=config.ek_alg,
        require_ek_cert=config.require_ek_cert,
        timeout=config.timeout_s,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "spiffe_id": svid.spiffe_id,
                    "expires_at": svid.expires_at,
                    "reattestable": svid.reattestable,
                }
            )
        )
    else:
        print(f"SPIFFE ID: {svid.spiffe_id}")
        print(f"SVID expires: {svid.expires.isoformat()}")
    return 0
