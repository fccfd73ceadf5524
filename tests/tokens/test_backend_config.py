"""``token_backend`` configuration and kubeconfig parsing: strict, fail closed, errors name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server.errors import ConfigError
from server.tokens.backend import open_backend
from server.tokens.filebackend import FileBackend
from server.tokens.kubeconfig import load_kubeconfig
from server.tokens.kubernetes import KubernetesBackend
from tests.support.kube_pki import Issued, TestCA
from tests.tokens.conftest import SA_TOKEN, KubeconfigWriter, b64


def test_file_backend_with_a_relative_directory(tmp_path: Path) -> None:
    backend = open_backend({"type": "file", "directory": "tokens"}, base_dir=tmp_path)
    assert isinstance(backend, FileBackend)
    assert backend.directory == tmp_path / "tokens"
    assert backend.name == "file"
    assert not (tmp_path / "tokens").exists()  # opening touches nothing; check() creates it


def test_kubernetes_backend_from_config(write_kubeconfig: KubeconfigWriter, tmp_path: Path) -> None:
    write_kubeconfig()
    spec = {"type": "kubernetes", "kubeconfig": "kubeconfig", "namespace": "kube-system", "timeout": "3s"}
    backend = open_backend(spec, base_dir=tmp_path)
    assert isinstance(backend, KubernetesBackend)
    assert backend.timeout == 3.0
    assert backend.access.context == "nodeserver@test"
    assert open_backend({**spec, "timeout": 2}, base_dir=tmp_path).timeout == 2.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, r"token_backend\.type: expected 'file' or 'kubernetes'"),
        ({"type": "vault"}, r"token_backend\.type"),
        ({"type": ["file"]}, r"token_backend\.type"),
        ({"type": "file"}, r"needs token_backend\.directory"),
        ({"type": "file", "directory": "/x", "kubeconfig": "/y"}, r"unknown key.*token_backend\.kubeconfig"),
        ({"type": "file", "directory": 7}, r"token_backend\.directory: expected a non-empty string"),
        ({"type": "file", "directory": ""}, r"token_backend\.directory"),
        ({"type": "kubernetes"}, r"needs token_backend\.kubeconfig"),
        ({"type": "kubernetes", "kubeconfig": "/k", "namespace": "default"}, r"token_backend\.namespace"),
        ({"type": "kubernetes", "kubeconfig": "/k", "timeout": "soon"}, r"token_backend\.timeout"),
        ({"type": "kubernetes", "kubeconfig": "/k", "timeout": 0}, r"token_backend\.timeout"),
        ({"type": "kubernetes", "kubeconfig": "/k", "timeout": True}, r"token_backend\.timeout"),
        ({"type": "kubernetes", "kubeconfig": "/k", "timeout": "1h"}, r"token_backend\.timeout: at most"),
        ({"type": "kubernetes", "kubeconfig": "/k", "context": 3}, r"token_backend\.context"),
        ({"type": "kubernetes", "kubeconfig": "/k", "insecure": True}, r"token_backend\.insecure"),
    ],
)
def test_bad_specs_name_the_key(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_backend(spec, base_dir=Path("/nonexistent"))


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"expected a mapping"):
        open_backend(["file"], base_dir=None)  # type: ignore[arg-type]


def test_relative_path_without_base_dir() -> None:
    with pytest.raises(ConfigError, match=r"token_backend\.directory: a relative path"):
        open_backend({"type": "file", "directory": "tokens"})


def test_missing_kubeconfig_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read"):
        open_backend({"type": "kubernetes", "kubeconfig": str(tmp_path / "nope")})


# -- kubeconfig variants -------------------------------------------------------


def test_insecure_skip_tls_verify_is_refused(write_kubeconfig: KubeconfigWriter, cluster_ca: TestCA) -> None:
    path = write_kubeconfig(cluster={"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True})
    with pytest.raises(ConfigError, match=r"insecure-skip-tls-verify: refused"):
        load_kubeconfig(path)
    # ... also next to a CA: the flag alone is enough to refuse.
    path = write_kubeconfig(
        cluster={
            "server": "https://127.0.0.1:6443",
            "certificate-authority-data": b64(cluster_ca.cert_pem),
            "insecure-skip-tls-verify": True,
        }
    )
    with pytest.raises(ConfigError, match=r"insecure-skip-tls-verify"):
        load_kubeconfig(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"current": None}, "no current-context"),
        ({"current": "elsewhere"}, "no context named 'elsewhere'"),
        ({"context": {"cluster": "test"}}, r"context\.user is missing"),
        ({"context": {"cluster": "test", "user": "ghost"}}, "no user named 'ghost'"),
        ({"context": {"cluster": "prod", "user": "nodeserver"}}, "no cluster named 'prod'"),
        ({"user": {}}, "no credentials"),
        ({"user": {"exec": {"command": "aws"}}}, r"exec\.apiVersion: None is not supported"),
        (
            {"user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "aws"}}},
            "v1alpha1 was removed",
        ),
        (
            {
                "user": {
                    "token": "t",
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": "sh",
                        "interactiveMode": "Never",
                    },
                }
            },
            "exec gives the credentials",
        ),
        ({"user": {"auth-provider": {"name": "gcp"}}}, "auth-provider"),
        ({"user": {"username": "admin", "password": "pw"}}, "basic authentication"),
        ({"user": {"token": "a", "tokenFile": "/t"}}, "token or tokenFile, not both"),
        ({"user": {"client-certificate-data": "aGk="}}, "needs both"),
        ({"user": {"client-certificate-data": "%%%", "client-key-data": "aGk="}}, "not valid base64"),
        ({"user": {"token": "t", "flavour": 1}}, "unknown field"),
        ({"user": {"tokenFile": "missing-token"}}, "tokenFile .* cannot read"),
        ({"cluster": {"server": "http://127.0.0.1:8080"}}, "expected an https:// URL"),
        ({"cluster": {"server": "https://127.0.0.1:99999"}}, "bad port"),
        ({"cluster": {}}, r"cluster\.server is missing"),
        (
            {"cluster": {"server": "https://h:6443", "proxy-url": "http://proxy:3128"}},
            "proxies are not supported",
        ),
        ({"cluster": {"server": "https://h:6443", "certificate-authority": "ca.pem"}}, "cannot read"),
        (
            {
                "cluster": {
                    "server": "https://h:6443",
                    "certificate-authority-data": "x",
                    "certificate-authority": "y",
                }
            },
            "not both",
        ),
    ],
)
def test_kubeconfig_errors_name_the_field(
    write_kubeconfig: KubeconfigWriter, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_kubeconfig(write_kubeconfig(**kwargs))


def test_kubeconfig_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("{{{")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_kubeconfig(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"expected a YAML mapping"):
        load_kubeconfig(path)


def test_relative_paths_are_relative_to_the_kubeconfig(
    write_kubeconfig: KubeconfigWriter, tmp_path: Path, cluster_ca: TestCA, client_cert: Issued
) -> None:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(cluster_ca.cert_pem)
    (tmp_path / "pki" / "client.crt").write_bytes(client_cert.cert_pem)
    (tmp_path / "pki" / "client.key").write_bytes(client_cert.key_pem)
    path = write_kubeconfig(
        cluster={"server": "https://127.0.0.1:6443/prefix/", "certificate-authority": "pki/ca.crt"},
        user={"client-certificate": "pki/client.crt", "client-key": "pki/client.key"},
    )
    access = load_kubeconfig(path)
    assert access.ca_pem == cluster_ca.cert_pem
    assert access.client_cert_pem == client_cert.cert_pem
    assert access.server == "https://127.0.0.1:6443/prefix"
    assert access.bearer() is None
    assert "PRIVATE KEY" not in repr(access)


def test_explicit_context_wins(write_kubeconfig: KubeconfigWriter) -> None:
    path = write_kubeconfig(current="does-not-exist")
    assert load_kubeconfig(path, context="nodeserver@test").user == "nodeserver"


def test_static_token_is_not_in_repr(write_kubeconfig: KubeconfigWriter) -> None:
    access = load_kubeconfig(write_kubeconfig())
    assert access.bearer() == SA_TOKEN
    assert SA_TOKEN not in repr(access)


def test_a_ca_that_is_not_pem(write_kubeconfig: KubeconfigWriter) -> None:
    path = write_kubeconfig(
        cluster={"server": "https://127.0.0.1:1", "certificate-authority-data": b64(b"junk")}
    )
    with pytest.raises(ConfigError, match=r"not a PEM certificate"):
        KubernetesBackend.from_kubeconfig(path)


def test_a_client_key_that_does_not_match(
    write_kubeconfig: KubeconfigWriter, cluster_ca: TestCA, client_cert: Issued
) -> None:
    other = cluster_ca.issue_client("someone-else")
    path = write_kubeconfig(
        user={"client-certificate-data": b64(client_cert.cert_pem), "client-key-data": b64(other.key_pem)}
    )
    with pytest.raises(ConfigError, match=r"do not match"):
        KubernetesBackend.from_kubeconfig(path)
