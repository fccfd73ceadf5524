"""``nodeserver`` commands: ``bundle`` reads without creating, ``agents`` actions explain themselves,
``--version`` and ``--json`` on every program."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from cryptography import x509

from agent.cli import main as nodeagent
from imagebuilder.cli import main as imagebuilder
from server.cli import main as nodeserver


def _config(tmp_path: Path, trust_domain: str = "example.org") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"trust_domain: {trust_domain}\ndata_dir: data\n")
    return path


def test_bundle_does_not_create_a_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, reading the bundle created a CA in data_dir as a side effect (issue 12, section 4)."""
    config = _config(tmp_path)
    assert nodeserver(["bundle", "-c", str(config)]) == 1
    err = capsys.readouterr().err
    assert "no CA in" in err and "nodeserver bundle --create" in err and "nodeserver run" in err
    assert not (tmp_path / "data").exists()


def test_bundle_create_then_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    assert nodeserver(["bundle", "--create", "-c", str(config)]) == 0
    created = capsys.readouterr()
    assert "created a new CA for trust domain example.org" in created.err
    cert = x509.load_pem_x509_certificate(created.out.encode())
    uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert uris.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://example.org"]
    assert nodeserver(["bundle", "-c", str(config)]) == 0
    again = capsys.readouterr()
    assert again.out == created.out and again.err == ""
    assert nodeserver(["bundle", "--json", "-c", str(config)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"trust_domain": "example.org", "bundle_pem": created.out, "created": False}
    other = tmp_path / "other.yaml"
    other.write_text("trust_domain: other.org\ndata_dir: data\n")
    assert nodeserver(["bundle", "-c", str(other)]) == 2
    assert "belongs to spiffe://example.org, not spiffe://other.org" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("action", "words"),
    [
        ("list", "List every agent the store knows"),
        ("ban", "Ban the agent with this SPIFFE ID"),
        ("unban", "Lift the ban"),
        ("delete", "Delete the agent's record"),
    ],
)
def test_every_agents_action_has_a_description(
    action: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        nodeserver(["agents", action, "--help"])
    assert done.value.code == 0
    assert words in " ".join(capsys.readouterr().out.split())


def test_agents_actions_print_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    agent = "spiffe://example.org/spire/agent/tpm/" + "a" * 64
    assert nodeserver(["agents", "ban", agent, "--json", "-c", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "action": "ban",
        "spiffe_id": agent,
        "changed": True,
        "revoked_tokens": [],
    }
    assert nodeserver(["agents", "list", "--json", "-c", str(config)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["spiffe_id"], r["banned"]) for r in rows] == [(agent, True)]


@pytest.mark.parametrize(
    ("program", "main"),
    [("nodeagent", nodeagent), ("nodeserver", nodeserver), ("imagebuilder", imagebuilder)],
)
def test_version(program: str, main: object, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])  # type: ignore[operator]
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{program} {metadata.version('nodetrust')} (") and out.count("\n") == 1
    assert "join API nodetrust.join.v1" in out and "agent API spire.api.server.agent.v1" in out
