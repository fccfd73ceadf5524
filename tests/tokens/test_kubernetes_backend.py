"""The Kubernetes token backend against the API server test double (a real HTTPS server on loopback)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from server.errors import TokenBackendError, TokenConflictError
from server.tokens.kubernetes import KubernetesBackend
from server.tokens.token import BootstrapToken, new_token
from tests.support.kube_apiserver_double import KubeApiServerDouble
from tests.support.kube_pki import Issued, TestCA
from tests.tokens.conftest import CERT_USER, SA_TOKEN, SA_USER, KubeconfigWriter, assert_no_secret, b64


def _backend(path: Path, timeout: float = 5.0) -> KubernetesBackend:
    return KubernetesBackend.from_kubeconfig(path, timeout=timeout)


def test_create_check_delete_with_a_service_account_token(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    backend = _backend(write_kubeconfig())
    backend.check()
    ref = backend.create(token)
    assert ref == f"kube-system/bootstrap-token-{token.token_id}"

    stored = apiserver.secret_data(f"bootstrap-token-{token.token_id}")
    assert stored["token-id"] == token.token_id
    assert stored["token-secret"] == token.secret  # the cluster has it; nobody else does
    assert stored["usage-bootstrap-authentication"] == "true"
    assert stored["auth-extra-groups"] == ",".join(token.extra_groups)
    secret = apiserver.secrets[("kube-system", f"bootstrap-token-{token.token_id}")]
    assert secret["type"] == "bootstrap.kubernetes.io/token"
    assert secret["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "nodetrust"}

    post = next(c for c in apiserver.calls if c.path == "/api/v1/namespaces/kube-system/secrets")
    assert post.method == "POST"
    assert post.content_type == "application/json"
    assert post.user == SA_USER
    assert post.status == 201
    assert post.authorization == f"Bearer {SA_TOKEN}"

    backend.delete(token.token_id, ref)
    assert ("kube-system", f"bootstrap-token-{token.token_id}") not in apiserver.secrets
    backend.delete(token.token_id, ref)  # 404: already gone is fine
    assert [c.status for c in apiserver.calls if c.method == "DELETE"] == [200, 404]
    reviews = [
        c.body["spec"]["resourceAttributes"]["verb"] for c in apiserver.calls if "selfsubject" in c.path
    ]
    assert reviews == ["create", "delete"]
    assert_no_secret(token.secret, logs)
    assert any(token.token_id in r.getMessage() for r in logs.records)  # the id is what gets logged


def test_client_certificate_files(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    client_cert: Issued,
    cluster_ca: TestCA,
    tmp_path: Path,
) -> None:
    token = new_token(ttl_s=60, now=int(time.time()))
    (tmp_path / "ca.crt").write_bytes(cluster_ca.cert_pem)
    (tmp_path / "client.crt").write_bytes(client_cert.cert_pem)
    (tmp_path / "client.key").write_bytes(client_cert.key_pem)
    path = write_kubeconfig(
        cluster={"server": apiserver.url, "certificate-authority": str(tmp_path / "ca.crt")},
        user={"client-certificate": "client.crt", "client-key": str(tmp_path / "client.key")},
    )
    backend = _backend(path)
    backend.check()
    backend.create(token)
    assert {c.user for c in apiserver.calls} == {CERT_USER}
    assert {c.groups for c in apiserver.calls} == {("nodetrust:servers",)}
    assert all(c.authorization is None for c in apiserver.calls)


def test_embedded_client_certificate_data_leaves_no_key_file(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    client_cert: Issued,
    token: BootstrapToken,
    tmp_path: Path,
) -> None:
    path = write_kubeconfig(
        user={
            "client-certificate-data": b64(client_cert.cert_pem),
            "client-key-data": b64(client_cert.key_pem),
        }
    )
    before = set(Path("/tmp").iterdir())
    backend = _backend(path)
    backend.create(token)
    assert apiserver.calls[-1].user == CERT_USER
    leftovers = [p for p in set(Path("/tmp").iterdir()) - before if p.name.startswith("nodeserver-kube-")]
    assert leftovers == []
    own_fds = os.listdir("/proc/self/fd")
    for fd in own_fds:
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        assert "nodeserver-kube-client" not in target


def test_token_file_is_read_on_every_request(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, tmp_path: Path, token: BootstrapToken
) -> None:
    token_file = tmp_path / "sa-token"
    token_file.write_text(SA_TOKEN + "\n")
    backend = _backend(write_kubeconfig(user={"tokenFile": str(token_file)}))
    backend.create(token)
    apiserver.tokens = {"rotated-token": SA_USER}
    token_file.write_text("rotated-token")
    backend.delete(token.token_id, "")
    assert [c.authorization for c in apiserver.calls] == [f"Bearer {SA_TOKEN}", "Bearer rotated-token"]
    assert [c.status for c in apiserver.calls] == [201, 200]


def test_server_url_with_a_path_prefix(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    cluster_ca: TestCA,
    token: BootstrapToken,
) -> None:
    path = write_kubeconfig(
        cluster={
            "server": apiserver.url + "/k8s/clusters/c-1",
            "certificate-authority-data": b64(cluster_ca.cert_pem),
        }
    )
    with pytest.raises(TokenBackendError, match=r"404 Not Found.*path prefix"):
        _backend(path).create(token)
    assert apiserver.calls[-1].path == "/k8s/clusters/c-1/api/v1/namespaces/kube-system/secrets"


def test_tls_server_name(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    cluster_ca: TestCA,
    token: BootstrapToken,
) -> None:
    ca = b64(cluster_ca.cert_pem)
    good = write_kubeconfig(
        cluster={"server": apiserver.url, "certificate-authority-data": ca, "tls-server-name": "localhost"}
    )
    _backend(good).create(token)
    bad = write_kubeconfig(
        cluster={
            "server": apiserver.url,
            "certificate-authority-data": ca,
            "tls-server-name": "api.example.org",
        },
        name="bad",
    )
    with pytest.raises(TokenBackendError, match=r"TLS verification .* tls-server-name"):
        _backend(bad).check()


def test_wrong_ca_is_a_tls_failure(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    other_ca: TestCA,
    token: BootstrapToken,
) -> None:
    path = write_kubeconfig(
        cluster={"server": apiserver.url, "certificate-authority-data": b64(other_ca.cert_pem)}
    )
    backend = _backend(path)
    with pytest.raises(TokenBackendError, match=r"TLS verification of https://127.0.0.1:.* failed") as exc:
        backend.create(token)
    assert "certificate-authority" in str(exc.value)
    assert apiserver.calls == []  # nothing was sent


def test_system_trust_store_does_not_know_the_test_ca(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter
) -> None:
    backend = _backend(write_kubeconfig(cluster={"server": apiserver.url}))
    with pytest.raises(TokenBackendError, match=r"TLS verification"):
        backend.check()


def test_client_certificate_from_another_ca_fails_the_handshake(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, other_ca: TestCA
) -> None:
    stranger = other_ca.issue_client("intruder")
    path = write_kubeconfig(
        user={"client-certificate-data": b64(stranger.cert_pem), "client-key-data": b64(stranger.key_pem)}
    )
    with pytest.raises(TokenBackendError, match=r"TLS handshake .* failed|cannot reach"):
        _backend(path).check()
    assert all(c.user != "intruder" for c in apiserver.calls)


def test_401_names_the_credentials(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken
) -> None:
    backend = _backend(write_kubeconfig(user={"token": "expired-token"}))
    with pytest.raises(TokenBackendError, match=r"401 Unauthorized.*kubeconfig user nodeserver"):
        backend.check()
    with pytest.raises(TokenBackendError, match=r"401 Unauthorized") as exc:
        backend.create(token)
    assert [c.status for c in apiserver.calls] == [401, 401]
    assert "expired-token" not in str(exc.value)


def test_403_names_the_missing_permission(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    apiserver.grants = {SA_USER: {"get"}}
    backend = _backend(write_kubeconfig())
    with pytest.raises(
        TokenBackendError, match=r"needs create/delete on secrets in kube-system.*create or delete"
    ):
        backend.check()
    with pytest.raises(TokenBackendError) as exc:
        backend.create(token)
    message = str(exc.value)
    assert message.startswith(
        "403 Forbidden: the nodeserver identity needs create/delete on secrets in kube-system"
    )
    assert f'User "{SA_USER}" cannot create resource "secrets"' in message
    assert "docs/join-backends.md" in message
    assert_no_secret(token.secret, logs, exc.value)


def test_check_reports_only_the_missing_verb(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter
) -> None:
    apiserver.grants = {SA_USER: {"create", "get"}}
    with pytest.raises(TokenBackendError, match=r"may not delete them"):
        _backend(write_kubeconfig()).check()
    apiserver.grants = {SA_USER: {"create", "delete"}}
    _backend(write_kubeconfig()).check()


def test_409_is_a_conflict(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken
) -> None:
    backend = _backend(write_kubeconfig())
    backend.create(token)
    again = BootstrapToken(token.token_id, "ffffffffffffffff", token.expires_at)
    with pytest.raises(TokenConflictError, match=r"409 Conflict.*already exists") as exc:
        backend.create(again)
    assert isinstance(exc.value, TokenBackendError)
    assert apiserver.secret_data(token.secret_name)["token-secret"] == token.secret  # not overwritten


def test_422_for_an_expired_token(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, logs: pytest.LogCaptureFixture
) -> None:
    stale = new_token(ttl_s=60, now=int(time.time()) - 3600)
    with pytest.raises(TokenBackendError, match=r"422 Unprocessable Entity.*already expired") as exc:
        _backend(write_kubeconfig()).create(stale)
    assert apiserver.calls[-1].status == 422
    assert_no_secret(stale.secret, logs, exc.value)


@pytest.mark.parametrize("status", [500, 503])
def test_5xx_says_retry_later(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken, status: int
) -> None:
    apiserver.fail_next(status)
    with pytest.raises(TokenBackendError, match=f"{status} from the API server.*retry later"):
        _backend(write_kubeconfig()).create(token)


def test_an_api_answer_that_echoes_the_body_is_redacted(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    apiserver.fail_next(500, echo_body=True)
    with pytest.raises(TokenBackendError) as exc:
        _backend(write_kubeconfig()).create(token)
    assert token.token_id in str(exc.value)  # the message did carry the body ...
    assert_no_secret(token.secret, logs, exc.value, exc.value.message)  # ... but not the secret


def test_429(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken
) -> None:
    apiserver.fail_next(429)
    with pytest.raises(TokenBackendError, match=r"429 Too Many Requests"):
        _backend(write_kubeconfig()).create(token)


def test_delete_errors_are_not_swallowed(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken
) -> None:
    backend = _backend(write_kubeconfig())
    backend.create(token)
    apiserver.fail_next(500)
    with pytest.raises(TokenBackendError, match=r"500 .*delete Secret kube-system/bootstrap-token-"):
        backend.delete(token.token_id, "")
    with pytest.raises(TokenBackendError, match=r"malformed id"):
        backend.delete("../../namespaces", "")


def test_a_hanging_api_server_times_out(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, token: BootstrapToken
) -> None:
    apiserver.hang_next(10)
    started = time.monotonic()
    with pytest.raises(TokenBackendError, match=r"did not answer POST within 0\.5 s"):
        _backend(write_kubeconfig(), timeout=0.5).create(token)
    assert time.monotonic() - started < 5


def test_connection_refused(write_kubeconfig: KubeconfigWriter, cluster_ca: TestCA) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_kubeconfig(
        cluster={
            "server": f"https://127.0.0.1:{port}",
            "certificate-authority-data": b64(cluster_ca.cert_pem),
        }
    )
    with pytest.raises(TokenBackendError, match=r"connection refused; is clusters"):
        _backend(path).check()


def test_the_request_body_is_never_logged(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    backend = _backend(write_kubeconfig())
    backend.create(token)
    apiserver.fail_next(500)
    with pytest.raises(TokenBackendError):
        backend.create(new_token(ttl_s=60, now=int(time.time())))
    assert_no_secret(token.secret, logs)
    assert "stringData" not in logs.text
    assert SA_TOKEN not in logs.text
