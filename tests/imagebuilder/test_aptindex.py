"""apt indexes: dpkg's version order, relations, and the dependency closure the lock stages."""

from __future__ import annotations

import pytest

from imagebuilder.aptindex import (
    PackageEntry,
    Relation,
    compare_versions,
    parse_manifest,
    parse_relations,
    parse_stanzas,
    resolve,
    satisfies,
)
from imagebuilder.errors import LockError

# (smaller, larger) pairs in dpkg's order (checked against `dpkg --compare-versions`)
ORDERED = [
    ("1.0", "1.1"),
    ("1.0~rc1", "1.0"),
    ("1.0", "1.0+b1"),
    ("1.0-1", "1.0-1.1"),
    ("1.36.3-1.1", "1.37.2-1.1"),
    ("1.9", "1.10"),
    ("2:1.0", "3:0.1"),
    ("1:1.2.13.dfsg-1", "1:1.2.13.dfsg-1+b1"),
    ("3.0.20-1~deb12u1", "3.0.20-1~deb12u2"),
    ("3.0.20-1~deb12u2", "3.0.20-1"),
    ("0.9a", "0.9b"),
    ("1.0a", "1.0+"),
    ("7.88.1-10+deb12u14", "7.88.1-10+deb12u15"),
]


@pytest.mark.parametrize(("small", "large"), ORDERED)
def test_version_order(small: str, large: str) -> None:
    assert compare_versions(small, large) < 0
    assert compare_versions(large, small) > 0
    assert compare_versions(small, small) == 0


@pytest.mark.subprocess
@pytest.mark.parametrize(("small", "large"), ORDERED)
def test_version_order_matches_dpkg(small: str, large: str) -> None:
    from imagebuilder.run import run

    assert run(["dpkg", "--compare-versions", small, "lt", large], check=False).returncode == 0


def test_equal_versions_with_different_spelling() -> None:
    assert compare_versions("0:1.0", "1.0") == 0
    assert compare_versions("1.0-0", "1.0") == 0  # revision "0" and no revision are equal to dpkg
    assert compare_versions("1.00", "1.0") == 0


def test_satisfies() -> None:
    assert satisfies("1.36.3-1.1", ">=", "1.36.0")
    assert not satisfies("1.35.9-1.1", ">=", "1.36.0")
    assert satisfies("1.0", "<<", "1.1")
    assert satisfies("1.0", "=", "1.0")
    assert satisfies("2", None, None)


def test_relations_and_stanzas() -> None:
    groups = parse_relations("libc6 (>= 2.34), libcurl4 | libcurl3-gnutls:any, python3:any (<< 3.12)")
    assert groups == [
        [Relation("libc6", ">=", "2.34")],
        [Relation("libcurl4"), Relation("libcurl3-gnutls")],
        [Relation("python3", "<<", "3.12")],
    ]
    stanzas = parse_stanzas("Package: a\nDescription: x\n more\n\nPackage: b\n")
    assert stanzas == [{"Package": "a", "Description": "x\nmore"}, {"Package": "b"}]
    assert parse_manifest("adduser\t3.134\nlibc6:amd64 2.36-9\n\n") == {
        "adduser": "3.134",
        "libc6": "2.36-9",
    }


def _entry(name: str, version: str, depends: str = "", provides: str = "") -> PackageEntry:
    return PackageEntry(
        name=name, version=version, architecture="amd64", url=f"http://x/{name}_{version}.deb", size=1,
        sha256="0" * 64, repository="test",
        depends=tuple(tuple(g) for g in parse_relations(depends)),
        provides=tuple(r.name for g in parse_relations(provides) for r in g),
    )  # fmt: skip


INDEX = [
    _entry("libtss2-fapi1", "3.2.1-3", "libc6 (>= 2.34), libcurl4 (>= 7.16.2), libjson-c5, tpm-udev"),
    _entry("libcurl4", "7.88.1-10+deb12u15", "libc6, libnghttp2-14 (>= 1.50), libssl3"),
    _entry("libcurl4", "7.88.1-10+deb12u14", "libc6"),
    _entry("libnghttp2-14", "1.52.0-1+deb12u3", "libc6"),
    _entry("kubeadm", "1.36.3-1.1", "kubelet (>= 1.36.0), cri-tools (>= 1.36.0)"),
    _entry("kubeadm", "1.35.3-1.1", "kubelet (>= 1.35.0), cri-tools (>= 1.35.0)"),
    _entry("kubelet", "1.36.3-1.1", "kubernetes-cni (>= 1.2.0)"),
    _entry("kubelet", "1.35.3-1.1", "kubernetes-cni (>= 1.2.0)"),
    _entry("cri-tools", "1.36.0-1.1"),
    _entry("cri-tools", "1.35.0-1.1"),
    _entry("kubernetes-cni", "1.7.1-1.1"),
    _entry("mta-thing", "1", "mail-transport-agent"),
    _entry("postfix", "3", provides="mail-transport-agent"),
]
BASE = {"libc6": "2.36-9+deb12u10", "libssl3": "3.0.20-1~deb12u2", "libjson-c5": "0.16-2", "tpm-udev": "0.6"}


def test_the_closure_skips_the_base_and_takes_the_highest_version() -> None:
    resolution = resolve([("libtss2-fapi1", None)], INDEX, BASE)
    assert [(p.name, p.version) for p in resolution.packages()] == [
        ("libcurl4", "7.88.1-10+deb12u15"),
        ("libnghttp2-14", "1.52.0-1+deb12u3"),
        ("libtss2-fapi1", "3.2.1-3"),
    ]


def test_pinned_versions_and_packages_already_installed() -> None:
    resolution = resolve([("kubeadm", "1.35.3-1.1"), ("libssl3", None)], INDEX, BASE)
    assert {p.name: p.version for p in resolution.packages()} == {
        "kubeadm": "1.35.3-1.1",
        "kubelet": "1.36.3-1.1",  # the highest that satisfies >= 1.35.0
        "cri-tools": "1.36.0-1.1",
        "kubernetes-cni": "1.7.1-1.1",
    }
    assert resolution.already_installed == ["libssl3"]
    staged = resolve([("kubeadm", "1.35.3-1.1")], INDEX, {**BASE, "cri-tools": "1.36.0-1.1",
                                                           "kubelet": "1.36.3-1.1", "kubernetes-cni": "1.7.1-1.1"})  # fmt: skip
    assert [p.name for p in staged.packages()] == ["kubeadm"]


def test_virtual_packages_and_missing_ones() -> None:
    resolution = resolve([("postfix", None), ("mta-thing", None)], INDEX, BASE)
    assert [p.name for p in resolution.packages()] == ["mta-thing", "postfix"]
    with pytest.raises(LockError, match="package nosuch is in no configured apt source"):
        resolve([("nosuch", None)], INDEX, BASE)
    with pytest.raises(LockError, match=r"available: 1\.35\.3-1\.1, 1\.36\.3-1\.1"):
        resolve([("kubeadm", "1.99.0-1.1")], INDEX, BASE)
    broken = [*INDEX, _entry("needs-ghost", "1", "ghost (>= 2)")]
    with pytest.raises(LockError, match="depends on ghost"):
        resolve([("needs-ghost", None)], broken, BASE)
