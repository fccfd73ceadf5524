"""``nodeagent devid enrol|attest``: an LDevID from nodeserver, and SPIRE ``tpm_devid`` attestation with it.

``enrol`` creates a DevID key in the TPM (SPIRE's storage-key template), has nodeserver's DevID CA
certify it after proving the key, an AK and the EK share the TPM, and writes the files spire-agent's
``tpm_devid`` reads into ``--devid-dir`` (default: the ``devid_dir`` setting, else
``<state_dir>/devid``). ``attest`` attests with them to any SPIRE-compatible server (a stock
spire-server with ``devid_ca_path`` = the DevID CA, or nodeserver). Settings come from the same layers
as ``nodeagent attest`` (docs/settings.md). ``nodeagent run`` enrols by itself after the join when
``devid_enrol`` is set.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agent.config import TABLE, AgentConfig, add_arguments, config_for
from agent.errors import ConfigError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "devid",
        help="enrol an LDevID with nodeserver, or attest with SPIRE's tpm_devid",
        description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else None,
    )
    verbs = p.add_subparsers(dest="devid_command", metavar="VERB", required=True)
    enrol = verbs.add_parser("enrol", help="create a DevID key and have nodeserver certify it")
    attest = verbs.add_parser("attest", help="attest with tpm_devid and store the agent SVID")
    for v in (enrol, attest):
        add_arguments(v, "attest")
        v.add_argument(
            "--devid-dir", metavar="DIR", help="the DevID files (default: devid_dir, else <state_dir>/devid)"
        )
        v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    enrol.add_argument(
        "--key-alg", choices=("rsa", "ecc"), default="rsa", help="the DevID key (default rsa)"
    )
    attest.add_argument(
        "--svid-dir", metavar="DIR", help="where the SVID goes (default <state_dir>/devid-svid)"
    )
    enrol.set_defaults(func=run_enrol)
    attest.set_defaults(func=run_attest)


def _target(config: AgentConfig) -> Any:
    from agent.attest_client import ServerTarget

    missing = [TABLE.by_name[k] for k in ("server", "trust_domain") if not getattr(config, k)]
    if missing:
        raise ConfigError(
            "missing " + ", ".join(s.key for s in missing), hint="see `nodeagent devid enrol --help`"
        )
    try:
        bundle = Path(config.bundle).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the bundle {config.bundle}: {exc.strerror}", hint="set --bundle"
        ) from exc
    try:
        return ServerTarget.parse(config.server, config.trust_domain, bundle)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="use HOST:PORT") from exc


def _files(args: argparse.Namespace, config: AgentConfig) -> Any:
    from agent.devid_client import DevidFiles

    return DevidFiles(Path(args.devid_dir) if args.devid_dir else config.devid_path)


def run_enrol(args: argparse.Namespace) -> int:
    from agent.devid_client import enrol

    config, _ = config_for(args, "attest")
    done = enrol(
        _target(config),
        tcti=config.tcti,
        files=_files(args, config),
        alg=args.key_alg,
        timeout=config.timeout_s,
    )
    out = {
        "tpm_devid_id": done.agent_id,
        "expires_at": done.expires_at,
        "devid_cert_path": str(done.files.cert_path),
        "devid_priv_path": str(done.files.priv_path),
        "devid_pub_path": str(done.files.pub_path),
        "devid_ca_path": str(done.files.ca_path),
    }
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


def run_attest(args: argparse.Namespace) -> int:
    from agent.devid_client import attest_devid

    config, _ = config_for(args, "attest")
    svid_dir = Path(args.svid_dir) if args.svid_dir else Path(config.state_dir) / "devid-svid"
    svid = attest_devid(
        _target(config),
        tcti=config.tcti,
        files=_files(args, config),
        state_dir=svid_dir,
        timeout=config.timeout_s,
    )
    out = {"spiffe_id": svid.spiffe_id, "expires_at": svid.expires_at, "reattestable": svid.reattestable}
    print(
        json.dumps(out)
        if args.json
        else f"SPIFFE ID: {svid.spiffe_id}\nSVID expires: {svid.expires.isoformat()}"
    )
    return 0
