"""Exec credential plugins (EKS, GKE, AKS): a real plugin script, written by the test, run by the server.

The plugin is an executable Python script that answers an ``ExecCredential`` the way ``aws eks
get-token`` or ``kubelogin`` do, records each run and the ``KUBERNETES_EXEC_INFO`` it was given, and
the backend talks to the Kubernetes API server test double with what it printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.errors import ConfigError, TokenBackendError
from server.tokens.execcred import ExecPlugin, parse_credential, run_plugin
from server.tokens.kubeconfig import load_kubeconfig
from server.tokens.kubernetes import KubernetesBackend
from server.tokens.token import BootstrapToken
from tests.support.kube_apiserver_double import KubeApiServerDouble
from tests.support.kube_pki import Issued
from tests.tokens.conftest import CERT_USER, SA_TOKEN, SA_USER, KubeconfigWriter, assert_no_secret

pytestmark = pytest.mark.subprocess

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"
FUTURE = "2999-01-01T00:00:00Z"
PAST = "2000-01-01T00:00:00Z"


class Plugin:
    """An exec plugin script in ``folder``: answers[i] is printed on run i (the last one repeats)."""

    def __init__(self, folder: Path, answers: list[Any], *, exit_code: int = 0, stderr: str = "") -> None:
        folder.mkdir(exist_ok=True)
        self.folder = folder
        self.path = folder / "credential-plugin"
        (folder / "answers.json").write_text(json.dumps(answers))
        self.path.write_text(
            f"#!{sys.executable}\n"
            "import json, os, pathlib, sys\n"
            f"here = pathlib.Path({str(folder)!r})\n"
            "runs = here / 'runs'\n"
            "count = len(runs.read_text().splitlines()) if runs.exists() else 0\n"
            "with runs.open('a') as fh:\n"
            "    fh.write(json.dumps({'info': os.environ.get('KUBERNETES_EXEC_INFO'),\n"
            "                         'region': os.environ.get('PLUGIN_REGION'), 'argv': sys.argv[1:]}) + '\\n')\n"
            "answers = json.loads((here / 'answers.json').read_text())\n"
            "answer = answers[min(count, len(answers) - 1)]\n"
            "sys.stdout.write(answer if isinstance(answer, str) else json.dumps(answer))\n"
            f"sys.stderr.write({stderr!r})\n"
            f"sys.exit({exit_code})\n"
        )
        self.path.chmod(0o755)

    def runs(self) -> list[dict[str, Any]]:
        file = self.folder / "runs"
        return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def credential(api_version: str = V1, *, expires: str | None = FUTURE, **status: str) -> dict[str, Any]:
    body: dict[str, Any] = dict(status)
    if expires is not None:
        body["expirationTimestamp"] = expires
    return {"apiVersion": api_version, "kind": "ExecCredential", "status": body}


def exec_user(plugin: Plugin, api_version: str = V1, **extra: Any) -> dict[str, Any]:
    block: dict[str, Any] = {
        "apiVersion": api_version,
        "command": str(plugin.path),
        "args": ["eks", "get-token", "--cluster-name", "workload"],
        "env": [{"name": "PLUGIN_REGION", "value": "eu-west-1"}],
        "interactiveMode": "Never",
        "provideClusterInfo": True,
        "installHint": "install the aws CLI",
    }
    block.update(extra)
    return {"exec": block}


def test_a_token_from_an_exec_plugin_joins(
    apiserver: KubeApiServerDouble,
    write_kubeconfig: KubeconfigWriter,
    tmp_path: Path,
    token: BootstrapToken,
    logs: pytest.LogCaptureFixture,
) -> None:
    plugin = Plugin(tmp_path / "plugin", [credential(token=SA_TOKEN)])
    path = write_kubeconfig(user=exec_user(plugin))
    backend = KubernetesBackend.from_kubeconfig(path, timeout=5)
    assert plugin.runs() == []  # nothing runs before the first request
    backend.check()
    ref = backend.create(token)
    backend.delete(token.token_id, ref)
    assert {c.user for c in apiserver.calls} == {SA_USER}
    (run,) = plugin.runs()  # cached: one run for four requests (it is valid until 2999)
    assert run["argv"] == ["eks", "get-token", "--cluster-name", "workload"]
    assert run["region"] == "eu-west-1"
    info = json.loads(run["info"])
    assert info["apiVersion"] == V1 and info["kind"] == "ExecCredential"
    assert info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == apiserver.url
    assert "certificate-authority-data" in info["spec"]["cluster"]
    access = backend.access
    assert access.exec_plugin is not None and access.exec_plugin.api_version == V1
    assert SA_TOKEN not in repr(access) and "eu-west-1" not in repr(access)
    assert_no_secret(SA_TOKEN, logs, repr(backend), repr(access))


def test_an_expired_credential_runs_the_plugin_again(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, tmp_path: Path
) -> None:
    plugin = Plugin(tmp_path / "plugin", [credential(V1BETA1, expires=PAST, token=SA_TOKEN)])
    backend = KubernetesBackend.from_kubeconfig(write_kubeconfig(user=exec_user(plugin, V1BETA1)), timeout=5)
    backend.check()  # two reviews, two requests
    assert len(plugin.runs()) == 2
    assert [c.status for c in apiserver.calls] == [201, 201]


def test_a_refused_credential_asks_the_plugin_once_more(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, tmp_path: Path
) -> None:
    plugin = Plugin(tmp_path / "plugin", [credential(token="stale-token"), credential(token=SA_TOKEN)])
    backend = KubernetesBackend.from_kubeconfig(write_kubeconfig(user=exec_user(plugin)), timeout=5)
    backend.check()
    assert len(plugin.runs()) == 2
    assert [c.status for c in apiserver.calls] == [401, 201, 201]
    # A credential that the plugin cannot make good stays a 401 with its usual message.
    bad = Plugin(tmp_path / "bad", [credential(token="always-wrong")])
    denied = KubernetesBackend.from_kubeconfig(
        write_kubeconfig(user=exec_user(bad), name="bad-kubeconfig"), timeout=5
    )
    with pytest.raises(TokenBackendError, match="401 Unauthorized"):
        denied.check()
    assert len(bad.runs()) == 2


def test_a_client_certificate_from_an_exec_plugin(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, tmp_path: Path, client_cert: Issued
) -> None:
    plugin = Plugin(
        tmp_path / "plugin",
        [
            credential(
                V1BETA1,
                clientCertificateData=client_cert.cert_pem.decode(),
                clientKeyData=client_cert.key_pem.decode(),
            )
        ],
    )
    backend = KubernetesBackend.from_kubeconfig(write_kubeconfig(user=exec_user(plugin, V1BETA1)), timeout=5)
    backend.check()
    assert {c.user for c in apiserver.calls} == {CERT_USER}
    assert backend.access.bearer() is None


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("not json at all " + SA_TOKEN, "not JSON"),
        ({"apiVersion": V1, "kind": "Status"}, "kind must be ExecCredential"),
        (credential(V1BETA1, token=SA_TOKEN), "answered apiVersion 'client.authentication.k8s.io/v1beta1'"),
        ({"apiVersion": V1, "kind": "ExecCredential"}, "has no status"),
        (credential(), "neither a token nor a client certificate"),
        (credential(clientCertificateData="x"), "needs both"),
        (credential(token=SA_TOKEN, expires="tomorrow"), "not an RFC 3339 time"),
    ],
)
def test_a_bad_answer_is_refused_without_quoting_it(
    write_kubeconfig: KubeconfigWriter,
    tmp_path: Path,
    answer: Any,
    message: str,
    logs: pytest.LogCaptureFixture,
) -> None:
    plugin = Plugin(tmp_path / "plugin", [answer])
    backend = KubernetesBackend.from_kubeconfig(write_kubeconfig(user=exec_user(plugin)), timeout=5)
    with pytest.raises(TokenBackendError, match=message) as caught:
        backend.check()
    assert_no_secret(SA_TOKEN, logs, caught.value)


def test_a_failing_plugin_shows_its_stderr_and_the_install_hint(
    write_kubeconfig: KubeconfigWriter, tmp_path: Path
) -> None:
    plugin = Plugin(tmp_path / "plugin", [""], exit_code=3, stderr="error: the SSO session has expired\n")
    backend = KubernetesBackend.from_kubeconfig(write_kubeconfig(user=exec_user(plugin)), timeout=5)
    with pytest.raises(TokenBackendError) as caught:
        backend.check()
    text = str(caught.value)
    assert "exited with status 3: error: the SSO session has expired" in text
    assert "users[nodeserver].user.exec" in text and "install the aws CLI" in text


def test_the_chokepoint_bounds_time_and_output(tmp_path: Path) -> None:
    with pytest.raises(TokenBackendError, match=r"did not finish within 0\.5 s"):
        run_plugin([sys.executable, "-c", "import time; time.sleep(60)"], env={}, timeout_s=0.5, limit=1000)
    with pytest.raises(TokenBackendError, match="printed more than 1000 bytes on standard output"):
        run_plugin([sys.executable, "-c", "print('x' * 5000)"], env={}, timeout_s=30, limit=1000)
    with pytest.raises(TokenBackendError, match="printed more than 1000 bytes on standard error"):
        run_plugin(
            [sys.executable, "-c", "import sys; sys.stderr.write('y' * 5000)"],
            env={},
            timeout_s=30,
            limit=1000,
        )
    with pytest.raises(TokenBackendError, match="cannot be started"):
        run_plugin([str(tmp_path / "missing")], env={}, timeout_s=30, limit=1000)
    assert (
        run_plugin(
            [sys.executable, "-c", "import sys; print(sys.stdin.read() == '')"],
            env={},
            timeout_s=30,
            limit=100,
        )
        == b"True\n"
    )


def test_the_credential_is_hidden_from_repr() -> None:
    plugin = ExecPlugin(api_version=V1, command="/bin/true", env=(("AWS_SECRET", "hunter2"),))
    parsed = parse_credential(plugin, json.dumps(credential(token=SA_TOKEN)).encode())
    assert parsed.token == SA_TOKEN
    assert SA_TOKEN not in repr(parsed) and "hunter2" not in repr(plugin)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"interactiveMode": "Always"}, "Always needs a terminal"),
        ({"interactiveMode": None}, "interactiveMode: expected one of"),
        ({"command": "no-such-credential-plugin"}, "not on the nodeserver's PATH"),
        ({"command": "bin/missing"}, "is not an executable file"),
        ({"env": [{"name": "A"}]}, r"env: every entry must be"),
        ({"args": "--region x"}, r"args must be a list"),
        ({"provideClusterInfo": "yes"}, "provideClusterInfo must be true or false"),
        ({"flavour": 1}, "unknown field"),
    ],
)
def test_exec_blocks_that_cannot_work_are_refused_at_start(
    write_kubeconfig: KubeconfigWriter, tmp_path: Path, block: dict[str, Any], message: str
) -> None:
    plugin = Plugin(tmp_path / "plugin", [credential(token=SA_TOKEN)])
    user = exec_user(plugin, **block)
    if block.get("interactiveMode", "") is None:
        del user["exec"]["interactiveMode"]
    with pytest.raises(ConfigError, match=message):
        load_kubeconfig(write_kubeconfig(user=user))


def test_a_relative_command_is_relative_to_the_kubeconfig(
    apiserver: KubeApiServerDouble, write_kubeconfig: KubeconfigWriter, tmp_path: Path
) -> None:
    plugin = Plugin(tmp_path / "bin", [credential(token=SA_TOKEN)])
    access = load_kubeconfig(write_kubeconfig(user=exec_user(plugin, command="bin/credential-plugin")))
    assert access.exec_plugin is not None and access.exec_plugin.command == str(plugin.path)
    assert access.bearer() == SA_TOKEN


def test_a_broken_entry_of_another_context_does_not_matter(write_kubeconfig: KubeconfigWriter) -> None:
    path = write_kubeconfig()
    doc = yaml.safe_load(path.read_text())
    doc["users"].append({"name": "someone-else", "user": {"exec": {"command": "aws"}}})  # no apiVersion
    doc["clusters"].append({"name": "elsewhere", "cluster": {"server": 5}})
    path.write_text(yaml.safe_dump(doc))
    assert load_kubeconfig(path).bearer() == SA_TOKEN
