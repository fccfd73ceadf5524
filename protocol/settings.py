"""Settings tables: one record per setting, from which every parser, loader, check and doc is built.

Each program (``nodeagent``, ``nodeserver``, ``imagebuilder``) and each configuration section
(``ek_trust``, ``join``, ``cluster``, ``pools.<name>``, a pool profile) describes its settings once,
as a :class:`Table` of :class:`Setting` records, after mkosi's ``ConfigSetting``. A setting names
its attribute, its :class:`Kind` (the value type with its parser, range and JSON Schema), its
default, its help, and where it may be given: the file key, the command-line flag, the kernel
command-line key and the environment variable. From the table come:

* :meth:`Table.parse`: validation of a decoded YAML/JSON mapping, strictly (unknown keys, wrong
  types and values out of range are a :class:`SettingError` that names the dotted key path, what is
  expected and what was found) or leniently (text such as ``"yes"`` or ``"30"`` where a boolean or a
  number is expected: the agent's files, which share their syntax with the kernel command line);
* :meth:`Table.parse_text`: one value given as text (flag, environment, kernel command line);
* :meth:`Table.add_arguments` / :meth:`Table.given`: argparse options for the settings a command uses;
* :meth:`Table.json_schema`: a JSON Schema (draft 2020-12) for editors; the tests check that the
  ``jsonschema`` library accepts and refuses what :meth:`Table.parse` does;
* :meth:`Table.reference`: the rows of the reference in docs/settings.md.

This is the one validation approach of every configuration file in the project ("typed models"):
the table is the model, and the JSON Schema is generated from it, never written by hand. The value
kinds (``text``, ``duration``, ``size``, ...) live in :mod:`protocol.value_kinds` and are
re-exported here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from protocol.value_kinds import (
    MAX_TEXT,
    Ctx,
    Kind,
    Problem,
    SettingError,
    address,
    boolean,
    bounded_text,
    choice,
    dotted,
    duration,
    integer,
    list_of,
    mapping_of,
    number,
    optional,
    path,
    quote_value,
    raw,
    section,
    size,
    text,
)

__all__ = [
    "MAX_TEXT",
    "Ctx",
    "Kind",
    "Problem",
    "Setting",
    "SettingError",
    "Table",
    "address",
    "boolean",
    "choice",
    "dotted",
    "duration",
    "integer",
    "list_of",
    "mapping_of",
    "number",
    "optional",
    "path",
    "raw",
    "section",
    "size",
    "text",
]

# --------------------------------------------------------------------------- settings and tables


@dataclass(frozen=True)
class Setting:
    """One setting.

    ``name`` is the attribute of the program's configuration object; ``key`` the file key (default:
    ``name``); ``flag`` the long option (``""``: derived, ``--state-dir``; ``None``: none) and
    ``flag_aliases`` older spellings; ``cmdline`` the kernel command-line key and ``env`` the
    environment variable (``""``: derived from the table's prefixes; ``None``: none); ``aliases``
    older file keys, still read; ``secret``: never printed, never a flag (``/proc/PID/cmdline`` is
    world-readable); ``default_text`` describes a default computed at run time; ``check`` returns
    the problem of a parsed value, or None.
    """

    name: str
    kind: Kind
    help: str
    default: Any = None
    required: bool = False
    key: str = ""
    flag: str | None = ""
    flag_aliases: tuple[str, ...] = ()
    cmdline: str | None = ""
    env: str | None = ""
    aliases: tuple[str, ...] = ()
    secret: bool = False
    default_text: str = ""
    check: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)

    @property
    def default_shown(self) -> str:
        if self.default_text:
            return self.default_text
        if self.required:
            return "(required)"
        return self.kind.show(self.default)


@dataclass(frozen=True)
class Table:
    """The settings of one program or one section, in their documentation order.

    ``title`` names it in docs; ``env_prefix`` (``NODEAGENT_``) and ``cmdline_prefix``
    (``nodeagent.``) derive each setting's environment variable and kernel key; ``flags`` derives
    flags; ``lenient`` lets files use text for other types (the agent's files share their values
    with the kernel command line and the environment).
    """

    title: str
    settings: tuple[Setting, ...]
    env_prefix: str = ""
    cmdline_prefix: str = ""
    flags: bool = True
    lenient: bool = False
    by_name: Mapping[str, Setting] = field(init=False, repr=False, compare=False)
    by_key: Mapping[str, Setting] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resolved = []
        for s in self.settings:
            changes: dict[str, Any] = {}
            if s.flag == "":
                changes["flag"] = "--" + s.key.replace("_", "-") if self.flags and not s.secret else None
            if s.env == "":
                changes["env"] = self.env_prefix + s.key.upper() if self.env_prefix else None
            if s.cmdline == "":
                changes["cmdline"] = self.cmdline_prefix + s.key if self.cmdline_prefix else None
            resolved.append(replace(s, **changes) if changes else s)
        object.__setattr__(self, "settings", tuple(resolved))
        by_key: dict[str, Setting] = {}
        for s in self.settings:
            for key in (s.key, *s.aliases):
                if key in by_key:
                    raise ValueError(f"{self.title}: key {key} defined twice")
                by_key[key] = s
        object.__setattr__(self, "by_key", by_key)
        object.__setattr__(self, "by_name", {s.name: s for s in self.settings})

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.settings)

    @property
    def expected(self) -> str:
        return "a mapping with keys " + ", ".join(self.keys)

    def defaults(self) -> dict[str, Any]:
        return {s.name: s.default for s in self.settings if not s.required}

    def parse(self, doc: Any, ctx: Ctx | None = None, *, partial: bool = False) -> dict[str, Any]:
        """Validate a decoded mapping; ``{name: value}`` for the keys given (and, unless
        ``partial``, the defaults of the others). Raises :class:`SettingError`."""
        ctx = ctx or Ctx(lenient=self.lenient)
        if not isinstance(doc, Mapping):
            raise ctx.type_error(self.expected, doc)
        values: dict[str, Any] = {}
        for key, value in doc.items():
            if not isinstance(key, str):
                raise ctx.value_error(f"keys must be strings, got {type(key).__name__} {quote_value(key)}")
            setting = self.by_key.get(key)
            if setting is None:
                raise SettingError((*ctx.path, key), Problem.UNKNOWN_KEY, allowed=self.keys)
            if setting.name in values:
                raise ctx.at(key).value_error(f"given twice (also as {setting.key})")
            values[setting.name] = self.parse_value(setting, value, ctx.at(key))
        if not partial:
            for s in self.settings:
                if s.name in values:
                    continue
                if s.required:
                    raise SettingError((*ctx.path, s.key), Problem.MISSING, detail=s.help)
                values[s.name] = s.default
        return values

    def parse_value(self, setting: Setting, value: Any, ctx: Ctx) -> Any:
        result = setting.kind.parse(value, ctx)
        if setting.check is not None and result is not None:
            problem = setting.check(result)
            if problem:
                raise ctx.value_error(problem)
        return result

    def parse_text(self, name: str, value: str, where: str, *, base_dir: Path | None = None) -> Any:
        """One value given as text (a flag, an environment variable, a kernel parameter)."""
        setting = self.by_name[name]
        return self.parse_value(setting, bounded_text(value, Ctx((where,))), Ctx((where,), True, base_dir))

    # ------------------------------------------------------------------ JSON Schema

    def json_schema(self, *, lenient: bool | None = None, title: str = "") -> dict[str, Any]:
        lenient = self.lenient if lenient is None else lenient
        properties: dict[str, Any] = {}
        for s in self.settings:
            schema = dict(s.kind.schema)
            if lenient and s.kind.text_schema is not None:
                schema = {"anyOf": [schema, dict(s.kind.text_schema)]}
            schema["description"] = s.help
            for key in (s.key, *s.aliases):
                properties[key] = {**schema, **({"deprecated": True} if key != s.key else {})}
        out: dict[str, Any] = {
            "type": "object",
            "properties": properties,
            "additionalProperties": False,
        }
        required = [s.key for s in self.settings if s.required]
        if required:
            out["required"] = required
        if title:
            out = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **out}
        return out

    # ------------------------------------------------------------------ argparse

    def add_arguments(
        self,
        parser: argparse.ArgumentParser | Any,
        names: Iterable[str] | None = None,
        *,
        flags: Mapping[str, Sequence[str]] | None = None,
        typed: bool = False,
    ) -> None:
        """One option per setting in ``names`` (default: every setting with a flag).

        Untyped (layered configuration): every option defaults to None and keeps its text, which
        :meth:`given` returns for the loader to parse with the other sources. ``typed``: argparse
        parses with the kind and the default is the setting's (for programs without layers).
        ``flags`` replaces the option strings of some settings (``{"pool_profile": ["--pool"]}``).
        """
        chosen = [self.by_name[n] for n in names] if names is not None else list(self.settings)
        for s in chosen:
            strings = (
                list(flags[s.name])
                if flags and s.name in flags
                else [f for f in (s.flag, *s.flag_aliases) if f]
            )
            if not strings:
                continue
            where = strings[0]
            help_text = s.help + _origins(s, where)
            kwargs: dict[str, Any] = {"dest": s.name, "help": help_text}
            if s.kind.name == "boolean":
                kwargs["action"] = argparse.BooleanOptionalAction
                kwargs["default"] = s.default if typed else None
                parser.add_argument(*strings, **kwargs)
                continue
            kwargs["metavar"] = s.kind.metavar
            if typed:
                kwargs["default"] = s.default
                kwargs["type"] = _argparse_type(self, s, where)
            else:
                kwargs["default"] = None
            parser.add_argument(*strings, **kwargs)

    def given(self, args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The settings whose options were given (untyped options: their text)."""
        chosen = names if names is not None else [s.name for s in self.settings]
        return {n: getattr(args, n) for n in chosen if getattr(args, n, None) is not None}

    # ------------------------------------------------------------------ docs

    def reference(self, *, prefix: str = "", used_by: Mapping[str, Sequence[str]] | None = None) -> str:
        """A Markdown table: key, type, default, where else it may be given, and help."""
        lines = ["| key | type | default | also as | meaning |", "|---|---|---|---|---|"]
        for s in self.settings:
            key = f"`{prefix}{s.key}`"
            if s.aliases:
                key += " (older: " + ", ".join(f"`{prefix}{a}`" for a in s.aliases) + ")"
            also = [f"`{f}`" for f in (s.flag, *s.flag_aliases) if f]
            if s.cmdline:
                also.append(f"`{s.cmdline}=`")
            if s.env:
                also.append(f"`{s.env}`")
            meaning = s.help.replace("|", "\\|")
            if used_by and s.name in used_by:
                meaning += " (" + ", ".join(used_by[s.name]) + ")"
            if s.secret:
                meaning += "; secret: never printed, no flag"
            if s.required:
                default = "required"
            elif s.default_text:
                default = s.default_text.replace("|", "\\|")
            else:
                shown = s.kind.show(s.default).replace("|", "\\|")
                default = f"`{shown}`" if shown else ""
            lines.append(f"| {key} | {_type_words(s.kind)} | {default} | {' '.join(also)} | {meaning} |")
        return "\n".join(lines) + "\n"


def _type_words(kind: Kind) -> str:
    if kind.choices:
        return " \\| ".join(f"`{c}`" for c in kind.choices)
    return kind.name


def _origins(s: Setting, flag: str) -> str:
    extra = []
    default = s.default_shown
    if s.required:
        extra.append("required")
    elif default:
        extra.append(f"default {default}")
    if s.env:
        extra.append(f"env {s.env}")
    if s.cmdline:
        extra.append(f"kernel {s.cmdline}=")
    return f" ({'; '.join(extra)})" if extra else ""


def _argparse_type(table: Table, s: Setting, where: str) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        try:
            return table.parse_text(s.name, value, where)
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{where}: ")) from None

    convert.__name__ = s.kind.name  # argparse names the type in its message
    return convert
