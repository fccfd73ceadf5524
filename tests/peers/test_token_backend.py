"""The ``kubernetes`` token backend against the real kube-apiserver and kube-controller-manager v1.36.3.

The identities are made from the manifests docs/join-backends.md shows (ServiceAccount, token Secret,
Role, RoleBinding, kubeconfig), so these tests also prove the documented RBAC is enough. Every test
logs at DEBUG and asserts that the token secret reaches no log record and no error message.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.errors import TokenBackendError, TokenConflictError
from server.tokens.kubernetes import KubernetesBackend
from server.tokens.token import BootstrapToken, new_token
from tests.support.control_plane import ControlPlane
from tests.support.kube_identities import (
    Identity,
    client_certificate,
    docs_manifest,
    service_account,
    set_role_verbs,
    wait_allowed,
)
from tests.support.kube_pki import TestCA
from tests.tokens.conftest import assert_no_secret

GROUPS = ("system:bootstrappers:kubeadm:default-node-token", "system:bootstrappers:nodetrust:hgx-h200")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-backend")


@pytest.fixture(scope="module")
def identity(control_plane: ControlPlane, work: Path) -> Identity:
    return service_account(control_plane, "nodeserver", work)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


@pytest.fixture
def backend(identity: Identity) -> KubernetesBackend:
    return KubernetesBackend.from_kubeconfig(identity.kubeconfig, timeout=30)


@pytest.fixture
def token(backend: KubernetesBackend) -> Iterator[BootstrapToken]:
    made = new_token(
        ttl_s=900,
        now=int(time.time()),
        description="nodetrust join of gpu-node-01 (hgx-h200)",
        extra_groups=GROUPS,
    )
    yield made
    backend.delete(made.token_id, "")  # 404 when the test removed it: fine


def _secret(cp: ControlPlane, token_id: str) -> dict[str, Any] | None:
    got = cp.kubectl(
        "-n",
        "kube-system",
        "get",
        "secret",
        f"bootstrap-token-{token_id}",
        "--ignore-not-found",
        "-o",
        "json",
    )
    return json.loads(got.stdout) if got.stdout.strip() else None


def _cluster_info(cp: ControlPlane) -> dict[str, str]:
    return cp.kubectl_json("-n", "kube-public", "get", "configmap", "cluster-info")["data"]  # type: ignore[no-any-return]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_the_secret_is_what_the_docs_show(
    control_plane: ControlPlane,
    backend: KubernetesBackend,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    backend.check()
    assert backend.create(token) == f"kube-system/bootstrap-token-{token.token_id}"
    stored = _secret(control_plane, token.token_id)
    assert stored is not None
    documented = docs_manifest("Secret", "bootstrap-token-abcdef")
    assert stored["type"] == documented["type"] == "bootstrap.kubernetes.io/token"
    assert stored["metadata"]["labels"] == documented["metadata"]["labels"]
    assert set(stored["data"]) == set(documented["stringData"])
    data = {k: base64.b64decode(v).decode() for k, v in stored["data"].items()}
    assert data["token-id"] == token.token_id
    assert data["token-secret"] == token.secret
    assert data["expiration"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(token.expires_at))
    assert data["usage-bootstrap-authentication"] == data["usage-bootstrap-signing"] == "true"
    assert data["auth-extra-groups"] == ",".join(GROUPS) == documented["stringData"]["auth-extra-groups"]
    assert data["description"] == "nodetrust join of gpu-node-01 (hgx-h200)"
    assert_no_secret(token.secret, logs)
    assert any(token.token_id in r.getMessage() for r in logs.records)


def test_the_bootstrap_signer_signs_cluster_info_with_the_token_and_drops_it_on_delete(
    control_plane: ControlPlane, backend: KubernetesBackend, token: BootstrapToken
) -> None:
    backend.create(token)
    key = f"jws-kubeconfig-{token.token_id}"
    jws = control_plane.wait_for(f"{key} in cluster-info", lambda: _cluster_info(control_plane).get(key))
    # A detached JWS (HS256, keyed by the token secret) over cluster-info's kubeconfig: what kubeadm checks.
    header_b64, payload, signature = jws.split(".")
    assert payload == ""
    assert json.loads(base64.urlsafe_b64decode(header_b64 + "==")) == {"alg": "HS256", "kid": token.token_id}
    signed = f"{header_b64}.{_b64url(_cluster_info(control_plane)['kubeconfig'].encode())}".encode()
    assert signature == _b64url(hmac.new(token.secret.encode(), signed, hashlib.sha256).digest())

    backend.delete(token.token_id, f"kube-system/{token.secret_name}")
    control_plane.wait_for(
        f"{key} to leave cluster-info", lambda: True if key not in _cluster_info(control_plane) else None
    )


def test_the_minted_token_authenticates_as_its_bootstrap_user_until_deleted(
    control_plane: ControlPlane, backend: KubernetesBackend, token: BootstrapToken
) -> None:
    backend.create(token)
    status, review = control_plane.whoami(token.value)
    assert status == 201, review
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:bootstrap:{token.token_id}"
    assert user["groups"] == ["system:bootstrappers", *GROUPS, "system:authenticated"]

    backend.delete(token.token_id, "")
    control_plane.wait_for(
        "the deleted token to be refused",
        lambda: True if control_plane.whoami(token.value)[0] == 401 else None,
    )
    assert _secret(control_plane, token.token_id) is None


def test_the_token_cleaner_deletes_an_expired_token(
    control_plane: ControlPlane, backend: KubernetesBackend, logs: pytest.LogCaptureFixture
) -> None:
    short = new_token(ttl_s=3, now=int(time.time()), extra_groups=GROUPS)
    backend.create(short)
    control_plane.wait_for(
        "the TokenCleaner to delete the expired token",
        lambda: True if _secret(control_plane, short.token_id) is None else None,
        timeout=120,
    )
    assert control_plane.whoami(short.value)[0] == 401
    backend.delete(short.token_id, "")  # already gone (404): fine, and said so at debug level only
    # A real API server stores a Secret whose expiration has passed (the double refuses it with 422):
    # the authenticator never accepts it, and the TokenCleaner removes it.
    stale = new_token(ttl_s=60, now=int(time.time()) - 3600)
    backend.create(stale)
    assert control_plane.whoami(stale.value)[0] == 401
    control_plane.wait_for(
        "the TokenCleaner to delete the stale token",
        lambda: True if _secret(control_plane, stale.token_id) is None else None,
        timeout=120,
    )
    assert any("already gone" in r.getMessage() and r.levelno == logging.DEBUG for r in logs.records)


def test_a_duplicate_id_is_a_conflict_and_the_first_secret_stays(
    control_plane: ControlPlane,
    backend: KubernetesBackend,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    backend.create(token)
    again = BootstrapToken(token.token_id, "ffffffffffffffff", token.expires_at)
    with pytest.raises(TokenConflictError) as exc:
        backend.create(again)
    assert str(exc.value) == (
        f"409 Conflict while trying to create Secret kube-system/bootstrap-token-{token.token_id}: "
        f'secrets "bootstrap-token-{token.token_id}" already exists; mint a new token and retry'
    )
    stored = _secret(control_plane, token.token_id)
    assert stored is not None
    assert base64.b64decode(stored["data"]["token-secret"]).decode() == token.secret
    assert_no_secret(token.secret, logs, exc.value)
    assert_no_secret(again.secret, logs, exc.value)


def test_an_unknown_bearer_token_is_401(
    control_plane: ControlPlane, identity: Identity, work: Path, token: BootstrapToken
) -> None:
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    doc["users"][0]["user"] = {"token": "not-a-token-this-cluster-knows"}
    path = work / "unknown-token.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    backend = KubernetesBackend.from_kubeconfig(path, timeout=30)
    for attempt in (backend.check, lambda: backend.create(token)):
        with pytest.raises(TokenBackendError) as exc:
            attempt()
        assert str(exc.value) == (
            f"401 Unauthorized: the API server {control_plane.host_url} did not accept the credentials of "
            f"kubeconfig user nodeserver in {path}; the token or client certificate is wrong, expired or "
            "from another cluster"
        )
    assert _secret(control_plane, token.token_id) is None


@pytest.mark.parametrize("removed", ["create", "delete"])
def test_each_verb_of_the_documented_role_is_needed(
    control_plane: ControlPlane, work: Path, removed: str, logs: pytest.LogCaptureFixture
) -> None:
    who = service_account(control_plane, f"nodeserver-no-{removed}", work)
    kept = "delete" if removed == "create" else "create"
    set_role_verbs(control_plane, who, (kept,))
    wait_allowed(control_plane, who, (removed,), allowed=False)
    backend = KubernetesBackend.from_kubeconfig(who.kubeconfig, timeout=30)
    with pytest.raises(TokenBackendError) as exc:
        backend.check()
    assert str(exc.value) == (
        "403 Forbidden: the nodeserver identity needs create/delete on secrets in kube-system; kubeconfig user "
        f"nodeserver in {who.kubeconfig} may not {removed} them (see docs/join-backends.md for a minimal Role "
        "and RoleBinding)"
    )
    probe = new_token(ttl_s=600, now=int(time.time()))
    if removed == "create":
        with pytest.raises(TokenBackendError) as refused:
            backend.create(probe)
        name = f"bootstrap-token-{probe.token_id}"
        said = (
            f'secrets is forbidden: User "{who.user}" cannot create resource "secrets" in API group "" '
            'in the namespace "kube-system"'
        )
    else:
        victim = new_token(ttl_s=600, now=int(time.time()))
        KubernetesBackend.from_kubeconfig(control_plane.admin_kubeconfig, timeout=30).create(victim)
        with pytest.raises(TokenBackendError) as refused:
            backend.delete(victim.token_id, "")
        name = f"bootstrap-token-{victim.token_id}"
        said = (
            f'secrets "{name}" is forbidden: User "{who.user}" cannot delete resource "secrets" in API group "" '
            'in the namespace "kube-system"'
        )
        assert _secret(control_plane, victim.token_id) is not None
        KubernetesBackend.from_kubeconfig(control_plane.admin_kubeconfig, timeout=30).delete(
            victim.token_id, ""
        )
    assert str(refused.value) == (
        "403 Forbidden: the nodeserver identity needs create/delete on secrets in kube-system (kubeconfig user "
        f"nodeserver in {who.kubeconfig}; see docs/join-backends.md for a minimal Role and RoleBinding); "
        f"the API server said: {said}"
    )
    assert_no_secret(probe.secret, logs, exc.value, refused.value)
    # Put the verb back: the start check passes again.
    set_role_verbs(control_plane, who, ("create", "delete"))
    wait_allowed(control_plane, who, ("create", "delete"))
    backend.check()


def test_no_role_at_all_names_both_verbs(control_plane: ControlPlane, work: Path) -> None:
    who = service_account(control_plane, "nodeserver-no-rbac", work)
    control_plane.kubectl("-n", "kube-system", "delete", "rolebinding", who.role)
    wait_allowed(control_plane, who, ("create", "delete"), allowed=False)
    with pytest.raises(
        TokenBackendError, match=r"may not create or delete them \(see docs/join-backends.md"
    ):
        KubernetesBackend.from_kubeconfig(who.kubeconfig, timeout=30).check()


def test_a_client_certificate_identity(
    control_plane: ControlPlane, work: Path, logs: pytest.LogCaptureFixture
) -> None:
    """``kubeadm kubeconfig user`` (embedded cert and key data), bound by a ``kind: User`` RoleBinding;
    the same pair as files beside the kubeconfig (a relative path) works too, and no key stays on disk."""
    who = client_certificate(control_plane, "nodeserver-cert", work)
    wait_allowed(control_plane, who, ("create", "delete"))
    before = {p.name for p in Path("/tmp").iterdir()}
    backend = KubernetesBackend.from_kubeconfig(who.kubeconfig, timeout=30)
    assert {p.name for p in Path("/tmp").iterdir() if p.name.startswith("nodeserver-kube-")} <= before
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            assert "nodeserver-kube-client" not in os.readlink(f"/proc/self/fd/{fd}")
    backend.check()
    made = new_token(ttl_s=600, now=int(time.time()), extra_groups=GROUPS)
    backend.create(made)
    assert control_plane.whoami(made.value)[0] == 201

    doc = yaml.safe_load(who.kubeconfig.read_text())
    user = doc["users"][0]["user"]
    files = work / "cert-files"
    files.mkdir()
    (files / "client.crt").write_bytes(base64.b64decode(user.pop("client-certificate-data")))
    (files / "client.key").write_bytes(base64.b64decode(user.pop("client-key-data")))
    (files / "client.key").chmod(0o600)
    user.update({"client-certificate": "client.crt", "client-key": str(files / "client.key")})
    (files / "kubeconfig").write_text(yaml.safe_dump(doc))
    KubernetesBackend.from_kubeconfig(files / "kubeconfig", timeout=30).delete(made.token_id, "")
    assert _secret(control_plane, made.token_id) is None
    assert_no_secret(made.secret, logs)


def test_an_exec_plugin_identity(control_plane: ControlPlane, identity: Identity, work: Path) -> None:
    """A ``client.authentication.k8s.io/v1`` plugin (as EKS, GKE, AKS use) that prints the SA token."""
    assert identity.token is not None
    plugin = work / "credential-plugin"
    answer = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": identity.token},
    }
    plugin.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({json.dumps(answer)!r})\n")
    plugin.chmod(0o700)
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    doc["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    path = work / "exec.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    backend = KubernetesBackend.from_kubeconfig(path, timeout=30)
    backend.check()
    made = new_token(ttl_s=600, now=int(time.time()))
    backend.create(made)
    backend.delete(made.token_id, "")
    assert _secret(control_plane, made.token_id) is None


def test_a_token_file_identity_is_read_on_every_request(
    control_plane: ControlPlane, identity: Identity, work: Path
) -> None:
    assert identity.token is not None
    token_file = work / "sa-token"
    token_file.write_text(identity.token + "\n")
    token_file.chmod(0o600)
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    doc["users"][0]["user"] = {"tokenFile": str(token_file)}
    path = work / "token-file.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    backend = KubernetesBackend.from_kubeconfig(path, timeout=30)
    made = new_token(ttl_s=600, now=int(time.time()))
    backend.check()
    backend.create(made)
    token_file.write_text("rotated-to-something-this-cluster-does-not-know")
    with pytest.raises(TokenBackendError, match=r"^401 Unauthorized"):
        backend.delete(made.token_id, "")
    token_file.write_text(identity.token)
    backend.delete(made.token_id, "")
    assert _secret(control_plane, made.token_id) is None


def test_tls_failures_with_the_real_server(
    control_plane: ControlPlane, identity: Identity, work: Path, token: BootstrapToken
) -> None:
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    stranger = TestCA("some other cluster")

    def backend_with(cluster: dict[str, Any], name: str) -> KubernetesBackend:
        changed = yaml.safe_load(yaml.safe_dump(doc))
        changed["clusters"][0]["cluster"].update(cluster)
        path = work / name
        path.write_text(yaml.safe_dump(changed))
        return KubernetesBackend.from_kubeconfig(path, timeout=30)

    other_ca = base64.b64encode(stranger.cert_pem).decode()
    with pytest.raises(TokenBackendError) as exc:
        backend_with({"certificate-authority-data": other_ca}, "other-ca.kubeconfig").create(token)
    assert str(exc.value).startswith(
        f"TLS verification of {control_plane.host_url} failed (unable to get local issuer certificate): "
        "the certificate-authority(-data) in "
    )
    with pytest.raises(TokenBackendError) as exc:
        backend_with({"tls-server-name": "api.example.org"}, "wrong-name.kubeconfig").check()
    assert str(exc.value).startswith(
        f"TLS verification of {control_plane.host_url} failed (Hostname mismatch, certificate is not valid for "
        "'api.example.org'.)"
    )
    assert str(exc.value).endswith(", and tls-server-name one of its names")
    with pytest.raises(TokenBackendError) as exc:
        no_ca = yaml.safe_load(yaml.safe_dump(doc))
        del no_ca["clusters"][0]["cluster"]["certificate-authority-data"]
        (work / "no-ca.kubeconfig").write_text(yaml.safe_dump(no_ca))
        KubernetesBackend.from_kubeconfig(work / "no-ca.kubeconfig", timeout=30).check()
    assert str(exc.value).startswith(
        f"TLS verification of {control_plane.host_url} failed"
    )  # the system store
    # The serving certificate carries kubeadm's names: tls-server-name may be any of them.
    backend_with({"tls-server-name": "kubernetes.default.svc"}, "right-name.kubeconfig").check()
    assert _secret(control_plane, token.token_id) is None


def test_a_client_certificate_from_another_ca_is_refused(
    control_plane: ControlPlane, identity: Identity, work: Path
) -> None:
    stranger = TestCA("some other cluster").issue_client("intruder")
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    doc["users"][0]["user"] = {
        "client-certificate-data": base64.b64encode(stranger.cert_pem).decode(),
        "client-key-data": base64.b64encode(stranger.key_pem).decode(),
    }
    path = work / "intruder.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(TokenBackendError, match=r"^401 Unauthorized: .* did not accept the credentials"):
        KubernetesBackend.from_kubeconfig(path, timeout=30).check()


def test_a_wrong_path_prefix_is_named_as_the_url_not_the_role(
    control_plane: ControlPlane, identity: Identity, work: Path, token: BootstrapToken
) -> None:
    """The real server answers a path it does not serve with 403 (RBAC on a non-resource URL), not 404."""
    doc = yaml.safe_load(identity.kubeconfig.read_text())
    server = control_plane.host_url + "/k8s/clusters/c-1"
    doc["clusters"][0]["cluster"]["server"] = server
    path = work / "prefix.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    backend = KubernetesBackend.from_kubeconfig(path, timeout=30)
    with pytest.raises(TokenBackendError) as exc:
        backend.create(token)
    assert str(exc.value) == (
        f"403 Forbidden while trying to create Secret kube-system/bootstrap-token-{token.token_id}: the API server "
        f"refused the path itself, so clusters[].cluster.server in {path} ({server}) is not the API server's URL, "
        'or its path prefix is wrong; the API server said: forbidden: User "system:serviceaccount:nodetrust:'
        'nodeserver" cannot post path "/k8s/clusters/c-1/api/v1/namespaces/kube-system/secrets"'
    )
    with pytest.raises(
        TokenBackendError, match=r"^403 Forbidden while trying to review its own permission to create"
    ):
        backend.check()
    # With system:masters the same URL is a 404, which names the prefix too.
    admin = yaml.safe_load(control_plane.admin_kubeconfig.read_text())
    admin["clusters"][0]["cluster"]["server"] = server
    admin_path = work / "prefix-admin.kubeconfig"
    admin_path.write_text(yaml.safe_dump(admin))
    with pytest.raises(
        TokenBackendError, match=r"^404 Not Found while trying to create Secret .* path prefix right"
    ):
        KubernetesBackend.from_kubeconfig(admin_path, timeout=30).create(token)
    assert _secret(control_plane, token.token_id) is None
