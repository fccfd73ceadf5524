"""``imagebuilder verify``: check a published build folder's checksums, manifest, SBOM, provenance and
signature; name the first file that does not match."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from imagebuilder.errors import BuildError, FolderMismatch
from imagebuilder.sign import load_public_key
from imagebuilder.verify import verify_build


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="verify a build folder against its signature",
        description=(
            "Check, in order: SHA256SUMS against every file, manifest.json outputs, the SBOM's and the "
            "provenance's image digest, and the DSSE signature with the given public key. Exits 0 when all "
            "match; otherwise names the first file that does not match and why."
        ),
    )
    parser.add_argument("build_dir", type=Path, metavar="DIR", help="the build folder")
    parser.add_argument(
        "--key", required=True, type=Path, metavar="PUB", help="the signer's public key (PEM)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = verify_build(args.build_dir, load_public_key(args.key))
    except BuildError as exc:
        if not args.json:
            raise
        failure = {
            "ok": False,
            "file": exc.path if isinstance(exc, FolderMismatch) else None,
            "reason": exc.reason if isinstance(exc, FolderMismatch) else exc.message,
            "error": exc.message,
            "exit_code": exc.exit_code,
        }
        print(json.dumps(failure, sort_keys=True))
        return exc.exit_code
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
        return 0
    print(f"OK {result.build_id}: {result.files} files verified")
    print(f"image     {result.image} sha256:{result.image_sha256}")
    print(f"signer    {result.signer_keyid} ({result.signer_kind})")
    print(f"packages  {result.packages} installed, {result.inputs} inputs")
    return 0
