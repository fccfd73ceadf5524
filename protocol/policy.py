"""Pool policies and the verdict: which node may join which pool.

A pool policy says what a node of the pool must have (GPU model and count,
minimum driver and CUDA versions, MIG, NVSwitch fabric, active NVLinks per GPU, persistence, the
control-plane version for the kubelet skew check, free disk), which checks are
fatal and which only warn, and the labels and taints the node gets at join.

Public API (the server depends on these names and signatures):

* ``PoolPolicy``: a frozen dataclass; ``MigPolicy``, ``Severity``, ``Taint``.
* ``PRESETS``: ``{"nvke", "lepton-byok", "domino", "cpu"} -> PoolPolicy``; ``preset(name) -> PoolPolicy``.
* ``policy_from_mapping(data: Mapping[str, Any]) -> PoolPolicy``: a decoded YAML/JSON profile;
  strict: unknown keys and wrong types raise :class:`PolicyError` naming the key and what it expects.
* ``assess(observations: Sequence[Observation], policy) -> tuple[tuple[Check, ...], Verdict]``:
  judge every observation (the agent builds its report with this).
* ``evaluate(report: Report, policy: PoolPolicy) -> Verdict``: recompute every status and the verdict
  from the report's observations, ignoring the statuses and verdict the agent wrote. A check the
  policy needs but the report lacks counts as a problem of that check; malformed observations too.
* ``evaluate_checks(report, policy) -> tuple[Check, ...]``: the recomputed checks themselves.

Severity: each check has a default (``protocol.rules.RULES``); ``fatal`` and ``warn`` in the
policy override it by exact name or by glob pattern (``node.*``). An exact name beats a
pattern; between patterns, ``fatal`` wins. A rule reports ``fail`` for a problem and ``warn`` for
an advisory that never fails a node (an idle PCIe link below its top generation, a GPU without
ECC); a ``fail`` becomes ``warn`` when the check's severity is ``warn``. A node passes when no
check is ``fail``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from protocol.errors import PolicyError
from protocol.k8s import Taint, label_key_ok, node_name_problem, parse_labels, parse_taints
from protocol.report import Check, Finding, JsonValue, Observation, Report, Status, Verdict
from protocol.rules import CHECK_NAMES, PER_GPU_CHECKS, RULES_BY_NAME, Context, Malformed, Severity
from protocol.settings import (
    Setting,
    SettingError,
    Table,
    boolean,
    choice,
    integer,
    list_of,
    raw,
    section,
    text,
)

__all__ = [
    "PRESETS",
    "PROFILE",
    "MigPolicy",
    "PoolPolicy",
    "Severity",
    "Taint",
    "assess",
    "evaluate",
    "evaluate_checks",
    "policy_from_mapping",
    "policy_to_mapping",
    "preset",
]


class MigPolicy(StrEnum):
    DISABLED = "disabled"
    ENABLED = "enabled"
    ANY = "any"


@dataclass(frozen=True)
class PoolPolicy:
    name: str
    description: str = ""
    gpu_model: str | None = None  # NVML device name, e.g. "NVIDIA H200"; None: any
    gpu_count: int | None = None  # 0: CPU pool; None: at least one, any number
    min_driver_version: str | None = None  # "570.124.06"
    min_cuda_version: str | None = None  # "12.8"
    mig: MigPolicy = MigPolicy.ANY
    fabric_required: bool | None = None  # None: required when NVSwitches are on the PCI bus
    nvlink_count: int | None = None  # active NVLinks every GPU must have (18 on H100/H200 SXM); None: any
    persistence_required: bool = False
    control_plane_version: str | None = None  # "1.31" or "v1.31.4"
    kubelet_skew_required: bool = False
    min_free_disk_gib: int = 20
    fatal: frozenset[str] = frozenset()
    warn: frozenset[str] = frozenset()
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[Taint, ...] = ()
    allowed_taint_keys: frozenset[str] | None = None  # None: any

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def severity(self, check: str) -> Severity:
        if check in self.fatal:
            return Severity.FATAL
        if check in self.warn:
            return Severity.WARN
        if any(fnmatch.fnmatchcase(check, p) for p in self.fatal):
            return Severity.FATAL
        if any(fnmatch.fnmatchcase(check, p) for p in self.warn):
            return Severity.WARN
        rule = RULES_BY_NAME.get(check)
        return rule.severity if rule else Severity.FATAL


# --------------------------------------------------------------------------- presets

_GPU_TAINT = Taint(key="nvidia.com/gpu", effect="NoSchedule")

PRESETS: Mapping[str, PoolPolicy] = MappingProxyType(
    {
        "nvke": PoolPolicy(
            name="nvke",
            description="NVIDIA Kubernetes Engine GPU pool: taint nvidia.com/gpu:NoSchedule at join",
            taints=(_GPU_TAINT,),
        ),
        "lepton-byok": PoolPolicy(
            name="lepton-byok",
            description=(
                "Lepton bring-your-own-Kubernetes GPU pool: no taint but nvidia.com/gpu:NoSchedule, "
                "kubelet within the skew policy, clocks synchronised"
            ),
            taints=(_GPU_TAINT,),
            allowed_taint_keys=frozenset({"nvidia.com/gpu"}),
            kubelet_skew_required=True,
            fatal=frozenset({"node.time_sync", "node.kubelet"}),
        ),
        "domino": PoolPolicy(
            name="domino",
            description="Domino Data Lab GPU pool: node-pool and GPU labels, clocks synchronised",
            labels=(("dominodatalab.com/node-pool", "default-gpu"), ("nvidia.com/gpu", "true")),
            fatal=frozenset({"node.time_sync"}),
        ),
        "cpu": PoolPolicy(name="cpu", description="CPU pool: no GPU expected", gpu_count=0),
        # Domino's three node pools, labelled and tainted as Domino's reference clusters (dominodatalab's
        # terraform-aws-eks node groups): platform and compute nodes carry no GPU, GPU nodes the GPU taint.
        "domino-platform": PoolPolicy(
            name="domino-platform",
            description="Domino platform nodes (the always-on services): no GPU, clocks synchronised",
            gpu_count=0,
            labels=(("dominodatalab.com/node-pool", "platform"),),
            fatal=frozenset({"node.time_sync"}),
        ),
        "domino-compute": PoolPolicy(
            name="domino-compute",
            description="Domino compute nodes (the default node pool of runs, models and apps): no GPU",
            gpu_count=0,
            labels=(("dominodatalab.com/node-pool", "default"),),
            fatal=frozenset({"node.time_sync"}),
        ),
        "domino-gpu": PoolPolicy(
            name="domino-gpu",
            description="Domino GPU nodes: node-pool default-gpu, nvidia.com/gpu=true, tainted nvidia.com/gpu=true",
            labels=(("dominodatalab.com/node-pool", "default-gpu"), ("nvidia.com/gpu", "true")),
            taints=(Taint(key="nvidia.com/gpu", value="true", effect="NoSchedule"),),
            fatal=frozenset({"node.time_sync"}),
        ),
    }
)


def preset(name: str) -> PoolPolicy:
    try:
        return PRESETS[name]
    except KeyError:
        raise PolicyError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


# --------------------------------------------------------------------------- parsing

_VERSION_HINT = "quote version numbers: '12.8'"
_TAINT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "object",
            "properties": {
                "key": {"type": "string"},
                "value": {"type": "string"},
                "effect": {"type": "string"},
            },
            "additionalProperties": False,
        },
    ]
}
_CHECKS = list_of(text("a check name or a glob pattern like node.*"), "a list of check names")
_GPU = Table(
    "gpu",
    (
        Setting("model", text(), "NVML device name every GPU must have, e.g. NVIDIA H200 (default: any)"),
        Setting("count", integer(), "number of GPUs; 0 is a CPU pool (default: at least one)"),
        Setting("min_driver", text(number_hint=_VERSION_HINT), "lowest driver version, like 570.124.06"),
        Setting("min_cuda", text(number_hint=_VERSION_HINT), "lowest CUDA version, like 12.8"),
        Setting("mig", choice(*(str(m) for m in MigPolicy)), "MIG mode every GPU must be in", "any"),
        Setting(
            "fabric_required",
            boolean(),
            "the NVSwitch fabric must be up (default: when NVSwitches are on the PCI bus)",
        ),
        Setting("persistence_required", boolean(), "persistence mode must be on", False),
        Setting("nvlink_count", integer(), "active NVLinks every GPU must have, 1 to 36 (default: any)"),
    ),
    flags=False,
)
_NODE = Table(
    "node",
    (
        Setting(
            "control_plane_version",
            text(number_hint=_VERSION_HINT),
            "for the kubelet skew check: 1.31 or v1.31.4",
        ),
        Setting("kubelet_skew_required", boolean(), "the kubelet must be within the skew policy", False),
        Setting("min_free_disk_gib", integer(), "free disk the node must have, GiB", 20),
    ),
    flags=False,
)
_CHECKS_TABLE = Table(
    "checks",
    (
        Setting("fatal", _CHECKS, "checks (names or globs) whose failure fails the node", ()),
        Setting("warn", _CHECKS, "checks whose failure is only a warning", ()),
    ),
    flags=False,
)
_JOIN = Table(
    "join",
    (
        Setting(
            "labels",
            raw(
                "a mapping of label keys to strings",
                {"type": "object", "additionalProperties": {"type": "string"}},
            ),
            "labels the node gets at join",
            {},
        ),
        Setting(
            "taints",
            raw("a list of taints", {"type": "array", "items": _TAINT_SCHEMA}, list, name="list"),
            "taints the node gets at join: key[=value]:Effect, or a mapping of key, value and effect",
            (),
        ),
        Setting(
            "allowed_taint_keys",
            list_of(text("a taint key"), "a list of taint keys"),
            "the only taint keys this pool may set (default: any)",
        ),
    ),
    flags=False,
)
PROFILE = Table(
    "pool profile",
    (
        Setting("name", text(), "the pool's name, a lower-case DNS name (default: the preset's)"),
        Setting(
            "preset",
            replace(text(), schema={"type": "string", "enum": sorted(PRESETS)}),
            "a preset the other keys override: " + ", ".join(sorted(PRESETS)),
        ),
        Setting("description", text(), "free text", ""),
        Setting("gpu", section(_GPU), "what every GPU must be"),
        Setting("node", section(_NODE), "what the node must be"),
        Setting("checks", section(_CHECKS_TABLE), "severity overrides"),
        Setting("join", section(_JOIN), "what the node gets at join"),
    ),
    flags=False,
)
"""Every key of a pool profile (docs/settings.md); :func:`policy_from_mapping` checks the shape with
it, then the values (versions, ranges, check names, labels, taints)."""
SECTIONS: Mapping[str, Table] = MappingProxyType(
    {"gpu": _GPU, "node": _NODE, "checks": _CHECKS_TABLE, "join": _JOIN}
)


def _validate_shape(data: Any) -> None:
    if not isinstance(data, Mapping):
        raise PolicyError(f"a pool profile must be a mapping, got {type(data).__name__}")
    try:
        PROFILE.parse(data, partial=True)
    except SettingError as exc:
        raise PolicyError(str(exc)) from exc


def _version(key: str, text: str, parts: tuple[int, ...]) -> str:
    pieces = text.removeprefix("v").split(".")
    # ASCII digits, matched whole (str.isdigit also takes "²" and other Unicode digits)
    if len(pieces) not in parts or not all(re.fullmatch(r"[0-9]{1,9}", p) for p in pieces):
        shape = {(2, 3, 4): "like 570.124.06", (2,): "like 12.8", (2, 3): "like 1.31 or v1.31.4"}[parts]
        raise PolicyError(f"{key}: {text!r} is not a version {shape}")
    return text


def _check_patterns(key: str, items: list[Any]) -> frozenset[str]:
    out = set()
    for item in items:
        if not isinstance(item, str):
            raise PolicyError(f"{key}: entries must be check names (strings), got {item!r}")
        if not any(fnmatch.fnmatchcase(n, item) for n in CHECK_NAMES):
            raise PolicyError(f"{key}: {item!r} names no check; checks: {', '.join(CHECK_NAMES)}")
        out.add(item)
    return frozenset(out)


def policy_from_mapping(data: Mapping[str, Any]) -> PoolPolicy:
    """Build a policy from a decoded profile; ``preset`` (optional) is the base the keys override."""
    _validate_shape(data)
    base = preset(data["preset"]) if "preset" in data else PoolPolicy(name="")
    changes: dict[str, Any] = {}
    name = data.get("name", base.name)
    if not name or node_name_problem(name) is not None:
        raise PolicyError(
            f"name: {name!r} must be a lower-case DNS name (required unless a preset gives one)"
        )
    changes["name"] = name
    if "description" in data:
        changes["description"] = data["description"]
    gpu: Mapping[str, Any] = data.get("gpu", {})
    if "model" in gpu:
        if not gpu["model"].strip():
            raise PolicyError("gpu.model: must not be empty (omit it to allow any model)")
        changes["gpu_model"] = gpu["model"].strip()
    if "count" in gpu:
        if gpu["count"] < 0:
            raise PolicyError("gpu.count: must be 0 (a CPU pool) or more")
        changes["gpu_count"] = gpu["count"]
    if "min_driver" in gpu:
        changes["min_driver_version"] = _version("gpu.min_driver", gpu["min_driver"], (2, 3, 4))
    if "min_cuda" in gpu:
        changes["min_cuda_version"] = _version("gpu.min_cuda", gpu["min_cuda"], (2,))
    if "mig" in gpu:
        try:
            changes["mig"] = MigPolicy(gpu["mig"])
        except ValueError:
            raise PolicyError(f"gpu.mig: {gpu['mig']!r} is not one of disabled, enabled, any") from None
    if "nvlink_count" in gpu:
        if gpu["nvlink_count"] < 1 or gpu["nvlink_count"] > 36:
            raise PolicyError(
                "gpu.nvlink_count: must be 1 to 36 (NVML_NVLINK_MAX_LINKS); omit it to accept any count"
            )
        changes["nvlink_count"] = gpu["nvlink_count"]
    for key in ("fabric_required", "persistence_required"):
        if key in gpu:
            changes[key] = gpu[key]
    node: Mapping[str, Any] = data.get("node", {})
    if "control_plane_version" in node:
        changes["control_plane_version"] = _version(
            "node.control_plane_version", node["control_plane_version"], (2, 3)
        )
    if "kubelet_skew_required" in node:
        changes["kubelet_skew_required"] = node["kubelet_skew_required"]
    if "min_free_disk_gib" in node:
        if node["min_free_disk_gib"] < 0:
            raise PolicyError("node.min_free_disk_gib: must not be negative")
        changes["min_free_disk_gib"] = node["min_free_disk_gib"]
    checks: Mapping[str, Any] = data.get("checks", {})
    fatal = _check_patterns("checks.fatal", checks.get("fatal", []))
    warn = _check_patterns("checks.warn", checks.get("warn", []))
    if both := sorted(fatal & warn):
        raise PolicyError(f"checks: {', '.join(both)} listed as both fatal and warn")
    changes["fatal"] = (base.fatal - warn) | fatal
    changes["warn"] = (base.warn - fatal) | warn
    join: Mapping[str, Any] = data.get("join", {})
    labels = {**base.label_map, **parse_labels(join.get("labels", {}))}
    changes["labels"] = tuple(sorted(labels.items()))
    if "taints" in join:
        changes["taints"] = parse_taints(join["taints"])
    if "allowed_taint_keys" in join:
        keys = join["allowed_taint_keys"]
        if not all(isinstance(k, str) and label_key_ok(k) for k in keys):
            raise PolicyError(f"join.allowed_taint_keys: {keys!r} must be a list of taint keys")
        changes["allowed_taint_keys"] = frozenset(keys)
    policy = replace(base, **changes)
    if policy.allowed_taint_keys is not None:
        extra = sorted(str(t) for t in policy.taints if t.key not in policy.allowed_taint_keys)
        if extra:
            raise PolicyError(
                f"join.taints: {', '.join(extra)} not allowed in a {data.get('preset') or policy.name} pool "
                f"(allowed keys: {', '.join(sorted(policy.allowed_taint_keys))})"
            )
    return policy


def policy_to_mapping(policy: PoolPolicy) -> dict[str, Any]:
    """A profile mapping that :func:`policy_from_mapping` turns into an equal policy (presets resolved)."""
    gpu: dict[str, Any] = {
        "mig": str(policy.mig),
        "persistence_required": policy.persistence_required,
    }
    for key, value in (
        ("model", policy.gpu_model),
        ("count", policy.gpu_count),
        ("min_driver", policy.min_driver_version),
        ("min_cuda", policy.min_cuda_version),
        ("fabric_required", policy.fabric_required),
        ("nvlink_count", policy.nvlink_count),
    ):
        if value is not None:
            gpu[key] = value
    node: dict[str, Any] = {
        "kubelet_skew_required": policy.kubelet_skew_required,
        "min_free_disk_gib": policy.min_free_disk_gib,
    }
    if policy.control_plane_version is not None:
        node["control_plane_version"] = policy.control_plane_version
    return {
        "name": policy.name,
        "description": policy.description,
        "gpu": gpu,
        "node": node,
        "checks": {"fatal": sorted(policy.fatal), "warn": sorted(policy.warn)},
        "join": {
            "labels": dict(policy.labels),
            "taints": [str(t) for t in policy.taints],
            **(
                {"allowed_taint_keys": sorted(policy.allowed_taint_keys)}
                if policy.allowed_taint_keys is not None
                else {}
            ),
        },
    }


# --------------------------------------------------------------------------- verdict


def _judge(rule_name: str, ctx: Context, observation: Observation | None, policy: PoolPolicy) -> Check:
    rule = RULES_BY_NAME[rule_name]
    observations: Mapping[str, JsonValue]
    if observation is None and rule_name in PER_GPU_CHECKS and policy.gpu_count == 0:
        status, observed, expected = Status.SKIP, "missing", rule.passes_when
        reason = "not in the report (an older agent); this pool expects no GPU, so there is none to judge"
        source, observations = rule.source, {}
    elif observation is None:
        status, observed, expected = Status.FAIL, "missing", rule.passes_when
        reason, source, observations = "the report has no result for this check", rule.source, {}
    else:
        source, observations = observation.source, observation.observations
        try:
            out = rule.fn(ctx)
            status, observed, expected, reason = out.status, out.observed, out.expected, out.reason
        except Malformed as exc:
            status, observed, expected = Status.FAIL, "malformed", rule.passes_when
            reason = f"observations malformed: {exc}"
    if status is Status.FAIL and policy.severity(rule_name) is Severity.WARN:
        status = Status.WARN
    return Check(rule_name, status, observed, expected, source, reason, observations)


def _verdict(checks: Sequence[Check]) -> Verdict:
    failures = tuple(Finding(c.name, c.reason) for c in checks if c.status is Status.FAIL)
    warnings = tuple(Finding(c.name, c.reason) for c in checks if c.status is Status.WARN)
    return Verdict(passed=not failures, failures=failures, warnings=warnings)


def assess(observations: Sequence[Observation], policy: PoolPolicy) -> tuple[tuple[Check, ...], Verdict]:
    """Judge observations under ``policy``: one :class:`Check` per known check, then the verdict.

    Observations of unknown checks are kept out of the verdict and reported as warnings.
    """
    by_name: dict[str, Observation] = {}
    for o in observations:
        by_name.setdefault(o.name, o)
    ctx = Context(policy, by_name)
    checks = [_judge(name, ctx, by_name.get(name), policy) for name in CHECK_NAMES]
    verdict = _verdict(checks)
    unknown = sorted(set(by_name) - set(CHECK_NAMES))
    if unknown:
        notes = tuple(Finding(n, "unknown check, not evaluated by this version") for n in unknown)
        verdict = replace(verdict, warnings=verdict.warnings + notes)
    return tuple(checks), verdict


def judge(report: Report, policy: PoolPolicy) -> tuple[tuple[Check, ...], Verdict]:
    """Every check and the verdict, recomputed from ``report``'s observations alone."""
    return assess([Observation(c.name, c.source, c.observations) for c in report.checks], policy)


def evaluate_checks(report: Report, policy: PoolPolicy) -> tuple[Check, ...]:
    return judge(report, policy)[0]


def evaluate(report: Report, policy: PoolPolicy) -> Verdict:
    """The verdict recomputed from ``report``'s observations alone."""
    return judge(report, policy)[1]
