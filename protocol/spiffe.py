"""SPIFFE IDs and trust domains (SPIFFE ID standard), and this project's identities."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from protocol.errors import SpiffeIdError

_TD_RE = re.compile(r"[a-z0-9._-]+")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
MAX_ID_LENGTH = 2048


def validate_trust_domain(name: str) -> str:
    """Return ``name`` if it is a valid trust domain name, else raise."""
    if not name or len(name) > 255 or not _TD_RE.fullmatch(name):
        raise SpiffeIdError(
            f"invalid trust domain {name!r}: use lowercase letters, digits, '.', '-' and '_' (e.g. example.org)"
        )
    return name


@dataclass(frozen=True, order=True)
class SpiffeId:
    trust_domain: str
    path: str

    def __post_init__(self) -> None:
        validate_trust_domain(self.trust_domain)
        if self.path:
            if not self.path.startswith("/") or self.path.endswith("/"):
                raise SpiffeIdError(f"invalid SPIFFE ID path {self.path!r}")
            for segment in self.path[1:].split("/"):
                if segment in ("", ".", "..") or not _SEGMENT_RE.fullmatch(segment):
                    raise SpiffeIdError(f"invalid SPIFFE ID path segment {segment!r} in {self.path!r}")

    @classmethod
    def parse(cls, uri: str) -> SpiffeId:
        if len(uri) > MAX_ID_LENGTH:
            raise SpiffeIdError("SPIFFE ID too long")
        if not uri.startswith("spiffe://"):
            raise SpiffeIdError(f"not a SPIFFE ID (scheme must be spiffe://): {uri!r}")
        rest = uri[len("spiffe://") :]
        if any(c in rest for c in "?#%@:") or not rest:
            raise SpiffeIdError(f"invalid SPIFFE ID {uri!r}")
        td, _, path = rest.partition("/")
        return cls(td, "/" + path if path else "")

    def __str__(self) -> str:
        return f"spiffe://{self.trust_domain}{self.path}"


def server_id(trust_domain: str) -> SpiffeId:
    """``spiffe://<td>/spire/server``."""
    return SpiffeId(trust_domain, "/spire/server")


def tpm_agent_id(trust_domain: str, ek_pub_hash: str) -> SpiffeId:
    """``spiffe://<td>/spire/agent/tpm/<hex SHA-256 of the EK SubjectPublicKeyInfo DER>``."""
    if not _HASH_RE.fullmatch(ek_pub_hash):
        raise SpiffeIdError(f"EK hash must be 64 lowercase hex characters, got {ek_pub_hash!r}")
    return SpiffeId(trust_domain, f"/spire/agent/tpm/{ek_pub_hash}")


_SHA1_HEX_RE = re.compile(r"[0-9a-f]{40}")


def tpm_devid_agent_id(trust_domain: str, leaf_der: bytes) -> SpiffeId:
    """``spiffe://<td>/spire/agent/tpm_devid/<hex SHA-1 of the DevID leaf DER>``, as spire-server names it."""
    return SpiffeId(
        trust_domain, f"/spire/agent/tpm_devid/{hashlib.sha1(leaf_der, usedforsecurity=False).hexdigest()}"
    )


def is_agent_id(spiffe_id: SpiffeId, trust_domain: str) -> bool:
    """An ID an agent of ``trust_domain`` can hold: ``tpm/<sha256 hex>`` or ``tpm_devid/<sha1 hex>``."""
    parts = spiffe_id.path.split("/")
    if spiffe_id.trust_domain != trust_domain or len(parts) != 5 or parts[1:3] != ["spire", "agent"]:
        return False
    if parts[3] == "tpm":
        return bool(_HASH_RE.fullmatch(parts[4]))
    if parts[3] == "tpm_devid":
        return bool(_SHA1_HEX_RE.fullmatch(parts[4]))
    return False


def is_tpm_agent_id(spiffe_id: SpiffeId, trust_domain: str) -> bool:
    parts = spiffe_id.path.split("/")
    return (
        spiffe_id.trust_domain == trust_domain
        and len(parts) == 5
        and parts[1:4] == ["spire", "agent", "tpm"]
        and bool(_HASH_RE.fullmatch(parts[4]))
    )
