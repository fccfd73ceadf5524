"""``nodeserver run``: serve the Agent API (and the join broker) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from server.commands.common import add_config_option
from server.config import TABLE, load_config

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="run the server",
        description=(
            "Run the SPIRE-compatible attestation server: creates the trust domain's CA and the server SVID on first "
            "start (in data_dir), then serves AttestAgent over TLS, the gRPC health service, and Prometheus metrics. "
            "Settings come from the configuration file; each flag below replaces the file's value (the sections "
            "ek_trust, cluster, join, token_backend, pools and the store DSN are set in the file only). "
            "Durations are Go syntax (30s, 1h30m); sizes are bytes or 64KiB, 256MiB. Reference: docs/settings.md."
        ),
    )
    add_config_option(p)
    TABLE.add_arguments(p)
    p.set_defaults(func=run)


async def _serve(args: argparse.Namespace) -> int:
    from server.app import ServerApp

    app = ServerApp(load_config(Path(args.config), overrides=TABLE.given(args)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    print(
        f"nodeserver: serving trust domain {app.config.trust_domain} on port {app.ports.attest}"
        + (f", join on {app.ports.join}" if app.ports.join else "")
        + (f", metrics on {app.ports.metrics}" if app.ports.metrics else ""),
        flush=True,
    )
    await stop.wait()
    log.info("shutting down")
    await app.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))
