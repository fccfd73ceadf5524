"""The boot environment's PyPI wheel (blake3): pinned by the lock, checked against the target, unpacked safely.

``lock()`` runs with Debian's index and pip's report replaced by what they would say (no network); the
wheel it pins is served by the real digest-addressed cache. The tag check takes the file names PyPI gives
blake3 1.0.11's wheels; the extraction takes wheels written here with the member a hostile index would plant.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest

from imagebuilder import aptindex, wheelhouse
from imagebuilder.bootenv import build, lock, recipe
from imagebuilder.cache import Cache
from imagebuilder.definition import AptRepository
from imagebuilder.errors import BuildError, LockError
from imagebuilder.wheelhouse import ReportItem

BLAKE3 = "blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
PYPI = "https://files.pythonhosted.org/packages/4b/ff/2c51/"


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


BLAKE3_MEMBERS = {
    "blake3/__init__.py": b"from .blake3 import *\n",
    "blake3/blake3.cpython-311-x86_64-linux-gnu.so": b"\x7fELF",
    "blake3-1.0.11.dist-info/METADATA": b"Name: blake3\nVersion: 1.0.11\n",
    "blake3-1.0.11.dist-info/RECORD": b"",
}


def _deb(name: str, version: str) -> aptindex.PackageEntry:
    return aptindex.PackageEntry(
        name, version, "amd64", f"https://deb.example/{name}.deb", 1, "0" * 64, "debian"
    )


DEBS = [
    _deb("libc6", "2.36-9+deb12u14"),
    _deb("python3.11", "3.11.2-6+deb12u8"),
    _deb("busybox-static", "1:1.35"),
]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Debian's index and pip's report as they would answer; ``state`` says what they answer."""
    keyring = tmp_path / "keyring.gpg"
    keyring.write_bytes(b"keys")
    state: dict[str, Any] = {"debs": DEBS, "report": None}
    monkeypatch.setattr(recipe, "apt_source", lambda: AptRepository("debian", "https://deb.example", keyring,
                                                                    suite="bookworm"))  # fmt: skip
    monkeypatch.setattr(aptindex, "load_index", lambda *_a: [])
    monkeypatch.setattr(
        aptindex, "resolve", lambda *_a: aptindex.Resolution(selected={d.name: d for d in state["debs"]})
    )

    def report(requirements: list[str], target: Any, architecture: str, **kw: Any) -> list[ReportItem]:
        assert requirements == list(recipe.WHEELS) and target == recipe.TARGET and architecture == "amd64"
        assert kw == {"find_links": [], "no_deps": True}
        assert state["report"] is not None
        return list(state["report"])

    monkeypatch.setattr(wheelhouse, "pip_report", report)
    return state


@pytest.fixture
def cache(tmp_path: Path) -> tuple[Cache, str, int]:
    """A cache holding a blake3-shaped wheel, as if fetched before: (cache, its sha256, its size)."""
    store = Cache(tmp_path / "cache")
    entry = store.put(_wheel(tmp_path / BLAKE3, BLAKE3_MEMBERS))
    return store, entry.sha256, entry.size


def _item(sha256: str, **changes: Any) -> ReportItem:
    fields: dict[str, Any] = {"name": "blake3", "version": "1.0.11", "url": PYPI + BLAKE3, "sha256": sha256,
                              "filename": BLAKE3, "requested": True, **changes}  # fmt: skip
    return ReportItem(**fields)


def test_the_lock_pins_the_wheel_and_load_returns_it(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int]
) -> None:
    store, sha256, size = cache
    offline["report"] = [_item(sha256)]
    path = tmp_path / "bootenv.lock.json"
    locked = lock.lock(store, path)
    wheel = lock.PinnedWheel("blake3", "1.0.11", PYPI + BLAKE3, sha256, size, BLAKE3)
    assert locked.wheels == (wheel,)
    document = json.loads(path.read_text())
    assert document["requested_wheels"] == ["blake3==1.0.11"]
    assert document["target"] == {"python": "3.11", "glibc": "2.36"}
    assert lock.load(path) == locked
    assert [p.name for p in locked.packages] == sorted(d.name for d in DEBS)


def test_load_refuses_a_lock_made_for_other_wheels(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    offline["report"] = [_item(cache[1])]
    path = tmp_path / "bootenv.lock.json"
    lock.lock(cache[0], path)
    monkeypatch.setattr(recipe, "WHEELS", ("blake3==1.0.12",))
    with pytest.raises(LockError, match="made for other packages, wheels or target") as caught:
        lock.load(path)
    assert "imagebuilder bootenv lock" in (caught.value.hint or "")


def test_load_refuses_a_lock_whose_wheel_entry_was_edited(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int]
) -> None:
    offline["report"] = [_item(cache[1])]
    path = tmp_path / "bootenv.lock.json"
    lock.lock(cache[0], path)
    document = json.loads(path.read_text())
    document["wheels"][0]["version"] = "1.0.10"
    path.write_text(json.dumps(document))
    with pytest.raises(LockError, match="not the recipe's pins"):
        lock.load(path)


@pytest.mark.parametrize(
    "changes",
    [{"version": "1.0.12"}, {"name": "blake3-fork"}],
    ids=["another version", "another project"],
)
def test_the_lock_refuses_a_report_that_does_not_match_the_pin(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int], changes: dict[str, str]
) -> None:
    offline["report"] = [_item(cache[1], **changes)]
    with pytest.raises(LockError, match="not the recipe's pins"):
        lock.lock(cache[0], tmp_path / "bootenv.lock.json")
    assert not (tmp_path / "bootenv.lock.json").exists()


def test_the_lock_refuses_a_dependency_it_did_not_ask_for(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int]
) -> None:
    extra = _item(
        "1" * 64,
        name="typing-extensions",
        version="4.12.2",
        filename="typing_extensions-4.12.2-py3-none-any.whl",
    )
    offline["report"] = [_item(cache[1]), extra]
    with pytest.raises(LockError, match="typing-extensions"):
        lock.lock(cache[0], tmp_path / "bootenv.lock.json")


@pytest.mark.parametrize(
    "changes",
    [{"sha256": ""}, {"url": "http://files.pythonhosted.org/" + BLAKE3}, {"url": "file:///tmp/" + BLAKE3}],
    ids=["no sha256", "plain http", "a local file"],
)
def test_the_lock_refuses_a_wheel_without_https_or_sha256(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int], changes: dict[str, Any]
) -> None:
    offline["report"] = [dataclasses.replace(_item(cache[1]), **changes)]
    with pytest.raises(LockError, match="no https URL or no SHA-256") as caught:
        lock.lock(cache[0], tmp_path / "bootenv.lock.json")
    assert "https" in (caught.value.hint or "")


def test_the_recipe_must_pin_one_version(
    tmp_path: Path, offline: dict[str, Any], cache: tuple[Cache, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recipe, "WHEELS", ("blake3>=1",))
    offline["report"] = [_item(cache[1])]
    with pytest.raises(LockError, match="not pinned to one version"):
        lock.lock(cache[0], tmp_path / "bootenv.lock.json")


@pytest.mark.parametrize(
    ("package", "version", "problem"),
    [("libc6", "2.37-12", "libc6 is 2.37-12, not 2.36"), ("python3.11", "3.12.1-1", "python3.11 is 3.12.1-1"),
     ("libc6", None, "libc6 is not among"), ("python3.11", None, "python3.11 is not among")],
)  # fmt: skip
def test_the_lock_refuses_debian_packages_that_disagree_with_the_target(
    tmp_path: Path,
    offline: dict[str, Any],
    cache: tuple[Cache, str, int],
    package: str,
    version: str | None,
    problem: str,
) -> None:
    others = [d for d in DEBS if d.name != package]
    offline["debs"] = others if version is None else [*others, _deb(package, version)]
    offline["report"] = [_item(cache[1])]
    with pytest.raises(LockError, match="disagree with its target") as caught:
        lock.lock(cache[0], tmp_path / "bootenv.lock.json")
    assert problem in caught.value.message


def test_the_target_check_reads_upstream_versions() -> None:
    pinned = [lock.Pinned(d.name, d.version, "amd64", d.url, d.sha256, 1) for d in DEBS]
    lock.check_target(pinned)  # 2.36-9+deb12u14, 3.11.2-6+deb12u8
    lock.check_target(
        [*pinned[:1], lock.Pinned("python3.11", "1:3.11.9-1", "amd64", "https://x", "0" * 64, 1)]
    )
    with pytest.raises(LockError, match=re.escape("python3.11 is 3.110-1, not 3.11")):
        lock.check_target(
            [*pinned[:1], lock.Pinned("python3.11", "3.110-1", "amd64", "https://x", "0" * 64, 1)]
        )


@pytest.mark.parametrize(
    "filename",
    [
        BLAKE3,
        "blake3-1.0.11-cp38-abi3-manylinux_2_28_x86_64.whl",
        "blake3-1.0.11-py3-none-any.whl",
        "blake3-1.0.11-1build-cp311-cp311-manylinux_2_36_x86_64.whl",
    ],
)
def test_the_tag_check_takes_wheels_the_boot_environment_can_load(filename: str) -> None:
    build.check_wheel_tags(filename, recipe.TARGET, recipe.ARCHITECTURE)


@pytest.mark.parametrize(
    "filename",
    [
        "blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "blake3-1.0.11-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
        "blake3-1.0.11-cp311-cp311-musllinux_1_1_x86_64.whl",
        "blake3-1.0.11-cp311-cp311-manylinux_2_39_x86_64.whl",
        "blake3-1.0.11-cp312-abi3-manylinux_2_17_x86_64.whl",
        "blake3-1.0.11-cp311-cp311-linux_x86_64.whl",
        "blake3-1.0.11.tar.gz",
    ],
    ids=["cpython 3.12", "aarch64", "musl", "glibc 2.39", "abi3 from 3.12", "not manylinux", "an sdist"],
)
def test_the_tag_check_refuses_a_wheel_for_another_python_or_platform(filename: str) -> None:
    with pytest.raises(LockError, match=r"does not fit the boot environment|not a wheel file name"):
        build.check_wheel_tags(filename, recipe.TARGET, recipe.ARCHITECTURE)


def test_a_wheel_is_unpacked_into_dist_packages(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    build.install_wheel(_wheel(tmp_path / BLAKE3, BLAKE3_MEMBERS), site)
    assert sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()) == sorted(BLAKE3_MEMBERS)
    assert (site / "blake3/__init__.py").read_bytes() == BLAKE3_MEMBERS["blake3/__init__.py"]


@pytest.mark.parametrize(
    ("member", "error"),
    [
        ("../../etc/cron.d/x", "outside"),
        ("blake3/../../../etc/passwd", "outside"),
        ("/etc/profile.d/x.sh", "outside"),
        ("blake3-1.0.11.data/scripts/b3sum", ".data folder"),
        ("yaml/__init__.py", "would replace"),
    ],
    ids=["dot-dot", "dot-dot inside a package", "absolute", "a .data folder", "a Debian package's file"],
)
def test_the_extraction_refuses_a_member_that_escapes_or_replaces(
    tmp_path: Path, member: str, error: str
) -> None:
    site = tmp_path / "root" / "site"
    (site / "yaml").mkdir(parents=True)
    (site / "yaml/__init__.py").write_bytes(b"debian's")
    wheel = _wheel(tmp_path / BLAKE3, {**BLAKE3_MEMBERS, member: b"planted"})
    with pytest.raises(BuildError, match=error):
        build.install_wheel(wheel, site)
    assert not (site / "blake3").exists(), "nothing is written before every member is checked"
    assert (site / "yaml/__init__.py").read_bytes() == b"debian's"
    assert not (tmp_path / "etc").exists()


def test_the_build_records_the_wheel_it_fetched_from_the_lock(
    tmp_path: Path, cache: tuple[Cache, str, int]
) -> None:
    store, sha256, size = cache
    pinned = lock.PinnedWheel("blake3", "1.0.11", PYPI + BLAKE3, sha256, size, BLAKE3)
    tree = tmp_path / "tree"
    build._wheels([pinned], store, tree)
    assert (tree / build.SITE / "blake3/__init__.py").is_file()
    assert hashlib.sha256(store.entry(sha256).read_bytes()).hexdigest() == sha256
