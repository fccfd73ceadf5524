"""``nodeserver run``: serve the Agent API (and the join broker) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from server.commands.common import add_config_option, config_from

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="run the server",
        description=(
            "Run the SPIRE-compatible attestation server: creates the trust domain's CA and the server SVID on first "
            "start (in data_dir), then serves AttestAgent over TLS, the gRPC health service, and Prometheus metrics."
        ),
    )
    add_config_option(p)
    p.set_defaults(func=run)


async def _serve(args: argparse.Namespace) -> int:
    from server.app import ServerApp

    app = ServerApp(config_from(args))
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
