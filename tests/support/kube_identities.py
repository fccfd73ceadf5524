"""nodeserver identities in the real control plane, made from the manifests docs/join-backends.md shows.

Public API::

    DOCS = ROOT / "docs" / "join-backends.md"
    docs_manifests() -> list[dict]                  # every YAML document of the doc's ```yaml blocks
    docs_manifest(kind: str, name: str | None = None) -> dict
    @dataclass class Identity:
        name: str; user: str; kubeconfig: Path; role: str
        token: str | None                            # the bearer token (service accounts), never logged
    service_account(cp, name, work, *, verbs=("create", "delete")) -> Identity
        # the doc's ServiceAccount, token Secret, Role and RoleBinding, renamed to ``name``;
        # a kubeconfig shaped like the doc's (token inline)
    client_certificate(cp, name, work, *, org="nodetrust:servers") -> Identity
        # ``kubeadm kubeconfig user --client-name name``, bound by a ``kind: User`` RoleBinding
    set_role_verbs(cp, identity, verbs) -> None     # rewrite the Role's verbs (RBAC then takes a moment)
    wait_allowed(cp, identity, verbs, allowed=True, timeout=60.0) -> None
        # until SelfSubjectAccessReviews for each verb agree with ``allowed``

Names are renamed so that each test module has identities of its own in one shared control plane.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.control_plane import ControlPlane
from tests.support.peers import ROOT

DOCS = ROOT / "docs" / "join-backends.md"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)
NAMESPACE = "nodetrust"


def docs_manifests() -> list[dict[str, Any]]:
    """Every YAML document in the ```yaml blocks of docs/join-backends.md that has a ``kind``."""
    out = []
    for block in _BLOCK.findall(DOCS.read_text()):
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and "kind" in doc:
                out.append(doc)
    return out


def docs_manifest(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (and ``metadata.name``) the doc shows; AssertionError if not exactly one."""
    found = [
        d for d in docs_manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"docs/join-backends.md shows {len(found)} {kind} manifests named {name!r}"
    return copy.deepcopy(found[0])


@dataclass
class Identity:
    name: str
    user: str
    kubeconfig: Path
    role: str
    token: str | None = field(default=None, repr=False)


def _role_and_binding(name: str, verbs: tuple[str, ...], subject: dict[str, Any]) -> list[dict[str, Any]]:
    role = docs_manifest("Role")
    role["metadata"]["name"] = name
    role["rules"][0]["verbs"] = list(verbs)
    binding = docs_manifest("RoleBinding")
    binding["metadata"]["name"] = name
    binding["roleRef"]["name"] = name
    binding["subjects"] = [subject]
    return [role, binding]


def _apply(cp: ControlPlane, docs: list[dict[str, Any]]) -> None:
    cp.apply(yaml.safe_dump_all(docs))


def _write_kubeconfig(cp: ControlPlane, path: Path, user: dict[str, Any]) -> Path:
    """A kubeconfig shaped like the doc's, pointing at the forwarded API server."""
    doc = docs_manifest("Config")
    doc["clusters"][0]["cluster"] = {
        "server": cp.host_url,
        "certificate-authority-data": base64.b64encode(cp.ca_cert.read_bytes()).decode(),
    }
    doc["users"][0]["user"] = user
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


def _ensure_namespace(cp: ControlPlane) -> None:
    _apply(cp, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])


def service_account(
    cp: ControlPlane, name: str, work: Path, *, verbs: tuple[str, ...] = ("create", "delete")
) -> Identity:
    _ensure_namespace(cp)
    sa = docs_manifest("ServiceAccount")
    sa["metadata"]["name"] = name
    secret = docs_manifest("Secret", "nodeserver-token")
    secret["metadata"]["name"] = f"{name}-token"
    secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] = name
    subject = docs_manifest("RoleBinding")["subjects"][0]
    subject["name"] = name
    _apply(cp, [sa, secret, *_role_and_binding(name, verbs, subject)])

    def token() -> str | None:
        got = cp.kubectl_json("-n", NAMESPACE, "get", "secret", f"{name}-token")
        value = got.get("data", {}).get("token")
        return base64.b64decode(value).decode() if value else None

    bearer = cp.wait_for(f"the token controller to fill Secret {NAMESPACE}/{name}-token", token)
    kubeconfig = _write_kubeconfig(cp, work / f"{name}.kubeconfig", {"token": bearer})
    return Identity(name, f"system:serviceaccount:{NAMESPACE}:{name}", kubeconfig, name, bearer)


def client_certificate(
    cp: ControlPlane, name: str, work: Path, *, org: str = "nodetrust:servers"
) -> Identity:
    made = cp.kubeadm(
        "kubeconfig", "user", f"--config={cp.work / 'kubeadm.yaml'}", f"--client-name={name}", f"--org={org}"
    )
    issued = yaml.safe_load(made.stdout)
    user = issued["users"][0]["user"]
    assert set(user) == {"client-certificate-data", "client-key-data"}, sorted(user)
    subject = {"kind": "User", "name": name, "apiGroup": "rbac.authorization.k8s.io"}
    _apply(cp, _role_and_binding(name, ("create", "delete"), subject))
    kubeconfig = _write_kubeconfig(cp, work / f"{name}.kubeconfig", user)
    return Identity(name, name, kubeconfig, name)


def set_role_verbs(cp: ControlPlane, identity: Identity, verbs: tuple[str, ...]) -> None:
    patch = [{"op": "replace", "path": "/rules/0/verbs", "value": list(verbs)}]
    cp.kubectl("-n", "kube-system", "patch", "role", identity.role, "--type=json", f"-p={json.dumps(patch)}")


def wait_allowed(
    cp: ControlPlane,
    identity: Identity,
    verbs: tuple[str, ...],
    *,
    allowed: bool = True,
    timeout: float = 60.0,
) -> None:
    """RBAC changes reach the authorizer through a watch: wait until each verb's review says ``allowed``."""

    def agree() -> bool | None:
        for verb in verbs:
            got = cp.kubectl(
                "auth",
                "can-i",
                verb,
                "secrets",
                "-n",
                "kube-system",
                check=False,
                kubeconfig=identity.kubeconfig,
            )
            if (got.returncode == 0) != allowed:  # kubectl auth can-i: exit 0 yes, 1 no
                return None
        return True

    cp.wait_for(
        f"RBAC to {'allow' if allowed else 'refuse'} {identity.user} {'/'.join(verbs)}", agree, timeout
    )
