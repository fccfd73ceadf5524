"""The autoinstall user-data and the templates it comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from imagebuilder import autoinstall
from imagebuilder.definition import load_definition
from imagebuilder.errors import BuildError

REPO = Path(__file__).resolve().parents[2]


def _defn() -> object:
    return load_definition(
        REPO / "examples/fixture-node.yaml", environ={"IMAGEBUILDER_FIXTURE_ISO": "/x.iso"}
    )


def test_the_packaged_templates_are_the_canonical_ones() -> None:
    packaged = REPO / "imagebuilder" / "templates"
    assert (packaged / "autoinstall-user-data.yaml.tmpl").read_text() == (
        REPO / "cloud-init/autoinstall-user-data.yaml.tmpl"
    ).read_text(), "copy cloud-init/autoinstall-user-data.yaml.tmpl to imagebuilder/templates/"
    assert (packaged / "stage.sh.tmpl").read_text() == (REPO / "cloud-init/stage.sh").read_text(), (
        "copy cloud-init/stage.sh to imagebuilder/templates/stage.sh.tmpl"
    )


def test_user_data_for_the_installer() -> None:
    text = autoinstall.user_data(_defn(), webhook=autoinstall.webhook_url("tok"))  # type: ignore[arg-type]
    assert text.startswith("#cloud-config\n")
    auto = yaml.safe_load(text)["autoinstall"]
    assert auto["version"] == 1
    assert auto["shutdown"] == "poweroff"
    assert auto["interactive-sections"] == []
    assert auto["apt"]["geoip"] is False and auto["apt"]["fallback"] == "offline-install"
    assert auto["refresh-installer"] == {"update": False}
    assert "updates" not in auto
    assert auto["storage"]["layout"] == {"name": "direct", "match": {"size": "largest"}}
    assert auto["ssh"] == {"install-server": True, "allow-pw": False}
    assert auto["reporting"]["builder"] == {
        "type": "webhook", "endpoint": "http://10.0.2.100:8080/nodetrust/tok/events", "level": "DEBUG"
    }  # fmt: skip
    assert auto["reporting"]["builtin"] == {"type": "print"}
    late = " ".join(auto["late-commands"])
    assert "/dev/disk/by-label/NTSTAGE" in late and "stage.sh" in late and '"/dev/ttyS1"' in late
    errors = " ".join(auto["error-commands"])
    assert "NODETRUST-INSTALLER-LOGS-BEGIN" in errors and "/dev/console" in errors
    assert "source" not in auto  # no source id in the fixture definition: the key is left out


def test_without_a_network_there_is_no_webhook() -> None:
    auto = yaml.safe_load(autoinstall.user_data(_defn(), webhook=None))["autoinstall"]  # type: ignore[arg-type]
    assert "builder" not in auto["reporting"]


def test_render_checks_placeholders() -> None:
    assert autoinstall.render("a: {{ x }}\nb: {{y}}", {"x": [1], "y": None}) == "a: [1]\nb: null"
    with pytest.raises(BuildError, match="has no value"):
        autoinstall.render("{{ missing }}", {})
    with pytest.raises(BuildError, match="no placeholder for: extra"):
        autoinstall.render("plain", {"extra": 1})


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"shutdown": "reboot"}, "shutdown must be poweroff"),
        ({"version": 2}, "version must be 1"),
        ({"interactive-sections": ["*"]}, "interactive-sections must be empty"),
        ({"late-commands": []}, "late-commands and error-commands are required"),
    ],
)
def test_the_builder_refuses_a_template_it_cannot_watch(change: dict[str, object], problem: str) -> None:
    auto = {"version": 1, "shutdown": "poweroff", "late-commands": ["x"], "error-commands": ["y"], **change}
    with pytest.raises(BuildError, match=problem):
        autoinstall.check({"autoinstall": auto})
    with pytest.raises(BuildError, match="no top-level autoinstall"):
        autoinstall.check({"version": 1})


def test_meta_data() -> None:
    assert autoinstall.meta_data("node-1") == "instance-id: node-1\nlocal-hostname: node-1\n"


@pytest.mark.subprocess
def test_the_stage_script_is_valid_posix_shell() -> None:
    from imagebuilder.run import run

    run(["sh", "-n", str(REPO / "cloud-init/stage.sh")])
