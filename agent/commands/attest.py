"""``nodeagent attest``: prove this node's TPM identity and obtain an agent X509-SVID."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from agent.errors import ConfigError

DEFAULT_STATE_DIR = "/var/lib/nodeagent"


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "attest",
        help="attest this node's TPM to the server and store the agent SVID",
        description=(
            "Attest this node with its TPM to a SPIRE-compatible server (ours, or SPIRE with the tpm plugin): "
            "send the EK and a freshly certified AK, answer the credential challenge, and store the returned "
            "X509-SVID and its key (0600) in the state directory. Prints the SPIFFE ID and the SVID expiry."
        ),
    )
    p.add_argument(
        "--server",
        default=os.environ.get("NODEAGENT_SERVER"),
        help="server address HOST:PORT (env NODEAGENT_SERVER)",
    )
    p.add_argument(
        "--trust-domain",
        default=os.environ.get("NODEAGENT_TRUST_DOMAIN"),
        help="trust domain, e.g. example.org (env NODEAGENT_TRUST_DOMAIN)",
    )
    p.add_argument(
        "--bundle",
        default=os.environ.get("NODEAGENT_BUNDLE"),
        help="bootstrap trust bundle: PEM CA certificates of the trust domain, from `nodeserver bundle` (env NODEAGENT_BUNDLE)",
    )
    p.add_argument(
        "--tcti",
        default=os.environ.get("NODEAGENT_TCTI", "device:/dev/tpmrm0"),
        help="TPM access, tpm2-tools style: device:/dev/tpmrm0 (default), swtpm:host=H,port=P (env NODEAGENT_TCTI)",
    )
    p.add_argument(
        "--ek-alg",
        choices=("rsa", "ecc"),
        default=os.environ.get("NODEAGENT_EK_ALG", "rsa"),
        help="EK algorithm (default rsa)",
    )
    p.add_argument(
        "--require-ek-cert", action="store_true", help="fail if the TPM has no EK certificate in NV"
    )
    p.add_argument(
        "--state-dir",
        default=os.environ.get("NODEAGENT_STATE_DIR", DEFAULT_STATE_DIR),
        help="where the SVID and key are kept",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole exchange (default 60)")
    p.add_argument(
        "--print-ek-hash",
        action="store_true",
        help="only print the EK hash (for the server's hash allowlist) and exit",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.tpm.attestor import TpmAttestor

    if args.print_ek_hash:
        with TpmAttestor(args.tcti, ek_alg=args.ek_alg) as tpm:
            ek = tpm.read_ek()
        from protocol.tpm_payload import pub_hash

        print(pub_hash(ek.spki_der))
        return 0
    missing = [
        flag
        for flag, value in (
            ("--server", args.server),
            ("--trust-domain", args.trust_domain),
            ("--bundle", args.bundle),
        )
        if not value
    ]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}", hint="see `nodeagent attest --help`")
    try:
        bundle = Path(args.bundle).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the bundle {args.bundle}: {exc.strerror}", hint="copy it from `nodeserver bundle`"
        ) from exc
    from agent.attest_client import ServerTarget, attest

    try:
        target = ServerTarget.parse(args.server, args.trust_domain, bundle)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="use HOST:PORT, e.g. attest.example.org:8081") from exc
    svid = attest(
        target,
        tcti=args.tcti,
        state_dir=Path(args.state_dir),
        ek_alg=args.ek_alg,
        require_ek_cert=args.require_ek_cert,
        timeout=args.timeout,
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
