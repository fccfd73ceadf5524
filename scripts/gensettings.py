"""Regenerate the settings reference from the settings tables (``make settings``).

Writes docs/settings.md and the JSON Schemas editors use (docs/settings-*.schema.json). The
tables are the source (agent.config, server.config, server.ek.config, server.pools,
protocol.policy, imagebuilder.commands.options); these files are never edited by hand.
``--check`` fails when the committed files differ from what the tables generate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DOC = Path("docs/settings.md")
SCHEMAS = {
    "nodeagent": Path("docs/settings-nodeagent.schema.json"),
    "nodeserver": Path("docs/settings-nodeserver.schema.json"),
    "pool-profile": Path("docs/settings-pool-profile.schema.json"),
}

_VALUE_ROWS = (
    (
        "duration",
        "Go syntax (`time.ParseDuration`, as SPIRE and kubeadm write them): numbers with units `ns`, `us`, "
        "`ms`, `s`, `m`, `h`, largest first, no spaces, no sign",
        "`300ms`, `30s`, `1.5h`, `1h30m`, `2h45m10s`, `0`",
    ),
    ("", "a bare whole number is seconds (what older files wrote)", "`90` is `1m30s`"),
    ("", "`d` is 24 hours: an extension Go and SPIRE refuse; write `168h` to be portable", "`7d` is `168h`"),
    ("", "keys whose name ends in `_s` also take a decimal number of seconds", "`retry_initial_s: 0.5`"),
    (
        "size",
        "a whole number of bytes, or with a unit: `KiB`, `MiB`, `GiB`, `TiB` (1024) or `kB`, `MB`, `GB`, "
        "`TB` (1000)",
        "`65536`, `64KiB`, `256MiB`",
    ),
    (
        "boolean",
        "`true` or `false`; where a value is text (the agent's files, kernel parameters, environment, "
        "flags) also `yes`/`no`, `on`/`off`, `1`/`0`",
        "`require_ek_cert: true`",
    ),
    (
        "address",
        "HOST:PORT: a host name or address and a port, IPv6 in brackets",
        "`10.0.0.5:8081`, `[::1]:8081`",
    ),
)
_VALUES = (
    "## Writing values\n\n| type | write | examples |\n|---|---|---|\n"
    + "".join(f"| {kind} | {how} | {examples} |\n" for kind, how, examples in _VALUE_ROWS)
    + """
A negative duration, an empty one, one with spaces and a bare number with a fraction where no unit
is implied (`1.5`: seconds or minutes?) are refused, with the key named. Every text value is
matched whole: a trailing newline is refused like any other stray character.
"""
)

_SCHEMA_NOTE = """\
## JSON Schemas for editors

Generated from the same tables: [nodeagent's files](settings-nodeagent.schema.json),
[nodeserver's file](settings-nodeserver.schema.json) and [pool profiles](settings-pool-profile.schema.json).
With the YAML language server (VS Code, Neovim, Emacs), name the schema on the file's first line,
as a path or the URL where you publish these docs:

```yaml
# yaml-language-server: $schema=../../docs/settings-nodeserver.schema.json
trust_domain: example.org
data_dir: /var/lib/nodeserver
```

The schemas describe each file's shape (keys, types, ranges, choices); the programs check more
when they start (that a directory exists, a CA file parses, a pool's profile is coherent).
"""


def _agent() -> str:
    from agent.config import COMMAND_FLAGS, COMMAND_SETTINGS, TABLE

    used: dict[str, list[str]] = {}
    for command, names in COMMAND_SETTINGS.items():
        for name in names:
            without_flag = COMMAND_FLAGS.get(command, {}).get(name) == ()
            used.setdefault(name, []).append(f"`{command}`" + (" (no flag)" if without_flag else ""))
    read_by = {name: ["read by " + ", ".join(commands)] for name, commands in used.items()}
    return (
        "## nodeagent\n\n"
        "Lowest first, a later source overriding an earlier one key by key: the defaults below,\n"
        "`/etc/nodeagent/config.yaml`, `/etc/nodeagent/config.d/*.yaml` (lexical order), the kernel command\n"
        "line (`nodeagent.<key>=<value>`), the environment (`NODEAGENT_<KEY>`), then the command's flags.\n"
        "`nodeagent run`, `attest` and `check` read every layer; each takes the settings it uses as flags\n"
        "(`check --pool` is the older spelling of `--pool-profile`). In keys, `-` and `_` are the same.\n"
        "The kernel command line is split as the kernel splits it: spaces separate, double quotes group\n"
        '(`nodeagent.bundle="/etc/a b.pem"`), an apostrophe is an ordinary character, and nothing after a\n'
        "bare `--` is read (it is for init). A bare boolean parameter (`nodeagent.require_ek_cert`) is true.\n"
        "Each command's `--config-dir DIR` and `--cmdline FILE` read another folder or command line.\n\n"
        + TABLE.reference(used_by=read_by)
    )


def _server() -> str:
    from protocol.policy import PROFILE, SECTIONS
    from server.config import TABLE
    from server.devid.settings import TABLE as DEVID
    from server.ek.config import TABLE as EK
    from server.pools import CLUSTER, JOIN, POOL

    out = [
        "## nodeserver\n\n"
        "One YAML file (`nodeserver COMMAND -c FILE`, default `/etc/nodeserver/config.yaml`, or\n"
        "`NODESERVER_CONFIG`); relative paths start at the file's folder. Flags of `nodeserver run`\n"
        "override the file's top-level values (relative paths in flags start at the current folder); the\n"
        "sections and the store DSN (it may hold a password, and a command line is readable by every\n"
        "user) come from the file only. Unknown keys, wrong types and values out of range stop the\n"
        "server at start with the key's dotted path and what is expected.\n\n"
        "### Top level\n\n" + TABLE.reference(),
        "### `ek_trust`\n\nWhich TPMs to trust: [ek-trust.md](ek-trust.md). A key set to `null` keeps its default.\n\n"
        + EK.reference(prefix="ek_trust."),
        "### `devid`\n\nThe DevID CA, LDevID enrolment and `tpm_devid` trust: [attestation.md](attestation.md).\n\n"
        + DEVID.reference(prefix="devid."),
        "### `cluster`\n\nRequired with `pools`: [join.md](join.md).\n\n"
        + CLUSTER.reference(prefix="cluster."),
        "### `join`\n\n" + JOIN.reference(prefix="join."),
        "### `pools.<name>`\n\nA pool name is lowercase letters, digits and `-` (a DNS label); define at least one.\n"
        "Give exactly one of `profile` and `profile_file`.\n\n" + POOL.reference(prefix="pools.<name>."),
        "### `token_backend`\n\nValidated by the backend it names: [join-backends.md](join-backends.md).\n",
        "### Pool profiles\n\nIn `pools.<name>.profile`, a `profile_file`, or `nodeagent check --pool-profile`:\n"
        "[gpu-checks.md](gpu-checks.md#pool-profiles). The values are checked further (versions, check names,\n"
        "label keys, taints) when the profile is read.\n\n" + PROFILE.reference(),
    ]
    out.extend(f"#### `{name}`\n\n" + table.reference(prefix=f"{name}.") for name, table in SECTIONS.items())
    return "\n".join(out)


def _builder() -> str:
    from imagebuilder.commands.options import TABLE, used_by

    taken = {name: ["`" + c.strip("`") + "`" for c in commands] for name, commands in used_by().items()}
    return (
        "## imagebuilder\n\n"
        "The options several commands share (each command's own options are in its `--help` and in\n"
        "[building-images.md](building-images.md)).\n\n" + TABLE.reference(used_by=taken)
    )


def render() -> dict[Path, str]:
    """Every generated file, by its path relative to the repository."""
    from agent.config import TABLE as AGENT
    from protocol.policy import PROFILE
    from server.config import json_schema

    doc = "\n".join(
        [
            "# Settings reference\n\n"
            "<!-- Generated by `make settings` (scripts/gensettings.py) from the settings tables; do not edit. -->\n\n"
            "Every setting of `nodeagent`, `nodeserver` and `imagebuilder`, generated from the tables the\n"
            "programs parse, check and document them with; `--help` of each command shows the same text. The\n"
            "columns: the key in the file, its type, its default, where else it may be given (flag, kernel\n"
            "command line, environment variable), and what it does.\n",
            _VALUES,
            _agent(),
            _server(),
            _builder(),
            _SCHEMA_NOTE,
        ]
    )
    schemas = {
        "nodeagent": AGENT.json_schema(
            title="nodeagent configuration (/etc/nodeagent/config.yaml, config.d)"
        ),
        "nodeserver": json_schema(),
        "pool-profile": PROFILE.json_schema(title="nodetrust pool profile"),
    }
    out = {DOC: doc}
    for name, schema in schemas.items():
        out[SCHEMAS[name]] = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The generated files that differ from what is committed under ``root``."""
    return [
        str(path)
        for path, text in render().items()
        if not (root / path).is_file() or (root / path).read_text(encoding="utf-8") != text
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if regeneration would change the files")
    args = parser.parse_args()
    if args.check:
        diffs = stale()
        if diffs:
            print("stale: " + ", ".join(diffs) + "; run `make settings`", file=sys.stderr)
            return 1
        return 0
    for path, text in render().items():
        (ROOT / path).write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
