"""The recorded contract the Kubernetes API server test double keeps: Status bodies, bootstrap-token Secrets.

``status_body`` builds a ``v1/Status`` as kube-apiserver sends it; ``validate_token_secret``
lists the causes that make a ``bootstrap.kubernetes.io/token`` Secret useless to the
bootstrap authenticator and token cleaner (kubernetes.io/docs/reference/access-authn-authz/bootstrap-tokens).
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from typing import Any

_GROUP_RE = re.compile(r"\Asystem:bootstrappers:[a-z0-9:-]{0,255}[a-z0-9]\Z")
_REQUIRED = (
    "token-id",
    "token-secret",
    "expiration",
    "usage-bootstrap-authentication",
    "usage-bootstrap-signing",
)


def status_body(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        out["details"] = details
    return out


def validate_token_secret(name: str, obj: dict[str, Any], now: dt.datetime) -> list[dict[str, str]]:
    """Causes (field, message) that make a bootstrap-token Secret useless; [] if it is sound."""
    causes: list[dict[str, str]] = []

    def bad(fld: str, msg: str) -> None:
        causes.append({"reason": "FieldValueInvalid", "field": fld, "message": msg})

    merged: dict[str, str] = {}
    for key, value in (obj.get("data") or {}).items():
        try:
            merged[key] = base64.b64decode(value, validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            bad(f"data[{key}]", "Invalid value: not base64")
    merged.update(obj.get("stringData") or {})
    for key in _REQUIRED:
        if key not in merged:
            causes.append(
                {"reason": "FieldValueRequired", "field": f"stringData[{key}]", "message": "Required value"}
            )
    tid = merged.get("token-id", "")
    if "token-id" in merged and not re.fullmatch(r"[a-z0-9]{6}", tid):
        bad("stringData[token-id]", f'Invalid value: "{tid}": must match [a-z0-9]{{6}}')
    if name != f"bootstrap-token-{tid}":
        bad("metadata.name", f'Invalid value: "{name}": must be bootstrap-token-<token-id>')
    if "token-secret" in merged and not re.fullmatch(r"[a-z0-9]{16}", merged["token-secret"]):
        bad("stringData[token-secret]", "Invalid value: must match [a-z0-9]{16}")
    if "expiration" in merged:
        exp = merged["expiration"]
        try:
            when = dt.datetime.strptime(exp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        except ValueError:
            bad(
                "stringData[expiration]",
                f'Invalid value: "{exp}": must be RFC 3339 UTC (2006-01-02T15:04:05Z)',
            )
        else:
            if when <= now:
                bad("stringData[expiration]", f'Invalid value: "{exp}": already expired')
    for key in ("usage-bootstrap-authentication", "usage-bootstrap-signing"):
        if key in merged and merged[key] != "true":
            bad(f"stringData[{key}]", f'Invalid value: "{merged[key]}": must be "true"')
    if "auth-extra-groups" in merged:
        for group in merged["auth-extra-groups"].split(","):
            if not _GROUP_RE.match(group):
                bad(
                    "stringData[auth-extra-groups]",
                    f'Invalid value: "{group}": not system:bootstrappers:...',
                )
    known = {*_REQUIRED, "auth-extra-groups", "description"}
    for key in sorted(set(merged) - known):
        if not key.startswith("usage-bootstrap-"):
            bad(f"stringData[{key}]", "Invalid value: not a bootstrap token key")
    return causes
