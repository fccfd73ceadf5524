"""Options shared by the sub-commands."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from server.config import ServerConfig, load_config

DEFAULT_CONFIG = "/etc/nodeserver/config.yaml"
CONFIG_ENV = "NODESERVER_CONFIG"


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        default=os.environ.get(CONFIG_ENV, DEFAULT_CONFIG),
        metavar="FILE",
        help=f"configuration file (default {DEFAULT_CONFIG}, env {CONFIG_ENV}); keys: docs/settings.md",
    )


def config_from(args: argparse.Namespace) -> ServerConfig:
    return load_config(Path(args.config))
