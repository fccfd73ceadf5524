"""The Kubernetes token backend against the API SERVER TEST DOUBLE, for what a real one cannot do on demand.

Everything a real kube-apiserver does (create, check, delete, 401, 403 per verb, 409, TLS failures, every
identity) is tested against the real one in tests/peers/test_token_backend.py. What stays here are the
faults a real server cannot be made to produce: 5xx and 429 answers, an answer that echoes the request
body, a server that never answers, and the double's deliberately stricter check of the Secret (422).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from server.errors import TokenBackendError
from server.tokens.kubernetes import KubernetesBackend
from server.tokens.token import BootstrapToken, new_token
from tests.support.kube_apiserver_double import KubeApiServerDouble
from tests.support.kube_pki import TestCA
from tests.tokens.conftest import SA_TOKEN, KubeconfigWriter, assert_no_secret, b64


def _backend(path: Path, timeout: float = 5.0) -> KubernetesBackend:
    return KubernetesBackend.from_kubeconfig(path, timeout=timeout)


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
    # the backend's own timeout (not the double's 10 s hang ending) is what it reports
    with pytest.raises(TokenBackendError, match=r"did not answer POST within 0\.5 s"):
        _backend(write_kubeconfig(), timeout=0.5).create(token)


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
