"""Token-backend fixtures: a test PKI, the Kubernetes API server test double, kubeconfig writers."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.tokens.token import BootstrapToken, new_token
from tests.support.kube_apiserver_double import KubeApiServerDouble
from tests.support.kube_pki import Issued, TestCA

SA_TOKEN = "eyJhbGciOiJSUzI1NiJ9.nodeserver-service-account-token"
SA_USER = "system:serviceaccount:nodetrust:nodeserver"
CERT_USER = "nodeserver"


@pytest.fixture(scope="session")
def cluster_ca() -> TestCA:
    return TestCA("kubernetes")


@pytest.fixture(scope="session")
def other_ca() -> TestCA:
    return TestCA("some other cluster")


@pytest.fixture(scope="session")
def serving(cluster_ca: TestCA) -> Issued:
    return cluster_ca.issue_server()


@pytest.fixture(scope="session")
def client_cert(cluster_ca: TestCA) -> Issued:
    return cluster_ca.issue_client(CERT_USER, ("nodetrust:servers",))


@pytest.fixture
def apiserver(serving: Issued, cluster_ca: TestCA) -> Iterator[KubeApiServerDouble]:
    with KubeApiServerDouble(
        serving, client_ca_pem=cluster_ca.cert_pem, tokens={SA_TOKEN: SA_USER}
    ) as double:
        yield double


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


KubeconfigWriter = Callable[..., Path]


@pytest.fixture
def write_kubeconfig(tmp_path: Path, apiserver: KubeApiServerDouble, cluster_ca: TestCA) -> KubeconfigWriter:
    """Write a kubeconfig for the double; ``cluster``/``user`` entries override the defaults (token auth)."""

    def write(
        *,
        cluster: dict[str, Any] | None = None,
        user: dict[str, Any] | None = None,
        context: dict[str, Any] | None = None,
        current: str | None = "nodeserver@test",
        name: str = "kubeconfig",
    ) -> Path:
        doc: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": cluster
                    if cluster is not None
                    else {"server": apiserver.url, "certificate-authority-data": b64(cluster_ca.cert_pem)},
                }
            ],
            "users": [{"name": "nodeserver", "user": user if user is not None else {"token": SA_TOKEN}}],
            "contexts": [
                {
                    "name": "nodeserver@test",
                    "context": context if context is not None else {"cluster": "test", "user": "nodeserver"},
                }
            ],
        }
        if current is not None:
            doc["current-context"] = current
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc))
        return path

    return write


@pytest.fixture
def token() -> BootstrapToken:
    return new_token(
        ttl_s=900,
        now=int(time.time()),
        description="nodetrust join of gpu-node-01 (h200)",
        extra_groups=(
            "system:bootstrappers:kubeadm:default-node-token",
            "system:bootstrappers:nodetrust:h200",
        ),
    )


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Everything logged at DEBUG and above, for the never-log-the-secret assertions."""
    caplog.set_level(logging.DEBUG)
    return caplog


def assert_no_secret(secret: str, caplog: pytest.LogCaptureFixture, *texts: object) -> None:
    """``secret`` appears in no log record (message, arguments, traceback) and in none of ``texts``."""
    assert caplog.records is not None
    for record in caplog.records:
        assert secret not in record.getMessage(), record.getMessage()
        assert secret not in repr(record.args)
    assert secret not in caplog.text
    for text in texts:
        assert secret not in str(text)
        assert secret not in repr(text)
