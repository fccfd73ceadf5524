"""``imagebuilder keygen``: make a signing key pair for build signatures."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from imagebuilder.sign import KEY_KINDS, PASSPHRASE_ENV, key_id, load_public_key, write_keypair


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "keygen",
        help="make a key pair for signing builds",
        description=(
            "Write PREFIX.key (PKCS#8 PEM, mode 0600) and PREFIX.pub (SubjectPublicKeyInfo PEM). "
            f"When {PASSPHRASE_ENV} is set, the private key is encrypted with it. Existing files are never "
            "overwritten."
        ),
    )
    parser.add_argument(
        "--kind", choices=KEY_KINDS, default="ecdsa-p256", help="key type (default: ecdsa-p256)"
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="PREFIX", help="path prefix of the two files"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"private_key", "public_key", "keyid", "encrypted"} as one JSON object',
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    passphrase = os.environ.get(PASSPHRASE_ENV)
    key_path, pub_path = write_keypair(
        args.out, args.kind, passphrase=passphrase.encode("utf-8") if passphrase else None
    )
    keyid = key_id(load_public_key(pub_path))
    if args.json:
        print(
            json.dumps(
                {
                    "private_key": str(key_path),
                    "public_key": str(pub_path),
                    "keyid": keyid,
                    "encrypted": bool(passphrase),
                },
                sort_keys=True,
            )
        )
        return 0
    print(f"private key: {key_path} (mode 0600{', encrypted' if passphrase else ''}; keep it secret)")
    print(f"public key:  {pub_path}")
    print(f"keyid:       {keyid}")
    return 0
