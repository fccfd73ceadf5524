"""``nodeserver bundle``: print the trust bundle agents need; it never creates a CA unless asked.

Reading the bundle used to create a CA when ``data_dir`` had none, so a typo in ``data_dir`` (or
running it before the first ``nodeserver run``) silently made a second trust domain CA whose
bundle no server used. Now a missing CA is an error that names the fix, and ``--create`` makes
one (and says so on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from server.commands.common import add_config_option, config_from
from server.errors import ConfigError, NotFoundError

MAX_CERT_BYTES = 64 * 1024


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "bundle",
        help="print the trust bundle (PEM) that agents use to authenticate the server",
        description=(
            "Print the trust domain's CA certificate(s) in PEM: give this file to agents as their bootstrap bundle "
            "(nodeagent's bundle setting, --bundle). Reads the CA in data_dir and changes nothing; when there is "
            "none yet (the server never ran with this data_dir), it fails and says so, unless --create is given."
        ),
    )
    add_config_option(p)
    p.add_argument(
        "--create",
        action="store_true",
        help="create the trust domain's CA in data_dir when there is none (as the first `nodeserver run` would)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"trust_domain", "bundle_pem", "created"} as one JSON object instead of the PEM',
    )
    p.set_defaults(func=run)


def _existing_bundle(cert_path: Path, trust_domain: str) -> bytes:
    from cryptography import x509

    try:
        with cert_path.open("rb") as fh:
            pem = fh.read(MAX_CERT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the CA certificate {cert_path}: {exc.strerror}") from exc
    if len(pem) > MAX_CERT_BYTES:
        raise ConfigError(f"{cert_path}: larger than {MAX_CERT_BYTES} bytes; not a CA certificate")
    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ConfigError(f"{cert_path} is not the CA certificate nodeserver writes: {exc}") from exc
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    if uris != [f"spiffe://{trust_domain}"]:
        raise ConfigError(
            f"the CA in {cert_path.parent} belongs to {', '.join(uris) or 'no trust domain'}, "
            f"not spiffe://{trust_domain}; check data_dir and trust_domain"
        )
    return pem


def run(args: argparse.Namespace) -> int:
    from server.ca import CA_CERT, CA_KEY, CertificateAuthority

    cfg = config_from(args)
    cert_path, key_path = cfg.data_dir / CA_CERT, cfg.data_dir / CA_KEY
    created = False
    if cert_path.exists():
        pem = _existing_bundle(cert_path, cfg.trust_domain)
    elif not args.create:
        raise NotFoundError(
            f"no CA in {cfg.data_dir} yet (no {CA_CERT}): the server has not run with this data_dir. "
            f"Start it once (`nodeserver run -c {args.config}`), or run `nodeserver bundle --create -c "
            f"{args.config}` to create the CA now; check data_dir if the server did run"
        )
    elif key_path.exists():
        raise ConfigError(f"{cfg.data_dir} holds {CA_KEY} but no {CA_CERT}; restore both or remove both")
    else:
        ca = CertificateAuthority.load_or_create(cfg.data_dir, cfg.trust_domain, ca_ttl=cfg.ca_ttl)
        pem = ca.bundle_pem()
        created = True
        print(
            f"nodeserver: created a new CA for trust domain {cfg.trust_domain} in {cfg.data_dir}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"trust_domain": cfg.trust_domain, "bundle_pem": pem.decode(), "created": created}))
    else:
        sys.stdout.write(pem.decode())
    return 0
