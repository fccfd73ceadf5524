"""The settings framework, with jsonschema as a second opinion on every table's JSON Schema.

The JSON Schemas are generated from the same tables the programs validate with; the ``jsonschema``
library must accept what the programs accept and refuse what they refuse (for what a schema can
say: keys, types, ranges, choices, patterns), and the examples in docs/ must pass both.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import assume, given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from agent.config import TABLE as AGENT
from imagebuilder.commands.options import TABLE as BUILDER
from protocol.errors import PolicyError
from protocol.policy import PROFILE, policy_from_mapping
from protocol.settings import (
    Ctx,
    Problem,
    Setting,
    SettingError,
    Table,
    address,
    duration,
    integer,
    list_of,
    size,
    text,
)
from server.config import config_from_mapping, json_schema
from server.ek.config import TABLE as EK
from server.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SERVER = Draft202012Validator(json_schema())
PROFILES = Draft202012Validator(PROFILE.json_schema())
AGENT_FILES = Draft202012Validator(AGENT.json_schema())


def _yaml_blocks(doc: str) -> list[Any]:
    text_ = (ROOT / "docs" / doc).read_text()
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text_, re.S)]


# --------------------------------------------------------------------------- the framework


def test_errors_carry_the_path_the_problem_and_what_is_expected() -> None:
    table = Table(
        "t",
        (
            Setting("n", integer(1, 9), "a number", 1),
            Setting("names", list_of(text("a name", pattern=r"[a-z]+")), "names", ()),
            Setting("need", text(), "needed", required=True),
        ),
    )
    with pytest.raises(SettingError) as err:
        table.parse({"need": "x", "names": ["ok", "Bad"]}, Ctx(("top",)))
    assert (err.value.path, err.value.problem, err.value.expected) == (
        ("top", "names", 1),
        Problem.TYPE,
        "a name",
    )
    assert str(err.value) == "top.names[1]: expected a name, got str 'Bad'"
    with pytest.raises(SettingError) as err:
        table.parse({"need": "x", "nn": 1}, Ctx(("top",)))
    assert err.value.problem is Problem.UNKNOWN_KEY and err.value.allowed == ("n", "names", "need")
    assert str(err.value) == "unknown key top.nn; allowed in top: n, names, need"
    with pytest.raises(SettingError, match="need is required: needed") as err:
        table.parse({})
    assert err.value.problem is Problem.MISSING
    with pytest.raises(SettingError, match=r"n: must be between 1 and 9, got 10"):
        table.parse({"need": "x", "n": 10})
    assert table.parse({"need": "x"}) == {"n": 1, "names": (), "need": "x"}


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (text(pattern=r"[a-z]+"), "abc\n"),
        (address(), "host:80\n"),
        (duration(), "30s\n"),
        (size(), "1KiB\n"),
        (integer(), "8\n"),
    ],
)
def test_a_trailing_newline_is_refused_by_every_kind(kind: Any, value: str) -> None:
    with pytest.raises(SettingError):
        kind.parse(value, Ctx(("k",), lenient=True))
    assert not Draft202012Validator({"type": "object", "properties": {"k": dict(kind.schema)}}).is_valid(
        {"k": value}
    )


def test_values_are_bounded_before_parsing() -> None:
    with pytest.raises(SettingError, match="longer than 4096 characters"):
        AGENT.parse_text("tcti", "x" * 5000, "--tcti")


def test_untyped_flags_keep_their_text_for_the_loader() -> None:
    parser = argparse.ArgumentParser()
    AGENT.add_arguments(parser, ["tcti", "require_ek_cert", "timeout_s"])
    args = parser.parse_args(["--tcti", "swtpm:port=1", "--no-require-ek-cert", "--timeout", "90"])
    assert AGENT.given(args) == {"tcti": "swtpm:port=1", "require_ek_cert": False, "timeout_s": "90"}
    assert AGENT.given(parser.parse_args([])) == {}


def test_typed_flags_are_parsed_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="imagebuilder test")
    BUILDER.add_arguments(parser, ["accel", "work_dir", "keep_work"], typed=True)
    args = parser.parse_args(["--accel", "tcg", "--work-dir", "/tmp/w"])
    assert (args.accel, args.work_dir, args.keep_work) == ("tcg", Path("/tmp/w"), False)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--accel", "fast"])
    assert done.value.code == 2
    assert "argument --accel: 'fast' is not one of auto, kvm, tcg" in capsys.readouterr().err


# --------------------------------------------------------------------------- JSON Schema, checked by jsonschema


def test_every_generated_schema_is_a_valid_draft_2020_12_schema() -> None:
    for schema in (json_schema(), PROFILE.json_schema(), AGENT.json_schema(), EK.json_schema()):
        Draft202012Validator.check_schema(schema)


def test_the_docs_examples_pass_both() -> None:
    server_doc = {**_yaml_blocks("attestation.md")[0], **_yaml_blocks("join.md")[0]}
    assert list(SERVER.iter_errors(server_doc)) == []
    config_from_mapping(server_doc)
    ek_doc = {"trust_domain": "example.org", "data_dir": "/d", **_yaml_blocks("ek-trust.md")[0]}
    assert list(SERVER.iter_errors(ek_doc)) == []
    config_from_mapping(ek_doc)
    for profile in [
        *_yaml_blocks("gpu-checks.md"),
        *(yaml.safe_load(p.read_text()) for p in (ROOT / "examples" / "pools").glob("*.yaml")),
    ]:
        named = {"name": "p", **profile}
        assert list(PROFILES.iter_errors(named)) == [], named
        policy_from_mapping(named)


def _server(**change: Any) -> dict[str, Any]:
    return {"trust_domain": "example.org", "data_dir": "/var/lib/nodeserver", **change}


@pytest.mark.parametrize(
    "doc",
    [
        _server(colour="blue"),
        _server(listen="8081"),
        _server(listen="0.0.0.0:8081\n"),
        _server(agent_svid_ttl="soon"),
        _server(agent_svid_ttl="1h 30m"),
        _server(agent_svid_ttl="-1h"),
        _server(agent_svid_ttl=True),
        _server(challenge_timeout=1.5),
        _server(max_payload_bytes=10),
        _server(max_payload_bytes="64k"),
        _server(max_streams_per_connection=0),
        _server(attest_rate_per_ip=-1),
        _server(server_dns_names="localhost"),
        _server(trust_domain="Example.ORG"),
        _server(trust_domain="example.org\n"),
        _server(ek_trust={"ca_dirr": "/x"}),
        _server(ek_trust={"mode": "either"}),
        _server(ek_trust={"max_chain_depth": 0}),
        _server(ek_trust={"ignore_critical_extensions": ["2.5.29.17\n"]}),
        _server(ek_trust="yes"),
        {"data_dir": "/var/lib/nodeserver"},
    ],
)
def test_bad_server_files_are_refused_by_both(doc: dict[str, Any]) -> None:
    assert not SERVER.is_valid(doc)
    with pytest.raises(ConfigError):
        config_from_mapping(doc)


@pytest.mark.parametrize(
    "profile",
    [
        {"name": "p", "gpus": {}},
        {"name": "p", "gpu": {"modle": "x"}},
        {"name": "p", "gpu": {"count": "8"}},
        {"name": "p", "gpu": {"count": True}},
        {"name": "p", "gpu": {"min_cuda": 12.8}},
        {"name": "p", "gpu": {"mig": "off"}},
        {"name": "p", "gpu": []},
        {"name": "p", "checks": {"fatal": "gpu.mig"}},
        {"name": "p", "join": {"labels": {"a": 1}}},
        {"name": "p", "join": {"taints": [{"key": "k", "colour": "x"}]}},
        {"preset": "gke"},
    ],
)
def test_bad_profiles_are_refused_by_both(profile: dict[str, Any]) -> None:
    assert not PROFILES.is_valid(profile)
    with pytest.raises(PolicyError):
        policy_from_mapping(profile)


def test_agent_files_both_ways() -> None:
    good = {"server": "10.0.0.5:8081", "require_ek_cert": "yes", "retry_initial_s": 0.5, "deadline_s": "25m"}
    examples = [b for b in _yaml_blocks("join.md") if "trust_domain" in b and "cluster" not in b]
    assert examples, "docs/join.md shows an /etc/nodeagent/config.yaml"
    for doc in (good, *examples):
        assert AGENT_FILES.is_valid(doc), doc
        AGENT.parse(doc)
    for bad in (
        {"servr": "x:1"},
        {"server": "nowhere"},
        {"ek_alg": "dsa"},
        {"deadline_s": "soon"},
        {"require_ek_cert": "maybe"},
    ):
        assert not AGENT_FILES.is_valid(bad), bad
        with pytest.raises(SettingError):
            AGENT.parse(bad)


_DURATION_TEXT = st.text(alphabet="0123456789.hmsund-+ \n\u00b5", max_size=10)


@pytest.mark.parametrize("seconds", [False, True])
@given(value=_DURATION_TEXT)
def test_duration_pattern_and_parser_agree(seconds: bool, value: str) -> None:
    kind = duration(seconds=seconds)
    try:
        kind.parse(value, Ctx(("d",)))
        ours = True
    except SettingError as exc:
        assume("longest duration" not in str(exc))  # a range a pattern cannot express
        ours = False
    schema = Draft202012Validator({"type": "object", "properties": {"d": dict(kind.schema)}})
    assert schema.is_valid({"d": value}) is ours


@given(value=st.text(alphabet="0123456789KMGTiBk. \n", max_size=10))
def test_size_pattern_and_parser_agree(value: str) -> None:
    kind = size()
    try:
        kind.parse(value, Ctx(("s",)))
        ours = True
    except SettingError:
        ours = False
    schema = Draft202012Validator({"type": "object", "properties": {"s": dict(kind.schema)}})
    assert schema.is_valid({"s": value}) is ours


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("min_driver", "570.124.06\n"),
        ("min_driver", "570.\u00b2.06"),  # str.isdigit() says yes to a superscript two
        ("min_cuda", "12.\u0668"),  # an Arabic-Indic digit
        ("min_cuda", "12.8 "),
    ],
)
def test_profile_versions_are_ascii_digits_matched_whole(key: str, value: str) -> None:
    with pytest.raises(PolicyError, match=f"gpu.{key}: .* is not a version"):
        policy_from_mapping({"name": "p", "gpu": {key: value}})
