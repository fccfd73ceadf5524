"""Load a pool profile: a YAML file, or the name of a platform preset.

A YAML profile is a mapping checked strictly by :func:`protocol.policy.policy_from_mapping`
(the server uses the same function), so an unknown key or a wrong type stops the agent
with a message naming the key. See ``docs/gpu-checks.md`` and ``examples/pools/``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import yaml

from agent.errors import PoolProfileError
from agent.files import FileTooLargeError, read_bounded
from protocol.errors import PolicyError
from protocol.policy import PRESETS, PoolPolicy, policy_from_mapping, preset

log = logging.getLogger(__name__)

DEFAULT_POOL_FILE = "/etc/nodeagent/pool.yaml"
POOL_ENV = "NODEAGENT_POOL_PROFILE"
MAX_PROFILE_BYTES = 1024 * 1024


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or spec.endswith((".yaml", ".yml", ".json")) or Path(spec).is_file()


def load_pool(spec: str) -> PoolPolicy:
    """``spec`` is a profile file or a preset name (nvke, lepton-byok, domino, cpu)."""
    if not _looks_like_path(spec):
        try:
            return preset(spec)
        except PolicyError as exc:
            raise PoolProfileError(
                str(exc), hint="pass a preset name or the path of a YAML profile"
            ) from None
    path = Path(spec)
    try:
        text = read_bounded(path, MAX_PROFILE_BYTES).decode("utf-8")
    except (FileTooLargeError, UnicodeDecodeError) as exc:
        raise PoolProfileError(
            f"pool profile {path} is not a profile: {exc}",
            hint="a profile is a small YAML file (see examples/pools/)",
        ) from exc
    except OSError as exc:
        raise PoolProfileError(f"cannot read pool profile {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolProfileError(f"{path}: not valid YAML: {exc}") from exc
    try:
        policy = policy_from_mapping(data if data is not None else {})
    except PolicyError as exc:
        raise PoolProfileError(
            f"{path}: {exc}", hint="see docs/gpu-checks.md (Pool profiles) and examples/pools/"
        ) from exc
    log.info("pool %s from %s", policy.name, path)
    return policy


def default_pool_spec() -> str:
    """``$NODEAGENT_POOL_PROFILE``, else /etc/nodeagent/pool.yaml; raises when neither exists."""
    spec = os.environ.get(POOL_ENV)
    if spec:
        return spec
    if Path(DEFAULT_POOL_FILE).is_file():
        return DEFAULT_POOL_FILE
    raise PoolProfileError(
        f"no pool given and {DEFAULT_POOL_FILE} does not exist",
        hint=f"pass --pool FILE or a preset ({', '.join(sorted(PRESETS))}), or set {POOL_ENV}",
    )
