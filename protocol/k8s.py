"""Kubernetes names the pool policy carries: node names, label keys and values, taints.

The rules follow the Kubernetes API validation: a node name is an RFC 1123 DNS
subdomain; a label key is ``[prefix/]name`` with a DNS-subdomain prefix and a
name of at most 63 characters; a taint is ``key[=value]:Effect`` as ``kubectl taint``
writes it. Every parser here raises :class:`PolicyError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import PolicyError

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Always used with fullmatch: ``re.match`` with ``$`` would accept a trailing newline ("node-b\n").
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME_PART = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def node_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid Node name (an RFC 1123 DNS subdomain), or None."""
    if not name:
        return "it is empty"
    if len(name) > 253:
        return "it is longer than 253 characters"
    if name != name.lower():
        return "it has upper-case letters"
    for label in name.split("."):
        if not _DNS_LABEL.fullmatch(label):
            return (
                f"label {label!r} is not an RFC 1123 label (a-z, 0-9, '-', at most 63, no '-' at the ends)"
            )
    return None


@dataclass(frozen=True, order=True)
class Taint:
    key: str
    effect: str
    value: str = ""

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"

    @classmethod
    def parse(cls, text: str) -> Taint:
        """``key[=value]:Effect`` as ``kubectl taint`` writes it."""
        head, sep, effect = text.rpartition(":")
        if not sep:
            raise PolicyError(f"taint {text!r} has no effect; write key[=value]:Effect")
        key, _, value = head.partition("=")
        return cls(key=key, value=value, effect=effect)


def label_value_ok(text: str) -> bool:
    return len(text) <= 63 and bool(_NAME_PART.fullmatch(text))


def label_key_ok(key: str) -> bool:
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or node_name_problem(prefix) is not None):
        return False
    return bool(name) and label_value_ok(name)


def parse_labels(items: Mapping[Any, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in items.items():
        if not isinstance(k, str) or not label_key_ok(k):
            raise PolicyError(f"join.labels: {k!r} is not a valid label key ([prefix/]name)")
        if not isinstance(v, str):
            raise PolicyError(
                f"join.labels.{k}: expected a string value, got {type(v).__name__} {v!r} (quote it)"
            )
        if not label_value_ok(v):
            raise PolicyError(f"join.labels.{k}: {v!r} is not a valid label value")
        out[k] = v
    return out


def parse_taints(items: list[Any]) -> tuple[Taint, ...]:
    out = []
    for item in items:
        if isinstance(item, str):
            try:
                taint = Taint.parse(item)
            except PolicyError as exc:
                raise PolicyError(f"join.taints: {exc}") from None
        elif isinstance(item, Mapping):
            unknown = set(item) - {"key", "value", "effect"}
            if unknown or not all(isinstance(item.get(k, ""), str) for k in ("key", "value", "effect")):
                raise PolicyError(f"join.taints: {dict(item)!r} must have string key, value, effect only")
            taint = Taint(
                key=item.get("key", ""), value=item.get("value", ""), effect=item.get("effect", "")
            )
        else:
            raise PolicyError(f"join.taints: {item!r} must be 'key[=value]:Effect' or a mapping")
        if not label_key_ok(taint.key):
            raise PolicyError(f"join.taints: {taint.key!r} is not a valid taint key")
        if taint.value and not label_value_ok(taint.value):
            raise PolicyError(f"join.taints: {taint.value!r} is not a valid taint value")
        if taint.effect not in TAINT_EFFECTS:
            raise PolicyError(
                f"join.taints: effect {taint.effect!r} is not one of {', '.join(TAINT_EFFECTS)}"
            )
        out.append(taint)
    return tuple(out)
