"""The Kubernetes version switch (agent.kubeversion) and the skew check that judges the version that will run.

apt, dpkg-query and the kubelet are the test double of tests/support/apt_double.py (the real ones would
change this machine's packages); the staged debs are real ones made with dpkg-deb.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent import kubeversion
from agent.errors import KubernetesVersionError
from protocol.policy import assess, policy_from_mapping
from protocol.report import Observation, Status
from tests.support.apt_double import install_apt_double, load
from tests.support.payload_server import _deb

pytestmark = pytest.mark.subprocess
INSTALLED = {"kubeadm": "1.36.3-1.1", "kubelet": "1.36.3-1.1", "kubectl": "1.36.3-1.1"}


def image(tmp_path: Path, *, missing: str = "") -> Path:
    staged = {}
    for version in ("1.34.2", "1.35.3"):
        folder = tmp_path / "staged" / version
        for package in kubeversion.PACKAGES:
            if package != missing or version != "1.35.3":
                _deb(folder, package, f"{version}-1.1", {f"/usr/bin/{package}": b"#!/bin/sh\n"})
        staged[version] = str(folder) + "/"
    info = tmp_path / "image.json"
    info.write_text(json.dumps({"build_id": "b", "kubernetes": {"installed": "1.36.3", "staged": list(staged),
                                                                 "staged_paths": staged}}))  # fmt: skip
    return info


@pytest.fixture
def apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    db = tmp_path / "packages.json"
    bin_dir = install_apt_double(tmp_path / "bin", db, INSTALLED)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin")
    return db


def calls(db: Path, tool: str) -> list[list[str]]:
    return [c[1:] for c in load(db)["calls"] if c[0] == tool]


def test_what_the_image_carries(tmp_path: Path) -> None:
    carried = kubeversion.carried(image(tmp_path))
    assert carried is not None
    assert carried.installed == "1.36.3" and carried.versions == ["1.34.2", "1.35.3", "1.36.3"]
    assert kubeversion.carried(tmp_path / "absent.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KubernetesVersionError, match="cannot read what the image carries"):
        kubeversion.carried(tmp_path / "bad.json")


def test_the_version_that_will_run(tmp_path: Path) -> None:
    carried = kubeversion.carried(image(tmp_path))
    assert kubeversion.predict(carried, control_plane="1.35") == "1.35.3"
    assert kubeversion.predict(carried, control_plane="v1.34.9") == "1.34.2"
    assert (
        kubeversion.predict(carried, control_plane="1.31") == "1.36.3"
    )  # none of that minor: the installed
    assert kubeversion.predict(carried) == "1.36.3"
    assert (
        kubeversion.predict(carried, selected="1.34.2", control_plane="1.35") == "1.34.2"
    )  # the answer's wins


def test_a_version_the_image_does_not_carry_is_refused_naming_what_it_carries(tmp_path: Path) -> None:
    carried = kubeversion.carried(image(tmp_path))
    assert kubeversion.select("v1.35.3", carried) == "1.35.3"
    with pytest.raises(KubernetesVersionError) as err:
        kubeversion.select("v1.33.1", carried)
    assert (
        "carries only 1.34.2, 1.35.3, 1.36.3 (installed 1.36.3): nothing was installed" in err.value.message
    )
    assert err.value.permanent and err.value.exit_code == 12
    with pytest.raises(KubernetesVersionError, match=r"is not MAJOR\.MINOR\.PATCH"):
        kubeversion.select("1.35", carried)


def test_the_installed_version_is_only_held(tmp_path: Path, apt: Path) -> None:
    carried = kubeversion.carried(image(tmp_path))
    assert carried is not None
    data = load(apt)
    data["packages"]["kubectl"]["held"] = False
    apt.write_text(json.dumps(data))
    done = kubeversion.activate("1.36.3", carried)
    assert not done.installed_now and done.packages["kubelet"] == "1.36.3-1.1"
    assert calls(apt, "apt-get") == [] and calls(apt, "apt-mark") == [["hold", "kubectl"]]


def test_a_staged_version_is_installed_offline_and_held(tmp_path: Path, apt: Path) -> None:
    carried = kubeversion.carried(image(tmp_path))
    assert carried is not None
    done = kubeversion.activate("1.35.3", carried)
    assert done.installed_now
    assert {p: v["version"] for p, v in load(apt)["packages"].items()} == {
        p: "1.35.3-1.1" for p in INSTALLED
    }
    assert all(v["held"] for v in load(apt)["packages"].values())
    simulate, install = calls(apt, "apt-get")
    assert "--simulate" in simulate and "--simulate" not in install
    for argv in (simulate, install):
        # offline (no source list), downgrades and held packages allowed, exactly the staged debs
        assert "Dir::Etc::SourceList=/dev/null" in argv and "Dir::Etc::SourceParts=/nonexistent" in argv
        assert (
            "--no-download" not in argv
        )  # with it, the real apt installs no local .deb (agent.kubeversion)
        assert "--allow-downgrades" in argv and "--allow-change-held-packages" in argv
        assert sorted(Path(a).name for a in argv if a.endswith(".deb")) == [
            f"{p}_1.35.3-1.1_amd64.deb" for p in sorted(kubeversion.PACKAGES)
        ]
    assert calls(apt, "apt-mark")[-1] == ["hold", *kubeversion.PACKAGES]


@pytest.mark.parametrize("fault", ["missing-deb", "simulate-fails", "not-staged"])
def test_nothing_is_installed_when_the_version_cannot_be(tmp_path: Path, apt: Path, fault: str) -> None:
    carried = kubeversion.carried(image(tmp_path, missing="kubelet" if fault == "missing-deb" else ""))
    assert carried is not None
    if fault == "simulate-fails":
        data = load(apt)
        data["fail_simulate"] = True
        apt.write_text(json.dumps(data))
    version = "1.37.2" if fault == "not-staged" else "1.35.3"
    with pytest.raises(KubernetesVersionError) as err:
        kubeversion.activate(version, carried)
    assert "nothing was installed" in err.value.message
    assert {p: v["version"] for p, v in load(apt)["packages"].items()} == INSTALLED
    assert [c for c in calls(apt, "apt-get") if "--simulate" not in c] == []
    assert calls(apt, "apt-mark") == []
    if fault == "missing-deb":
        assert "lacks kubelet at 1.35.3" in err.value.message


def _kubelet_check(profile: dict[str, Any], observations: dict[str, Any]) -> tuple[Status, str, str]:
    policy = policy_from_mapping({"name": "p", "preset": "cpu", **profile})
    checks, _ = assess([Observation("node.kubelet", "`kubelet --version`", observations)], policy)
    check = next(c for c in checks if c.name == "node.kubelet")
    return check.status, check.observed, check.reason


def test_the_skew_check_judges_the_version_that_will_run() -> None:
    profile = {"node": {"control_plane_version": "1.35"}, "checks": {"fatal": ["node.kubelet"]}}
    installed = {"version": "v1.36.3", "raw": "Kubernetes v1.36.3", "error": None}
    # an older agent's report, or a node without the switch: the installed 1.36.3 is newer than 1.35
    status, _, reason = _kubelet_check(profile, installed)
    assert status is Status.FAIL and "newer than the control plane 1.35" in reason
    carried = ["1.34.2", "1.35.3", "1.36.3"]
    status, observed, _ = _kubelet_check(profile, {**installed, "will_run": "1.35.3", "carried": carried})
    assert status is Status.PASS
    assert observed == "kubelet v1.36.3 installed; 1.35.3 will run at the join (staged)"
    status, _, reason = _kubelet_check(profile, {**installed, "will_run": "1.33.0", "carried": carried})
    assert status is Status.FAIL and "the image carries only 1.34.2, 1.35.3, 1.36.3" in reason
    status, _, reason = _kubelet_check(
        {"node": {"control_plane_version": "1.31"}, "checks": {"fatal": ["node.kubelet"]}},
        {**installed, "will_run": "1.36.3", "carried": carried},
    )
    assert status is Status.FAIL and "newer than the control plane 1.31" in reason
