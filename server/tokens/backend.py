"""Where bootstrap tokens go: the backend interface and the ``token_backend`` configuration section.

Public API::

    class TokenBackend(Protocol):
        name: str
        def check(self) -> None
            # at start: reachable and allowed; raises ConfigError or TokenBackendError with the fix
        def create(self, token: BootstrapToken) -> str
            # makes the token valid in the cluster; returns backend_ref (Secret name, file path);
            # TokenConflictError when the id is taken (mint a new token and retry)
        def delete(self, token_id: str, backend_ref: str) -> None
            # idempotent: a token that is already gone is fine

    open_backend(spec: Mapping[str, Any], *, base_dir: Path | None = None) -> TokenBackend

``spec`` is the ``token_backend`` mapping of the server configuration::

    token_backend: {type: file, directory: /var/lib/nodeserver/tokens}

    token_backend:
      type: kubernetes
      kubeconfig: /etc/nodeserver/workload-cluster.kubeconfig
      context: admin@workload        # optional: default is the kubeconfig's current-context
      namespace: kube-system         # optional; bootstrap tokens live there and nowhere else
      timeout: 10s                   # optional: per request (seconds, or 500ms/10s/1m)

Unknown keys, wrong types and bad values raise :class:`ConfigError` naming the
key (``token_backend.<key>``). Relative paths are relative to ``base_dir`` (the
configuration file's folder). ``open_backend`` reads the kubeconfig but
contacts nothing: call ``check()`` for that.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from server.config import parse_duration
from server.errors import ConfigError
from server.tokens.token import NAMESPACE, BootstrapToken

_SECTION = "token_backend"
_KEYS = {
    "file": ({"type", "directory"}, {"type", "directory"}),
    "kubernetes": ({"type", "kubeconfig", "context", "namespace", "timeout"}, {"type", "kubeconfig"}),
}
_MAX_TIMEOUT_S = 300.0


class TokenBackend(Protocol):
    name: str

    def check(self) -> None: ...

    def create(self, token: BootstrapToken) -> str: ...

    def delete(self, token_id: str, backend_ref: str) -> None: ...


def _string(spec: Mapping[str, Any], key: str) -> str:
    value = spec[key]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{_SECTION}.{key}: expected a non-empty string, got {type(value).__name__} {value!r}"
        )
    return value


def _path(spec: Mapping[str, Any], key: str, base_dir: Path | None) -> Path:
    path = Path(_string(spec, key)).expanduser()
    if not path.is_absolute():
        if base_dir is None:
            raise ConfigError(
                f"{_SECTION}.{key}: a relative path needs the configuration file's folder; give an absolute path"
            )
        path = base_dir / path
    return path


def open_backend(spec: Mapping[str, Any], *, base_dir: Path | None = None) -> TokenBackend:
    """Validate ``spec`` strictly and build the backend it names (no network access)."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{_SECTION}: expected a mapping such as {{type: file, directory: PATH}}")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise ConfigError(f"{_SECTION}.type: expected 'file' or 'kubernetes', got {kind!r}")
    allowed, required = _KEYS[kind]
    non_string = [k for k in spec if not isinstance(k, str)]
    if non_string:
        raise ConfigError(f"{_SECTION}: keys must be strings, got {non_string[0]!r}")
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ConfigError(
            f"{_SECTION}: unknown key(s) for type {kind}: {', '.join(f'{_SECTION}.{k}' for k in unknown)} "
            f"(allowed: {', '.join(sorted(allowed))})"
        )
    missing = sorted(required - set(spec))
    if missing:
        raise ConfigError(f"{_SECTION}: type {kind} needs {', '.join(f'{_SECTION}.{k}' for k in missing)}")

    if kind == "file":
        from server.tokens.filebackend import FileBackend

        return FileBackend(_path(spec, "directory", base_dir))

    from server.tokens.kubernetes import KubernetesBackend

    if "namespace" in spec and spec["namespace"] != NAMESPACE:
        raise ConfigError(
            f"{_SECTION}.namespace: bootstrap tokens are read from {NAMESPACE} only, got {spec['namespace']!r}"
        )
    context = _string(spec, "context") if "context" in spec else None
    timeout = 10.0
    if "timeout" in spec:
        timeout = parse_duration(spec["timeout"], f"{_SECTION}.timeout").total_seconds()
        if timeout > _MAX_TIMEOUT_S:
            raise ConfigError(f"{_SECTION}.timeout: at most {_MAX_TIMEOUT_S:g} s, got {timeout:g} s")
    return KubernetesBackend.from_kubeconfig(
        _path(spec, "kubeconfig", base_dir), context=context, timeout=timeout
    )
