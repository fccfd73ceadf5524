"""kubeadm bootstrap tokens: minting, and the Kubernetes Secret that makes one valid.

Public API::

    TOKEN_RE, TOKEN_ID_RE, TOKEN_SECRET_RE, EXTRA_GROUP_RE: re.Pattern[str]

    @dataclass(frozen=True)
    class BootstrapToken:
        token_id: str        # [a-z0-9]{6}, public
        secret: str          # [a-z0-9]{16}, never shown by repr()/str()
        expires_at: int      # Unix seconds
        description: str = ""
        extra_groups: tuple[str, ...] = ()
        value -> str               # "<id>.<secret>", what kubeadm join needs
        secret_sha256 -> str       # hex SHA-256 of the secret (what the store keeps)
        secret_matches(candidate: str) -> bool   # constant-time
        secret_name -> str         # "bootstrap-token-<id>"

    KUBEADM_NODE_GROUP = "system:bootstrappers:kubeadm:default-node-token"
    new_token(*, ttl_s: int, now: int, description: str = "",
              extra_groups: tuple[str, ...] = ()) -> BootstrapToken
        # extra_groups always starts with KUBEADM_NODE_GROUP (added when missing)
    secret_name(token_id: str) -> str
    rfc3339(ts: int) -> str                       # "2026-11-30T08:00:00Z"
    secret_manifest(token: BootstrapToken) -> dict[str, Any]
    redact(text: str, *tokens: BootstrapToken) -> str

The Secret follows kubernetes.io/docs/reference/access-authn-authz/bootstrap-tokens
(reference §6.1/6.2): ``type: bootstrap.kubernetes.io/token`` in ``kube-system``,
named ``bootstrap-token-<id>``, with the usage flags as the strings ``"true"``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from server.errors import ConfigError

TOKEN_ID_RE = re.compile(r"\A[a-z0-9]{6}\Z")
TOKEN_SECRET_RE = re.compile(r"\A[a-z0-9]{16}\Z")
TOKEN_RE = re.compile(r"\A[a-z0-9]{6}\.[a-z0-9]{16}\Z")
EXTRA_GROUP_RE = re.compile(r"\Asystem:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9]\Z")
# Anything shaped like a token inside free text (kubeadm output, API messages).
_TOKEN_IN_TEXT = re.compile(r"\b([a-z0-9]{6})\.[a-z0-9]{16}\b")

NAMESPACE = "kube-system"
# The group kubeadm's RBAC is bound to (`kubeadm init phase bootstrap-token`): reading the kubeadm-config and
# kubelet-config ConfigMaps, getting Nodes, creating and auto-approving the kubelet's CSR. A token without
# it authenticates but cannot join a kubeadm cluster, so every token nodeserver mints carries it.
KUBEADM_NODE_GROUP = "system:bootstrappers:kubeadm:default-node-token"
SECRET_TYPE = "bootstrap.kubernetes.io/token"  # noqa: S105 - a Secret type, not a password
SECRET_PREFIX = "bootstrap-token-"  # noqa: S105 - a name prefix
MANAGED_BY = "nodetrust"
_ALPHABET = string.ascii_lowercase + string.digits
_MAX_DESCRIPTION = 1024


def secret_name(token_id: str) -> str:
    """``bootstrap-token-<id>``; the id is checked so it can go into a URL path or a file name."""
    if not isinstance(token_id, str) or not TOKEN_ID_RE.match(token_id):
        raise ValueError(f"not a bootstrap token id (6 of [a-z0-9]): {token_id!r}")
    return SECRET_PREFIX + token_id


def rfc3339(ts: int) -> str:
    """Unix seconds as RFC 3339 UTC with a ``Z``, the form the token cleaner parses."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validate_extra_groups(groups: tuple[str, ...] | list[str], key: str = "extra_groups") -> tuple[str, ...]:
    out = []
    for group in groups:
        if not isinstance(group, str) or not EXTRA_GROUP_RE.match(group):
            raise ConfigError(
                f"{key}: {group!r} is not a bootstrap token group; it must match "
                r"system:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9] "
                "(e.g. system:bootstrappers:kubeadm:default-node-token)"
            )
        out.append(group)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class BootstrapToken:
    """One bootstrap token. ``repr``/``str`` show the id only; equality compares secrets in constant time."""

    token_id: str
    secret: str
    expires_at: int
    description: str = ""
    extra_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.token_id, str) or not TOKEN_ID_RE.match(self.token_id):
            raise ValueError("token id must be 6 characters of [a-z0-9]")
        # Never echo the secret, not even in a validation error.
        if not isinstance(self.secret, str) or not TOKEN_SECRET_RE.match(self.secret):
            raise ValueError("token secret must be 16 characters of [a-z0-9]")
        if isinstance(self.expires_at, bool) or not isinstance(self.expires_at, int) or self.expires_at <= 0:
            raise ValueError("expires_at must be positive Unix seconds")
        if not isinstance(self.description, str) or len(self.description) > _MAX_DESCRIPTION:
            raise ValueError(f"description must be a string of at most {_MAX_DESCRIPTION} characters")
        object.__setattr__(self, "extra_groups", validate_extra_groups(tuple(self.extra_groups)))

    @property
    def value(self) -> str:
        return f"{self.token_id}.{self.secret}"

    @property
    def secret_sha256(self) -> str:
        return hashlib.sha256(self.secret.encode("ascii")).hexdigest()

    @property
    def secret_name(self) -> str:
        return SECRET_PREFIX + self.token_id

    def secret_matches(self, candidate: str) -> bool:
        """True if ``candidate`` is this token's secret (constant time)."""
        return hmac.compare_digest(self.secret.encode(), candidate.encode("utf-8", "replace"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BootstrapToken):
            return NotImplemented
        return (
            self.token_id == other.token_id
            and self.expires_at == other.expires_at
            and self.description == other.description
            and self.extra_groups == other.extra_groups
            and hmac.compare_digest(self.secret.encode(), other.secret.encode())
        )

    def __hash__(self) -> int:
        return hash((self.token_id, self.expires_at))

    def __repr__(self) -> str:
        return (
            f"BootstrapToken(token_id={self.token_id!r}, secret=<redacted>, expires_at={self.expires_at}, "
            f"description={self.description!r}, extra_groups={self.extra_groups!r})"
        )

    def __str__(self) -> str:
        return f"{self.token_id}.<redacted>"


def new_token(
    *, ttl_s: int, now: int, description: str = "", extra_groups: tuple[str, ...] = ()
) -> BootstrapToken:
    """A fresh random token expiring ``ttl_s`` seconds after ``now``.

    Its groups are :data:`KUBEADM_NODE_GROUP` first, then ``extra_groups`` (a pool's own groups are added
    to kubeadm's, never instead of it: without it ``kubeadm join`` is refused its ConfigMaps and CSR).
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0:
        raise ValueError("ttl_s must be a positive number of seconds")
    token_id = "".join(secrets.choice(_ALPHABET) for _ in range(6))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(16))
    return BootstrapToken(
        token_id=token_id,
        secret=secret,
        expires_at=int(now) + ttl_s,
        description=description,
        extra_groups=(KUBEADM_NODE_GROUP, *(g for g in extra_groups if g != KUBEADM_NODE_GROUP)),
    )


def secret_manifest(token: BootstrapToken) -> dict[str, Any]:
    """The ``v1/Secret`` that makes ``token`` valid for authentication and cluster-info signing."""
    string_data = {
        "token-id": token.token_id,
        "token-secret": token.secret,
        "expiration": rfc3339(token.expires_at),
        "usage-bootstrap-authentication": "true",
        "usage-bootstrap-signing": "true",
    }
    if token.extra_groups:
        string_data["auth-extra-groups"] = ",".join(token.extra_groups)
    string_data["description"] = token.description
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": SECRET_TYPE,
        "metadata": {
            "name": token.secret_name,
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
        },
        "stringData": string_data,
    }


def redact(text: str, *tokens: BootstrapToken) -> str:
    """``text`` with the given tokens' secrets, and anything shaped like a token, replaced."""
    for token in tokens:
        text = text.replace(token.secret, "<redacted>")
    return _TOKEN_IN_TEXT.sub(r"\1.<redacted>", text)
