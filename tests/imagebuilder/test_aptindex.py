"""apt indexes: dpkg's version order, relations, and the dependency closure the lock stages."""

from __future__ import annotations

import pytest

from imagebuilder.aptindex import (
    PackageEntry,
    Relation,
    compare_versions,
    entry_from_control,
    parse_index,
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
    assert stanzas == [{"Package": "a", "Description": "x\n more"}, {"Package": "b"}]  # deb822 folding
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


# -- versioned Provides, Breaks and Conflicts, on small hand-made Packages indexes -------------------


def _index(text: str) -> list[PackageEntry]:
    """A Packages index as apt serves it (deb822), parsed the way load_index parses a fetched one."""
    return list(parse_index(text, "https://deb.example/", "test", "amd64"))


def _stanza(name: str, version: str, **fields: str) -> str:
    lines = [f"Package: {name}", f"Version: {version}", "Architecture: amd64"]
    lines += [f"{key.replace('_', '-').title()}: {value}" for key, value in fields.items()]
    lines += [f"Filename: pool/{name}_{version}_amd64.deb", "Size: 1", f"SHA256: {'ab' * 32}"]
    return "\n".join(lines) + "\n\n"


def _names(resolution: object) -> dict[str, str]:
    return {p.name: p.version for p in resolution.packages()}  # type: ignore[attr-defined]


def test_a_packages_index_is_read_as_deb822() -> None:
    text = (
        "Package: libfoo1\nVersion: 1:2.3-4\nArchitecture: amd64\nMulti-Arch: same\n"
        "Depends: libc6 (>= 2.34),\n libbar2 | libbaz2:any (>> 0.9)\nProvides: libfoo (= 1:2.3-4)\n"
        "Breaks: foo-tools (<< 2)\nConflicts: libfoo0\nFilename: ./pool/libfoo1.deb\nSize: 10\n"
        f"SHA256: {'AB' * 32}\nDescription: foo\n long text\n .\n more\n\n"
        "Package: other-arch\nVersion: 1\nArchitecture: arm64\nFilename: x\nSize: 1\n"
        f"SHA256: {'ab' * 32}\n\n"
        "Package: no-digest\nVersion: 1\nArchitecture: all\nFilename: y\nSize: 1\n"
    )
    (entry,) = _index(text)
    assert (entry.name, entry.version, entry.url, entry.size) == (
        "libfoo1",
        "1:2.3-4",
        "https://deb.example/pool/libfoo1.deb",
        10,
    )
    assert entry.sha256 == "ab" * 32
    assert entry.depends == (
        (Relation("libc6", ">=", "2.34"),),
        (Relation("libbar2"), Relation("libbaz2", ">>", "0.9")),
    )
    assert entry.provides == (Relation("libfoo", "=", "1:2.3-4"),)
    assert entry.breaks == (Relation("foo-tools", "<<", "2"),)
    assert entry.conflicts == (Relation("libfoo0"),)


def test_a_version_that_is_not_debian_is_refused() -> None:
    with pytest.raises(LockError, match=r"version '1\.0 beta', which is not a Debian version"):
        _index(_stanza("bad", "1.0 beta"))


def test_plain_names_in_provides_still_work() -> None:
    entry = PackageEntry("p", "1", "amd64", "u", 1, "0" * 64, "lock", provides=("mail-transport-agent",))
    assert entry.provides == (Relation("mail-transport-agent"),)


def test_entry_from_control_fields() -> None:
    control = parse_stanzas("Package: k\nVersion: 1.0\nArchitecture: amd64\nPre-Depends: a\nDepends: b\n")[0]
    entry = entry_from_control(control, url="file:///k.deb", size=3, sha256="0" * 64, repository="lock")
    assert entry.depends == ((Relation("a"),), (Relation("b"),))


def test_a_versioned_provides_satisfies_a_versioned_dependency() -> None:
    index = _index(
        _stanza("needs-foo", "1", depends="foo (>= 2.0)")
        + _stanza("foo-impl", "5", provides="foo (= 2.1)")
        + _stanza("old-foo-impl", "9", provides="foo (= 1.9)")
    )
    assert _names(resolve([("needs-foo", None)], index, BASE)) == {"needs-foo": "1", "foo-impl": "5"}


def test_an_unversioned_provides_never_satisfies_a_versioned_dependency() -> None:
    index = _index(
        _stanza("needs-bar", "1", depends="bar (>= 1)") + _stanza("bar-impl", "1", provides="bar")
    )
    with pytest.raises(LockError, match=r"depends on bar \(>= 1\)"):
        resolve([("needs-bar", None)], index, BASE)
    unversioned = _index(_stanza("wants-bar", "1", depends="bar") + _stanza("bar-impl", "1", provides="bar"))
    assert _names(resolve([("wants-bar", None)], unversioned, BASE)) == {"wants-bar": "1", "bar-impl": "1"}


def test_a_virtual_package_with_several_providers_must_be_chosen() -> None:
    index = _index(
        _stanza("mailer", "1", depends="mail-transport-agent")
        + _stanza("postfix", "3", provides="mail-transport-agent", conflicts="mail-transport-agent")
        + _stanza("exim4", "4", provides="mail-transport-agent", conflicts="mail-transport-agent")
    )
    with pytest.raises(LockError, match=r"several packages provide \(exim4, postfix\)") as caught:
        resolve([("mailer", None)], index, BASE)
    assert "list the one you want" in (caught.value.hint or "")
    # Naming one works; its Conflicts with the virtual name it provides itself does not count.
    assert _names(resolve([("postfix", None), ("mailer", None)], index, BASE)) == {
        "postfix": "3",
        "mailer": "1",
    }
    # Two providers that conflict on the virtual name cannot both be installed.
    with pytest.raises(LockError, match=r"exim4 4 .*conflicts with mail-transport-agent"):
        resolve([("postfix", None), ("exim4", None)], index, BASE)


def test_an_alternative_that_conflicts_with_the_selection_is_skipped() -> None:
    index = _index(
        _stanza("gamma", "1")
        + _stanza("x", "1", depends="alpha | beta")
        + _stanza("alpha", "1", conflicts="gamma")
        + _stanza("beta", "1")
    )
    assert _names(resolve([("gamma", None), ("x", None)], index, BASE)) == {
        "gamma": "1",
        "x": "1",
        "beta": "1",
    }


def test_a_versioned_breaks_picks_an_older_version() -> None:
    index = _index(
        _stanza("other", "1", breaks="lib (>= 2)")
        + _stanza("app", "1", depends="lib (>= 1)")
        + _stanza("lib", "2.0")
        + _stanza("lib", "1.5")
    )
    assert _names(resolve([("other", None), ("app", None)], index, BASE)) == {
        "other": "1",
        "app": "1",
        "lib": "1.5",
    }


def test_breaks_against_the_installed_base() -> None:
    base = {**BASE, "oldtool": "2.5"}
    index = _index(_stanza("newlib", "2.0", breaks="oldtool (<< 3)") + _stanza("oldtool", "3.0"))
    with pytest.raises(
        LockError, match=r"newlib 2\.0 breaks oldtool \(<< 3\), and the installed base has oldtool 2\.5"
    ):
        resolve([("newlib", None)], index, base)
    # Pinning the upgrade of the base package resolves it (pinned requests are placed first).
    assert _names(resolve([("newlib", None), ("oldtool", "3.0")], index, base)) == {
        "newlib": "2.0",
        "oldtool": "3.0",
    }


def test_a_package_that_breaks_a_chosen_one_is_refused_in_both_directions() -> None:
    index = _index(_stanza("first", "1") + _stanza("second", "1", breaks="first"))
    with pytest.raises(LockError, match=r"second 1 breaks first, and first 1 is already chosen"):
        resolve([("first", None), ("second", None)], index, BASE)
    with pytest.raises(LockError, match=r"second 1 \(already chosen\) breaks first"):
        resolve([("second", None), ("first", None)], index, BASE)


def test_the_final_selection_is_checked_as_a_whole() -> None:
    """An upgrade chosen for one package must not silently break another's versioned dependency."""
    base = {**BASE, "c": "1.0"}
    index = _index(
        _stanza("a", "1", depends="c (<< 2)") + _stanza("b", "1", depends="c (>= 2)") + _stanza("c", "2.0")
    )
    with pytest.raises(
        LockError, match=r"a 1 depends on c \(<< 2\), which the final selection no longer meets"
    ):
        resolve([("a", None), ("b", None)], index, base)


def test_a_versioned_provides_stands_in_for_a_real_package_that_is_too_old() -> None:
    index = _index(
        _stanza("needs-foo", "1", depends="foo (>= 2)")
        + _stanza("foo", "1.0")
        + _stanza("foo-ng", "3", provides="foo (= 2.5)")
    )
    assert _names(resolve([("needs-foo", None)], index, BASE)) == {"needs-foo": "1", "foo-ng": "3"}
