"""definition.yaml: the shipped examples load, and each kind of mistake gets a message naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuilder import schemacheck
from imagebuilder.definition import DEFAULT_UNITS, MAX_DEFINITION_BYTES, load_definition, schema, validate
from imagebuilder.errors import DefinitionError

REPO = Path(__file__).resolve().parents[2]
ENV = {"IMAGEBUILDER_FIXTURE_ISO": "/tmp/installer.iso"}


def minimal() -> dict[str, Any]:
    return {
        "name": "node",
        "architecture": "amd64",
        "installer": {"iso": {"url": "https://example.invalid/x.iso", "sha256": "a" * 64}},
        "target": {"python": "3.12", "glibc": "2.39"},
        "agent": {"source": "."},
    }


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "def.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_examples_load() -> None:
    fixture = load_definition(REPO / "examples/fixture-node.yaml", environ=ENV)
    assert fixture.installer.iso.url == "file:///tmp/installer.iso"
    assert fixture.kubernetes is not None
    assert fixture.kubernetes.installed == "1.36.3"
    assert fixture.kubernetes.staged == ("1.34.2", "1.35.3", "1.37.2")
    assert fixture.kubernetes.repository_for("1.35.3").url.endswith("/k8s/core:/stable:/v1.35/deb/")
    assert {a.name for a in fixture.artifacts} == {
        "ovn-kubernetes", "spire-agent", "spire-tpm-plugin", "pause-image", "kube-proxy-image", "ovn-kubernetes-image"
    }  # fmt: skip
    assert fixture.agent.source == REPO
    ubuntu = load_definition(REPO / "examples/ubuntu-2404-node.yaml", environ={})
    assert ubuntu.target.python == "3.12"
    assert ubuntu.kubernetes is not None
    assert ubuntu.kubernetes.versions == ("1.36.3", "1.34.2", "1.35.3", "1.37.2")
    versions = {a.name: a.version for a in ubuntu.artifacts}
    assert versions["ovn-kubernetes"] == "2.4.2"
    assert versions["spire-agent"] == "1.14.1"
    assert versions["spire-tpm-plugin"] == "1.9.0"


def test_defaults(tmp_path: Path) -> None:
    defn = load_definition(write(tmp_path, minimal()))
    assert defn.firmware == "uefi"
    assert defn.network == "listener"
    assert defn.disk_size_bytes == 20 * 2**30
    assert defn.agent.venv == "/opt/nodeagent/venv"
    assert [u.destination for u in defn.agent.units] == [
        "/usr/lib/systemd/system/nodeagent.service",
        "/usr/lib/systemd/system/kubelet.service.d/10-nodeagent.conf",
        "/usr/lib/systemd/system/nodeagent-reattest.service",
        "/usr/lib/systemd/system/nodeagent-reattest.timer",
    ]
    assert [Path(u.destination).name for u in defn.agent.units if u.enable] == [
        "nodeagent.service",
        "nodeagent-reattest.timer",
    ]
    assert defn.watchdog.boot > 0 and defn.watchdog.total > defn.watchdog.install


def test_the_default_units_are_the_agents_own_table() -> None:
    """The builder installs what agent.systemd says the agent ships, where it says (packaged units in
    /usr/lib/systemd/system, never /etc: issue 12)."""
    from agent.systemd import FILES

    assert {u.source.removeprefix("agent/systemd/"): u.destination for u in DEFAULT_UNITS} == FILES
    assert all(u.destination.startswith("/usr/lib/systemd/system/") for u in DEFAULT_UNITS)
    assert all((REPO / u.source).is_file() for u in DEFAULT_UNITS)


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()

INVALID = [
    ("name", "Node_1", "name: 'Node_1' does not match"),
    ("architecture", "riscv64", "architecture: 'riscv64' is not one of"),
    ("firmware", "coreboot", "firmware: 'coreboot' is not one of"),
    ("disk_size", "20GB", "disk_size: '20GB' does not match"),
    ("installer.iso.url", "ftp://x/y.iso", "installer.iso.url: 'ftp://x/y.iso' does not match"),
    ("installer.iso.sha256", "ABC", "installer.iso.sha256: 'ABC' does not match"),
    ("installer.iso.checksums", {"url": "https://x/SUMS", "signature": "https://x/SUMS.gpg"},
     "installer.iso.checksums: 'keyring' is a dependency of 'signature'"),
    ("target.python", "3", "target.python: '3' does not match"),
    ("target", {"python": "3.12"}, "target: 'glibc' is a required property"),
    ("agent", _DELETE, "(top level): 'agent' is a required property"),
    ("colour", "blue", "Additional properties are not allowed ('colour' was unexpected)"),
    ("artifacts", [{"name": "x", "version": "1", "kind": "rpm", "urls": "https://x/y", "destination": "/opt/x"}],
     "artifacts[0].kind: 'rpm' is not one of"),
    ("artifacts", [{"name": "x", "version": "1", "kind": "binary", "urls": "https://x/y", "destination": "opt/x"}],
     "artifacts[0].destination: 'opt/x' does not match"),
    ("artifacts", [{"name": "x", "version": "1", "kind": "binary", "urls": {"s390x": "https://x/y"},
                    "destination": "/opt/x"}], "artifacts[0].urls"),
    ("kubernetes", {"installed": "1.36", "repository": {"url": "https://x/", "keyring": "k"}},
     "kubernetes.installed: '1.36' does not match"),
    ("packages", ["Bad Name"], "packages[0]"),
    ("watchdog", {"boot": 1}, "watchdog.boot: 1 is less than the minimum of 5"),
    ("user", {"name": "root!"}, "user.name: 'root!' does not match"),
    # strings that become paths in the target or on the media, or fields of the staging plan (issue 11)
    ("artifacts", [{"name": "x", "version": "1", "kind": "binary", "urls": "https://x/y",
                    "destination": "/opt/../etc/cron.d/"}],
     "artifacts[0].destination: '/opt/../etc/cron.d/' should not be valid"),
    ("artifacts", [{"name": "x", "version": "1", "kind": "binary", "urls": "https://x/y",
                    "destination": "/opt/x\n"}], "artifacts[0].destination: '/opt/x\\n' does not match"),
    ("artifacts", [{"name": "x", "version": "1\tfile", "kind": "binary", "urls": "https://x/y",
                    "destination": "/opt/x"}], "artifacts[0].version"),
    ("agent.units", [{"source": "../../etc/shadow", "destination": "/usr/lib/x.service"}], "agent.units[0].source"),
    ("agent.units", [{"source": "/etc/shadow", "destination": "/usr/lib/x.service"}], "agent.units[0].source"),
    ("installer.kernel", "../../boot/vmlinuz", "installer.kernel"),
    ("installer.base_manifests", ["/casper/x.manifest"], "installer.base_manifests[0]"),
    ("installer.iso.sha256", "a" * 64 + "\n", "installer.iso.sha256"),
    ("packages", ["kubeadm\n"], "packages[0]"),
    ("user", {"name": "admin", "ssh_authorized_keys": ["ssh-ed25519 AAAA\nssh-rsa BBBB"]},
     "user.ssh_authorized_keys[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "expected"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_definitions_name_the_field(tmp_path: Path, path: str, value: Any, expected: str) -> None:
    data = minimal()
    _set(data, path, value if value is _DELETE else copy.deepcopy(value))
    with pytest.raises(DefinitionError) as caught:
        load_definition(write(tmp_path, data))
    assert expected in caught.value.message, caught.value.message
    assert "definition.schema.json" in caught.value.hint


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    data = minimal()
    data["architecture"] = "mips"
    data["disk_size"] = "big"
    with pytest.raises(DefinitionError) as caught:
        load_definition(write(tmp_path, data))
    assert "2 problem(s)" in caught.value.message


def test_semantic_checks(tmp_path: Path) -> None:
    data = minimal()
    data["kubernetes"] = {
        "installed": "1.36.3",
        "staged": ["1.36.3"],
        "repository": {
            "url": "https://pkgs.k8s.io/core:/stable:/v{minor}/deb/",
            "flat": True,
            "keyring": "k.asc",
        },
    }
    with pytest.raises(DefinitionError, match="both installed and staged"):
        load_definition(write(tmp_path, data))
    data = minimal()
    art = {"version": "1", "kind": "binary", "urls": "https://x/y", "destination": "/opt/x"}
    data["artifacts"] = [{"name": "a", **art}, {"name": "a", **art}]
    with pytest.raises(DefinitionError, match="repeated: a"):
        load_definition(write(tmp_path, data))
    data = minimal()
    data["architecture"] = "arm64"
    data["artifacts"] = [{"name": "a", **art, "urls": {"amd64": "https://x/y"}}]
    with pytest.raises(DefinitionError, match="no entry for architecture arm64"):
        load_definition(write(tmp_path, data))
    data = minimal()
    data["apt_sources"] = [{"name": "d", "url": "http://deb.debian.org/debian", "keyring": "k"}]
    with pytest.raises(DefinitionError, match="suite is required unless flat"):
        load_definition(write(tmp_path, data))


def test_environment_references(tmp_path: Path) -> None:
    data = minimal()
    data["installer"]["iso"]["url"] = "file://${ISO_PATH}"
    data["installer"]["iso"]["mirrors"] = ["${MIRROR:-https://mirror.invalid}/x.iso"]
    path = write(tmp_path, data)
    with pytest.raises(DefinitionError, match=r"installer\.iso\.url: \$\{ISO_PATH\} is not set") as caught:
        load_definition(path, environ={})
    assert "export ISO_PATH=" in caught.value.hint
    defn = load_definition(path, environ={"ISO_PATH": "/srv/x.iso"})
    assert defn.installer.iso.url == "file:///srv/x.iso"
    assert defn.installer.iso.mirrors == ("https://mirror.invalid/x.iso",)
    other = load_definition(path, environ={"ISO_PATH": "/srv/y.iso"})
    assert other.resolved_sha256 != defn.resolved_sha256  # a lock is for one resolved definition
    assert other.file_sha256 == defn.file_sha256


def test_relative_paths_are_relative_to_the_definition(tmp_path: Path) -> None:
    data = minimal()
    data["agent"]["source"] = "../repo"
    data["apt_sources"] = [
        {"url": "http://deb.debian.org/debian", "suite": "bookworm", "keyring": "keys/d.gpg"}
    ]
    sub = tmp_path / "defs"
    sub.mkdir()
    defn = load_definition(write(sub, data))
    assert defn.agent.source == tmp_path / "repo"
    assert defn.apt_sources[0].keyring == sub / "keys/d.gpg"


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError, match="cannot read the definition"):
        load_definition(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(DefinitionError, match="not valid UTF-8 YAML"):
        load_definition(bad)


def test_the_schema_is_valid_json_schema_for_editors() -> None:
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(schema())
    shipped = REPO / "imagebuilder/schemas/definition.schema.json"
    assert json.loads(shipped.read_text()) == schema()
    assert validate(minimal()) == []


def test_a_pattern_end_is_the_end_of_the_string() -> None:
    """JSON Schema patterns are ECMA-262: ``$`` never matches before a final newline, as Python's would."""
    assert schemacheck.ecma_pattern("^[a-f]{2}$") == r"^[a-f]{2}\Z"
    assert schemacheck.ecma_pattern(r"^a\$[$]$") == r"^a\$[$]\Z"
    schema = {"type": "string", "pattern": "^[0-9a-f]{4}$"}
    assert schemacheck.validate(schema, "beef") == []
    assert schemacheck.validate(schema, "beef\n") == [
        "(top level): 'beef\\n' does not match '^[0-9a-f]{4}$'"
    ]


def test_an_oversized_definition_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"name: x\n" + b"#" * MAX_DEFINITION_BYTES)
    with pytest.raises(DefinitionError, match="larger than 1024 KiB"):
        load_definition(path)


@pytest.mark.parametrize("example", ["fixture-node.yaml", "ubuntu-2404-node.yaml"])
def test_an_example_written_elsewhere_keeps_every_file_it_names(example: str, tmp_path: Path) -> None:
    """The VM tier, make demo and bench/build.py write variants of the examples into their own folders
    (tests/support/definitions.py): every relative path must follow, whatever key the definition grows."""
    from tests.support.definitions import absolute_paths

    path_keys = ("keyring", "source")  # every key of a definition that names a file or folder

    source = Path(__file__).resolve().parents[2] / "examples" / example
    data = yaml.safe_load(source.read_text())

    def paths(node: object) -> list[str]:
        if isinstance(node, dict):
            return [v for k, v in node.items() if k in path_keys and isinstance(v, str)] + [
                p for v in node.values() for p in paths(v)
            ]
        return [p for v in node for p in paths(v)] if isinstance(node, list) else []

    relative = [p for p in paths(data) if not p.startswith(("/", "$")) and "://" not in p]
    absolute_paths(data, source.parent)
    moved = tmp_path / "elsewhere" / example
    moved.parent.mkdir()
    moved.write_text(yaml.safe_dump(data, sort_keys=False))
    environ = {
        "IMAGEBUILDER_PAYLOADS": "http://127.0.0.1:8765",
        "IMAGEBUILDER_FIXTURE_ISO": str(tmp_path / "x.iso"),
    }
    load_definition(moved, environ=environ)
    after = paths(data)
    assert relative and all(str((source.parent / p).resolve()) in after for p in relative), (relative, after)
    # the example's own files (not the keys a user fetches first, docs/building-images.md) are found from there
    shipped = [p for p in relative if (source.parent / p).exists()]
    assert shipped and all((source.parent / p).resolve().exists() for p in shipped)
    assert not [p for p in after if not p.startswith(("/", "$")) and "://" not in p], after
