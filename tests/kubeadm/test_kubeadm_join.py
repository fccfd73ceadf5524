"""``kubeadm join`` through the chokepoint, against the kubeadm test double (a real subprocess)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.errors import KubeadmError
from agent.kubeadm import join_configuration, kubeadm_join, write_join_config
from agent.proc import run
from tests.kubeadm.conftest import SECRET, TOKEN, Installer, join_inputs
from tests.support.kubeadm_double import read_record

pytestmark = pytest.mark.subprocess


def _written(run_dir: Path, **overrides: Any) -> Path:
    path = run_dir / "kubeadm-join.yaml"
    write_join_config(path, join_configuration(**join_inputs(**overrides)))
    return path


def _assert_secret_hidden(logs: pytest.LogCaptureFixture, *texts: object) -> None:
    assert SECRET not in logs.text
    for record in logs.records:
        assert SECRET not in record.getMessage()
    for text in texts:
        assert SECRET not in str(text)


def test_the_rendered_config_passes_the_double_and_is_removed(
    kubeadm_double: Installer, record: Path, run_dir: Path, logs: pytest.LogCaptureFixture
) -> None:
    kubeadm_double()
    path = _written(run_dir)
    kubeadm_join(path)  # "kubeadm" found on PATH
    assert not path.exists()
    [call] = read_record(record)
    assert call["argv"] == ["join", "--config", str(path)]
    assert call["valid"], call["errors"]
    assert call["mode"] == "0600"
    assert call["exit_code"] == 0
    expected = join_configuration(**join_inputs())
    expected["discovery"]["bootstrapToken"]["token"] = "abcdef.<redacted>"
    assert call["config"] == expected
    assert SECRET not in record.read_text()
    _assert_secret_hidden(logs)


@pytest.mark.parametrize(
    "overrides",
    [
        {"taints": [], "labels": {}, "kubelet_extra_args": []},
        {
            "api_server_endpoint": "[fd00::10]:6443",
            "ca_cert_hashes": ["sha256:" + "a" * 64, "sha256:" + "b" * 64],
        },
        {
            "taints": [("t", "", "NoExecute"), ("u", "v", "PreferNoSchedule")],
            "cri_socket": "unix:///run/crio/crio.sock",
        },
    ],
)
def test_variants_pass_the_double(
    kubeadm_double: Installer, record: Path, run_dir: Path, overrides: dict[str, Any]
) -> None:
    kubeadm_double()
    kubeadm_join(_written(run_dir, **overrides))
    [call] = read_record(record)
    assert call["valid"], call["errors"]


def test_failure_raises_with_the_tail_and_a_hint_and_removes_the_file(
    kubeadm_double: Installer, record: Path, run_dir: Path, logs: pytest.LogCaptureFixture
) -> None:
    kubeadm_double(exit_code=1, echo_token=True)
    path = _written(run_dir)
    with pytest.raises(KubeadmError) as exc:
        kubeadm_join(path)
    assert not path.exists()
    message = exc.value.message
    assert message.startswith("kubeadm join exited with status 1 in phase preflight: ")
    assert "could not find a JWS signature" in message
    assert "abcdef.<redacted>" in message  # kubeadm printed the token; we did not pass it on
    assert "expired" in exc.value.hint
    _assert_secret_hidden(logs, exc.value, exc.value.hint, repr(exc.value))
    assert read_record(record)[0]["exit_code"] == 1


def test_failure_with_a_bare_secret_in_the_output(
    kubeadm_double: Installer, run_dir: Path, logs: pytest.LogCaptureFixture
) -> None:
    kubeadm_double(
        exit_code=3, stderr=f"something went wrong with secret {SECRET} and [ERROR FileAvailable--etc]"
    )
    with pytest.raises(KubeadmError) as exc:
        kubeadm_join(_written(run_dir))
    assert "status 3" in exc.value.message
    # Hints are chosen from kubeadm's phase line and check names; tests/peers/test_kubeadm_failures.py
    # proves them on output of the real kubeadm. Here: whatever the hint, no secret in it.
    _assert_secret_hidden(logs, exc.value, exc.value.hint)


def test_success_output_is_logged_redacted(
    kubeadm_double: Installer, run_dir: Path, logs: pytest.LogCaptureFixture
) -> None:
    kubeadm_double(echo_token=True)
    kubeadm_join(_written(run_dir))
    assert "This node has joined the cluster" in logs.text
    assert "abcdef.<redacted>" in logs.text
    _assert_secret_hidden(logs)


def test_kubeadm_missing(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(run_dir / "empty"))
    path = _written(run_dir)
    with pytest.raises(KubeadmError, match=r"not installed or not on PATH") as exc:
        kubeadm_join(path)
    assert "installed in the image" in exc.value.hint
    assert not path.exists()
    _assert_secret_hidden(logs, exc.value)


def test_kubeadm_not_executable(run_dir: Path, logs: pytest.LogCaptureFixture) -> None:
    script = run_dir / "kubeadm"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    path = _written(run_dir)
    with pytest.raises(KubeadmError, match=r"kubeadm cannot be run: Permission denied") as exc:
        kubeadm_join(path, kubeadm=str(script))
    assert "executable file" in exc.value.hint and "noexec" in exc.value.hint
    assert not path.exists()
    _assert_secret_hidden(logs, exc.value)


def test_kubeadm_hangs(kubeadm_double: Installer, run_dir: Path) -> None:
    script = kubeadm_double(sleep_s=30)
    path = _written(run_dir)
    with pytest.raises(KubeadmError, match=r"did not finish within 1 s") as exc:
        kubeadm_join(path, kubeadm=str(script), timeout=1)
    assert "hung" in exc.value.hint
    assert not path.exists()


def test_a_world_readable_config_is_refused_and_removed(
    kubeadm_double: Installer, record: Path, run_dir: Path
) -> None:
    kubeadm_double()
    path = _written(run_dir)
    path.chmod(0o644)
    with pytest.raises(KubeadmError, match=r"mode 0644; it holds a token"):
        kubeadm_join(path)
    assert not path.exists()
    assert read_record(record) == []  # kubeadm never ran


def test_a_missing_config(kubeadm_double: Installer, run_dir: Path) -> None:
    kubeadm_double()
    with pytest.raises(KubeadmError, match=r"does not exist"):
        kubeadm_join(run_dir / "nope.yaml")


# -- the double is not a rubber stamp ------------------------------------------------


def _mutate(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = out
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()
MUTATIONS = [
    ("apiVersion", "kubeadm.k8s.io/v1beta3", "apiVersion"),
    ("kind", "InitConfiguration", "kind"),
    ("surprise", True, "Additional properties"),
    ("nodeRegistration.kubeletExtraArgs", {"node-labels": "a=b"}, "kubeletExtraArgs"),
    ("nodeRegistration.taints", [{"key": "k", "effect": "Sometimes"}], "taints.0.effect"),
    ("nodeRegistration.taints", [{"value": "v", "effect": "NoSchedule"}], "'key' is a required property"),
    ("nodeRegistration.name", "Upper", "nodeRegistration.name"),
    ("nodeRegistration.criSocket", "/run/containerd/containerd.sock", "criSocket"),
    ("discovery.bootstrapToken.caCertHashes", _DELETE, "'caCertHashes' is a required property"),
    ("discovery.bootstrapToken.caCertHashes", [], "caCertHashes"),
    ("discovery.bootstrapToken.caCertHashes", ["sha256:xyz"], "caCertHashes.0"),
    ("discovery.bootstrapToken.token", "abcdef.short", "discovery.bootstrapToken.token"),
    ("discovery.bootstrapToken.apiServerEndpoint", _DELETE, "'apiServerEndpoint' is a required property"),
    ("discovery.bootstrapToken.unsafeSkipCAVerification", "false", "unsafeSkipCAVerification"),
    ("discovery.file", {"kubeConfigPath": "/x"}, "discovery"),
    ("discovery.timeout", "5m0s", "Additional properties"),
    ("timeouts.discovery", "5 minutes", "timeouts.discovery"),
    ("timeouts.tlsBootstrap", 300, "timeouts.tlsBootstrap"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] + f"-{i}" for i, m in enumerate(MUTATIONS)])
def test_the_double_refuses_what_kubeadm_refuses(
    kubeadm_double: Installer, record: Path, tmp_path: Path, mutation: tuple[str, Any, str]
) -> None:
    dotted, value, error = mutation
    script = kubeadm_double()
    run_dir = tmp_path
    doc = _mutate(join_configuration(**join_inputs()), dotted, value)
    path = run_dir / "bad.yaml"
    write_join_config(path, doc)
    result = run([str(script), "join", "--config", str(path)], check=False)
    assert result.returncode == 1
    [call] = read_record(record)
    assert not call["valid"]
    assert any(error in e for e in call["errors"]), call["errors"]
    assert "error execution phase preflight" in result.stderr


def test_the_double_accepts_unsafe_skip_without_hashes(
    kubeadm_double: Installer, record: Path, run_dir: Path
) -> None:
    script = kubeadm_double()
    doc = join_configuration(**join_inputs())
    doc["discovery"]["bootstrapToken"] = {
        "token": TOKEN,
        "apiServerEndpoint": "h:6443",
        "unsafeSkipCAVerification": True,
    }
    path = run_dir / "j.yaml"
    write_join_config(path, doc)
    assert run([str(script), "join", "--config", str(path)], check=False).returncode == 0


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["join", "10.0.0.10:6443", "--config", "{path}"], "can not mix '--config'"),
        (["join", "--config={path}", "--token", "x"], "can not mix '--config'"),
        (["join"], "needs --config"),
        (["init", "--config", "{path}"], "only implements 'join'"),
    ],
)
def test_the_double_checks_argv(
    kubeadm_double: Installer, record: Path, run_dir: Path, argv: list[str], error: str
) -> None:
    script = kubeadm_double()
    path = _written(run_dir)
    result = run([str(script), *(a.format(path=path) for a in argv)], check=False)
    assert result.returncode == 1
    assert error in read_record(record)[0]["errors"][0]


def test_the_double_checks_the_mode_and_multi_documents(
    kubeadm_double: Installer, record: Path, run_dir: Path
) -> None:
    script = kubeadm_double()
    path = _written(run_dir)
    path.chmod(0o640)
    assert run([str(script), "join", "--config", str(path), "--v=5"], check=False).returncode == 1
    assert read_record(record)[-1]["mode"] == "0640"
    doc = join_configuration(**join_inputs())
    path.write_text(yaml.safe_dump(doc) + "---\n" + yaml.safe_dump(doc))
    os.chmod(path, 0o600)
    assert run([str(script), "join", "--config", str(path)], check=False).returncode == 1
    assert "one JoinConfiguration document" in read_record(record)[-1]["errors"][0]
