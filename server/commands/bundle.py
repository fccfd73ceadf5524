"""``nodeserver bundle``: print the trust bundle agents need."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from server.commands.common import add_config_option, config_from


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "bundle",
        help="print the trust bundle (PEM) that agents use to authenticate the server",
        description=(
            "Print the trust domain's CA certificate(s) in PEM. Give this file to agents as their bootstrap bundle "
            "(nodeagent --bundle). Creates the CA if this is the first use of data_dir."
        ),
    )
    add_config_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from server.ca import CertificateAuthority

    cfg = config_from(args)
    ca = CertificateAuthority.load_or_create(cfg.data_dir, cfg.trust_domain, ca_ttl=cfg.ca_ttl)
    sys.stdout.write(ca.bundle_pem().decode())
    return 0
