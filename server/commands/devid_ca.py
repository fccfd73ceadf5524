"""``nodeserver devid-ca``: print the DevID CA certificate, for spire-server's ``devid_ca_path``.

The DevID CA lives in ``data_dir`` (``devid-ca.pem``, its key ``devid-ca.key`` 0600) and is created by
the first ``nodeserver run``. Like ``nodeserver bundle`` this reads and changes nothing: a missing CA
is an error that names the fix, unless ``--create``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from server.commands.common import add_config_option, config_from
from server.errors import ConfigError, NotFoundError

MAX_CERT_BYTES = 64 * 1024


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "devid-ca",
        help="print the DevID CA certificate (PEM) for spire-server's tpm_devid devid_ca_path",
        description=(
            "Print the certificate of nodeserver's DevID CA, which issues LDevIDs to EK-attested machines "
            "(docs/attestation.md, DevID enrolment). Give it to a stock spire-server as the tpm_devid "
            "NodeAttestor's devid_ca_path, and its nodes enrolled here attest there with no plugin."
        ),
    )
    add_config_option(p)
    p.add_argument(
        "--create", action="store_true", help="create the DevID CA in data_dir when there is none"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cryptography import x509

    from server.devid.ca import CA_CERT, DevidCa
    from server.devid.settings import SECTION, DevidSettings

    cfg = config_from(args)
    path = cfg.data_dir / CA_CERT
    if path.exists():
        pem = path.read_bytes()[:MAX_CERT_BYTES]
        try:
            x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise ConfigError(f"{path} is not the DevID CA certificate nodeserver writes: {exc}") from exc
    elif args.create:
        settings = cfg.extra.get(SECTION) or DevidSettings()
        pem = DevidCa.load_or_create(cfg.data_dir, cfg.trust_domain, ttl=settings.ca_ttl).pem()
        print(f"nodeserver: created a DevID CA in {cfg.data_dir}", file=sys.stderr)
    else:
        raise NotFoundError(
            f"no DevID CA in {cfg.data_dir} yet (no {CA_CERT}): start the server once "
            f"(`nodeserver run -c {args.config}`) or run `nodeserver devid-ca --create -c {args.config}`"
        )
    sys.stdout.write(pem.decode())
    return 0
