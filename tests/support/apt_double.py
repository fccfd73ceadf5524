"""APT/DPKG TEST DOUBLE: ``dpkg-query``, ``apt-get``, ``apt-mark`` and ``kubelet`` over a package database file.

The agent's Kubernetes version switch (agent.kubeversion) installs staged debs with apt and holds them.
On a development machine the real apt would change the test host's own packages, so the fast tests
put these executables first on PATH instead; the real apt and dpkg do it in the VM tier (the demo's
node installs its staged version in the booted image). ``dpkg-deb`` stays the real one: the staged
debs are real packages built with it.

The database is JSON: ``{"packages": {name: {"version": ..., "held": bool}}, "fail_simulate": false,
"calls": [[argv...], ...]}``. What each double does:

* ``dpkg-query -W -f=${Version}\\t${Status} PKG``: ``<version>\\t<hold|install> ok installed``, or exit 1;
* ``apt-mark hold|unhold PKG...``: sets ``held``;
* ``apt-get ... --simulate install DEB...``: exit 100 when ``fail_simulate``, else 0, nothing changed;
* ``apt-get ... install -y ... DEB...``: for each DEB (read with the real ``dpkg-deb --field``) installs
  its Package at its Version; refused (exit 100, nothing changed) if one of them is held and
  ``--allow-change-held-packages`` is missing, or a downgrade without ``--allow-downgrades``; with
  ``--no-download``, refused as the real apt 2.6 refuses it ("Pathname to install is not absolute");
* ``kubelet --version``: ``Kubernetes v<upstream version of the installed kubelet>``.

Every call is appended to ``calls``. Install with :func:`install_apt_double`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOLS = ("dpkg-query", "apt-get", "apt-mark", "kubelet")


def install_apt_double(bin_dir: Path, db: Path, packages: dict[str, str], *, held: bool = True) -> Path:
    """Executables in ``bin_dir`` over ``db``, which starts with ``packages`` (name -> Debian version)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    db.write_text(json.dumps({"packages": {n: {"version": v, "held": held} for n, v in packages.items()},
                              "fail_simulate": False, "calls": []}))  # fmt: skip
    for tool in TOOLS:
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {db} {tool} "$@"\n')
        script.chmod(0o755)
    return bin_dir


def load(db: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(db.read_text())
    return data


def _fields(deb: str) -> dict[str, str]:
    out = subprocess.run(["dpkg-deb", "--field", deb, "Package", "Version"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return dict(line.partition(": ")[::2] for line in out.splitlines() if ": " in line)


def _older(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "lt", b], check=False).returncode == 0


def main(argv: list[str]) -> int:
    db, tool, args = Path(argv[0]), argv[1], argv[2:]
    data = load(db)
    data["calls"].append([tool, *args])
    pkgs: dict[str, dict[str, Any]] = data["packages"]
    rc = 0
    if tool == "dpkg-query":
        name = args[-1]
        if name in pkgs:
            state = "hold" if pkgs[name]["held"] else "install"
            sys.stdout.write(f"{pkgs[name]['version']}\t{state} ok installed")
        else:
            sys.stderr.write(f"dpkg-query: no packages found matching {name}\n")
            rc = 1
    elif tool == "apt-mark":
        for name in args[1:]:
            if name in pkgs:
                pkgs[name]["held"] = args[0] == "hold"
    elif tool == "apt-get":
        debs = [a for a in args if a.endswith(".deb")]
        if "--simulate" in args:
            rc = 100 if data["fail_simulate"] else 0
            if rc:
                sys.stderr.write("E: Unmet dependencies (apt double: fail_simulate)\n")
        elif "--no-download" in args and debs:
            # what apt 2.6 does (seen in the booted fixture image): no local .deb is installed with it
            sys.stderr.write(
                f"E: Internal Error, Pathname to install is not absolute '{Path(debs[0]).name}'\n"
            )
            rc = 100
        else:
            wanted = {f["Package"]: f["Version"] for f in map(_fields, debs)}
            for name, version in wanted.items():
                old = pkgs.get(name)
                if old and old["held"] and "--allow-change-held-packages" not in args:
                    sys.stderr.write(f"E: Held packages were changed: {name}\n")
                    rc = 100
                if old and _older(version, old["version"]) and "--allow-downgrades" not in args:
                    sys.stderr.write(f"E: Packages were downgraded: {name}\n")
                    rc = 100
            if rc == 0:
                for name, version in wanted.items():
                    pkgs[name] = {"version": version, "held": bool(pkgs.get(name, {}).get("held"))}
    elif tool == "kubelet":
        version = pkgs.get("kubelet", {}).get("version", "")
        if args == ["--version"] and version:
            print(f"Kubernetes v{version.split('-')[0]}")
        else:
            rc = 1
    db.write_text(json.dumps(data))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
