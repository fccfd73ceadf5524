"""``imagebuilder release``: a signed release folder (iPXE script, imager, image, cloud-init) from a
verified build folder. docs/bare-metal.md is the guide."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from imagebuilder.errors import BuildError


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BuildError(f"{what} {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def _settings(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs whose values are YAML scalars (``true``, ``30``, ``30s``, ``text``)."""
    import yaml

    out: dict[str, Any] = {}
    for key, value in _pairs(items, "--agent-setting").items():
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            parsed = value
        out[key] = parsed if isinstance(parsed, (str, int, float, bool)) else value
    return out


def _files(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``DEST=SRC`` pairs: each SRC read (bounded) as UTF-8 text."""
    from imagebuilder.release.cloudinit import MAX_FILE_BYTES

    out = []
    for item in items:
        dest, sep, src = item.partition("=")
        if not sep or not dest or not src:
            raise BuildError(
                f"--file {item!r} is not DEST=SRC",
                hint="--file /etc/cni/net.d/10-site.conflist=./site.conflist",
            )
        try:
            with Path(src).open("rb") as fh:
                data = fh.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise BuildError(f"--file {dest}={src}: {exc.strerror}") from None
        if len(data) > MAX_FILE_BYTES:
            raise BuildError(
                f"--file {dest}={src}: larger than {MAX_FILE_BYTES} bytes; a configuration file is smaller"
            )
        try:
            out.append((dest, data.decode("utf-8")))
        except UnicodeDecodeError:
            raise BuildError(
                f"--file {dest}={src}: not UTF-8 text", hint="a release writes text configuration only"
            ) from None
    return tuple(out)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "release",
        help="render a signed release folder from a verified build",
        description=(
            "Verify BUILD_DIR with --build-key, then write <out>/<name>/ (named k8s-<version>-<arch>-<pool>): "
            "the iPXE boot script pinning the imager, the signing key and the image; the imager kernel and "
            "initramfs; the image; node-pool and control-plane cloud-init, each validated by cloud-init's own "
            "schema and our kubeadm v1beta4 checks; release.json; SHA256SUMS and a DSSE signature. A release "
            "that exists is never changed: the command refuses."
        ),
        epilog="Guide: docs/bare-metal.md. Exit status: 0 published; 5 the build does not verify; 8 the release "
        "exists or cannot be written; 9 a key cannot be read; 1 anything else is wrong (the message says what).",
    )
    parser.add_argument("build_dir", type=Path, metavar="BUILD_DIR", help="the published build folder")
    parser.add_argument(
        "--build-key", type=Path, required=True, metavar="PUB", help="the build signer's public key"
    )
    parser.add_argument(
        "--key", type=Path, required=True, metavar="KEY", help="the release signing key (private)"
    )
    parser.add_argument("--out", type=Path, required=True, help="the folder that holds releases")
    parser.add_argument("--base-url", required=True, metavar="URL",
                        help="where --out is served (http(s)://server/releases/); the release is at URL<name>/")  # fmt: skip
    parser.add_argument("--imager", type=Path, required=True, metavar="DIR",
                        help="the imager's boot environment: a folder with vmlinuz and initrd.img")  # fmt: skip
    pool = parser.add_argument_group("node pool (worker cloud-init)")
    pool.add_argument("--pool", help="the node pool the agent asks to join")
    pool.add_argument("--server", help="the attestation server HOST:PORT")
    pool.add_argument(
        "--join-server", default="", help="the join broker HOST:PORT (default: the server's host, 8082)"
    )
    pool.add_argument("--trust-domain", help="the SPIFFE trust domain")
    pool.add_argument("--bundle", type=Path, help="the server's trust bundle (PEM)")
    pool.add_argument("--node-name", default="", help="a fixed node name (default: the host name)")
    pool.add_argument("--ntp", action="append", default=[], help="a time server (repeat)")
    pool.add_argument(
        "--pool-profile", type=Path, help="the pool's profile (YAML), written to /etc/nodeagent/pool.yaml"
    )
    pool.add_argument("--agent-setting", action="append", default=[], metavar="KEY=VALUE",
                      help="another nodeagent setting in /etc/nodeagent/config.yaml (docs/settings.md; VALUE is a "
                           "YAML scalar: devid_enrol=true); repeat")  # fmt: skip
    pool.add_argument("--file", action="append", default=[], metavar="DEST=SRC",
                      help="write the text file SRC to DEST (under /etc, 0644 root:root) on every node of the pool: "
                           "a CNI configuration, containerd registry hosts, the SPIRE agent's configuration; "
                           "no secrets (a release is public); repeat")  # fmt: skip
    parser.add_argument("--control-plane-endpoint", default="", metavar="HOST:PORT",
                        help="also render control-plane cloud-init (kubeadm init / join --control-plane)")  # fmt: skip
    parser.add_argument("--kubeadm", default="", help="a kubeadm to run `kubeadm config validate` with")
    parser.add_argument("--suffix", default="", help="the name's last part (default: the pool)")
    parser.add_argument("--name", default="", help="the whole release name")
    parser.add_argument("--hint", action="append", default=[], metavar="KEY=VALUE",
                        help="a disk hint for every node (serial, wwn, model, vendor, size, by_path, rotational)")  # fmt: skip
    parser.add_argument("--without-hints", choices=("refuse", "smallest"), default="refuse",
                        help="what the imager does with no hint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--events-url", default="", help="where the imager POSTs its events")
    parser.add_argument(
        "--raw", action="store_true", help="publish a raw image beside the QCOW2 (streamed by the imager)"
    )
    parser.add_argument("--agent-param", action="append", default=[], metavar="KEY=VALUE",
                        help="a nodeagent.KEY=VALUE kernel parameter on the iPXE kernel line")  # fmt: skip
    parser.add_argument(
        "--console", default="ttyS0,115200", help="the imager's console= (default: %(default)s)"
    )
    parser.add_argument("--retries", type=int, default=3, help="iPXE fetch attempts (default: %(default)s)")
    parser.add_argument("--require-digest", action="store_true",
                        help="the iPXE script refuses to boot the imager on an iPXE without sha256sum")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from imagebuilder.release.cloudinit import PoolConfig
    from imagebuilder.release.folder import ReleaseSpec, write_release
    from protocol.dsse import fingerprint

    pool = None
    if args.pool or args.server or args.trust_domain:
        if args.bundle is None:
            raise BuildError("a node-pool release needs --bundle (the server's trust bundle)")
        pool = PoolConfig(server=args.server or "", trust_domain=args.trust_domain or "", pool=args.pool or "",
                          bundle_pem=args.bundle.read_text(), join_server=args.join_server, node_name=args.node_name,
                          ntp=tuple(args.ntp),
                          profile=args.pool_profile.read_text() if args.pool_profile else "",
                          agent_settings=_settings(args.agent_setting), files=_files(args.file))  # fmt: skip
    spec = ReleaseSpec(
        build_dir=args.build_dir, build_key=args.build_key, signing_key=args.key, out=args.out,
        base_url=args.base_url, imager_kernel=args.imager / "vmlinuz", imager_initrd=args.imager / "initrd.img",
        pool=pool, control_plane_endpoint=args.control_plane_endpoint, suffix=args.suffix, name=args.name,
        hints=_pairs(args.hint, "--hint"), without_hints=args.without_hints, events_url=args.events_url,
        raw=args.raw, kubeadm=args.kubeadm, console=args.console, agent_params=_pairs(args.agent_param, "--agent-param"),
        retries=args.retries, require_digest=args.require_digest,
    )  # fmt: skip
    for path in (spec.imager_kernel, spec.imager_initrd):
        if not path.is_file():
            raise BuildError(
                f"{path}: missing", hint="build the imager's boot environment first (docs/bare-metal.md)"
            )
    folder = write_release(spec)
    doc = json.loads((folder / "release.json").read_text())
    if args.json:
        print(json.dumps({"ok": True, "folder": str(folder), "name": doc["name"], "url": doc["boot"]["url"],
                          "key": doc["boot"]["key"]}, sort_keys=True))  # fmt: skip
    else:
        print(folder)
        print(f"boot script  {doc['boot']['url']}boot.ipxe", flush=True)
        print(f"signing key  {doc['boot']['key']}")
    del fingerprint
    return 0
