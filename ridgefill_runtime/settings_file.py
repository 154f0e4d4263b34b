"""Settings declared once: a config dataclass field's `Setting` metadata is its TOML key, its
TOML type (from the field's annotation), its default, its help, its checks and its flag.

`setting(...)` declares a field; from the dataclasses this module derives the TOML schema
(`table_keys`), the command-line flags (`add_flags`) and the generic value checks
(`check_settings`), and reads files (`read_toml`, `flatten`, `checked_key`, `store`). The
operator file (operator_config.py for every command, server/config.py adding [server]) and
fill/settings.py's [fill] read through here, so a key is spelled, typed and refused the same way wherever it is given. Errors
name the key and where its value came from: a file path, "command line" or "$ENV".

NOTE: imports nothing of the runtime but its errors: config.py declares its fields with
`setting`, and nothing here may import torch (a bad flag or file must fail in well under a second).
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

METADATA_KEY = "setting"  # where a field's Setting sits in its dataclasses.field metadata

# Setting.check -> the test; the check's own words are the error message ("must be positive").
CHECKS = {
    "positive": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
}


@dataclass(frozen=True)
class Setting:
    """What one config field declares beyond its name, type and default."""

    help: str  # one line or a paragraph: the flag's help and the example file's comment
    flag: str | None = None  # the command-line option ("--max-num-seqs"); None: the file only
    aliases: tuple[str, ...] = ()  # older spellings of the flag, still accepted (not for bool fields)
    off_alias: str | None = None  # bool fields: an option that sets it false (vLLM's --enforce-eager)
    key: str | None = None  # the TOML key when it is not the field name ("path" for EngineConfig.model)
    table: str | None = None  # a sub-table the key is grouped in ("corrections": [fill.corrections])
    choices: tuple[str, ...] | None = None  # the values it may take (checked, offered to the flag)
    values: Mapping[str, str] | None = None  # the file's and flags' words -> the field's ("plain" -> "ridgefill")
    check: str | None = None  # a CHECKS key, tested on every value but None
    note: str | None = None  # said after the check in its error ("0: no cap")
    example: str | None = None  # TOML text shown, commented out, in the example when the default is None

    def __post_init__(self) -> None:
        if self.check is not None and self.check not in CHECKS:
            raise ValueError(f"setting check {self.check!r} is not one of {', '.join(CHECKS)}")


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **declared) -> Any:
    """A dataclass field with its Setting (`setting(16, help=..., flag="--block-size", check="positive")`)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={METADATA_KEY: Setting(**declared)})


def settings_fields(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """cls's fields that are settings, in declaration order (nested config tables are not)."""
    return [(f, s) for f in dataclasses.fields(cls) if (s := f.metadata.get(METADATA_KEY)) is not None]


def nested_tables(cls) -> list[tuple[str, type]]:
    """cls's fields that hold another config dataclass (EngineConfig.cache, FillConfig.rows)."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]


def check_settings(obj, table: str) -> None:
    """The declared checks of every setting of `obj` (choices, bounds); errors name `table`.field."""
    for f, s in settings_fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if s.choices is not None and value not in s.choices:
            raise ValueError(f"{table}.{f.name} must be one of {', '.join(s.choices)}, got {value!r}")
        if s.check is not None and not CHECKS[s.check](value):
            note = f" ({s.note})" if s.note else ""
            raise ValueError(f"{table}.{f.name} must be {s.check}{note}, got {value}")


# -- The TOML schema --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One settings key: the TOML value types it accepts and the dataclass field it fills."""

    types: tuple[type, ...]
    target: str  # which collected table the value goes to ("fill", "rows", "server", ...)
    name: str  # the field name there
    items: type | None = None  # list keys: the type every element must have
    want: str | None = None  # how a type error words what is accepted (default: from types)
    values: Mapping[str, str] | None = None  # the words the file uses -> the field's values
    switches: tuple[str, ...] = ()  # a group's list form: the bool keys it may name
    table_only: tuple[str, ...] = ()  # ... and the group's keys it may not

    def __post_init__(self) -> None:
        if self.items is not None and list not in self.types:
            raise ValueError(f"settings key {self.target}.{self.name}: item type given for a non-list key")


# section -> key inside the section (dotted for nested tables: "rows.window") -> Key
Schema = Mapping[str, Mapping[str, Key]]


def toml_types(hint: Any) -> tuple[tuple[type, ...], type | None]:
    """(accepted TOML value types, list item type) of a field annotation. None is no TOML value:
    an optional field is given by leaving its key out. A float field takes ints too."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    if len(args) != 1:
        raise TypeError(f"settings field annotation {hint!r}: one TOML type (or it | None) is supported")
    (base,) = args
    if typing.get_origin(base) is tuple:
        return (list,), typing.get_args(base)[0]
    return ((int, float) if base is float else (base,)), None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def key_name(f: dataclasses.Field, s: Setting) -> str:
    """The field's key inside its TOML table ("corrections.value_rescale", "path")."""
    leaf = s.key or f.name
    return f"{s.table}.{leaf}" if s.table else leaf


def table_keys(cls, target: str, *, nested: bool = True) -> dict[str, Key]:
    """Every key of cls's TOML table: its settings, the list form of each group of them, and
    (`nested`) each nested config dataclass as a sub-table ("rows.window"), collected under its
    field name. EngineConfig's nested configs are tables of their own, not sub-tables of [model]."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, Key] = {}
    groups: dict[str, list[tuple[dataclasses.Field, Setting]]] = {}
    for f, s in settings_fields(cls):
        accepted, items = toml_types(hints[f.name])
        keys[key_name(f, s)] = Key(accepted, target, f.name, items=items, values=s.values)
        if s.table:
            groups.setdefault(s.table, []).append((f, s))
    for group, members in groups.items():
        # `corrections = ["value_rescale"]`: the group's bool keys named in a list are switched on
        switches = tuple(key_name(f, s).rpartition(".")[2] for f, s in members if hints[f.name] is bool)
        others = tuple(key_name(f, s).rpartition(".")[2] for f, s in members if hints[f.name] is not bool)
        keys[group] = Key((list,), target, group, want="list or table", switches=switches, table_only=others)
    for name, table in nested_tables(cls) if nested else ():
        keys.update({f"{name}.{k}": key for k, key in table_keys(table, name).items()})
    return keys


def renamed_keys(cls, section: str, *, nested: bool = True) -> dict[str, str]:
    """Field names spelled as keys where the table's key differs ("fill.arm" -> "fill.mode" and
    its words), for the unknown-key error to point at the key that is read."""
    out = {}
    for f, s in settings_fields(cls):
        if key_name(f, s) != f.name:
            words = f": {', '.join(s.values)}" if s.values else ""
            out[f"{section}.{f.name}"] = f"{section}.{key_name(f, s)}{words}"
    for name, table in nested_tables(cls) if nested else ():
        out.update(renamed_keys(table, f"{section}.{name}"))
    return out


def operator_tables(engine_cls, own: str = "model") -> list[tuple[type, str]]:
    """(config dataclass, its TOML table) of the operator file's engine side: the engine's own
    settings in [`own`], each nested config in the table of its field name, and theirs below it
    ([fill], [fill.rows])."""
    tables = [(engine_cls, own)]
    for name, cls in nested_tables(engine_cls):
        tables += _tables_below(cls, name)
    return tables


def _tables_below(cls, section: str) -> list[tuple[type, str]]:
    tables = [(cls, section)]
    for name, nested in nested_tables(cls):
        tables += _tables_below(nested, f"{section}.{name}")
    return tables


def read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: cannot read config: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None


def flatten(doc: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested tables become dotted keys; a top-level scalar stays bare (reported as unknown)."""
    out = []
    for key, body in doc.items():
        dotted = f"{prefix}{key}"
        if isinstance(body, dict):
            out.extend(flatten(body, dotted + "."))
        else:
            out.append((dotted, body))
    return out


def checked_key(schema: Schema, dotted: str, value: Any, source: str, renamed: Mapping[str, str] | None = None) -> Key:
    """The Key of `dotted` ("section.key"), once `value` has a type it accepts. `renamed`:
    spellings that are not keys, named in the error with the key to use instead."""
    section, _, key = dotted.partition(".")
    spec = schema.get(section, {}).get(key)
    if spec is None:
        if any(known.startswith(key + ".") for known in schema.get(section, {})):
            raise ConfigError(f"{source}: key '{dotted}' must be a table ([{dotted}]), got {type(value).__name__}")
        if renamed and dotted in renamed:
            raise ConfigError(f"{source}: unknown key '{dotted}' (use {renamed[dotted]})")
        raise ConfigError(f"{source}: unknown key '{dotted}'")
    # NOTE: bool is an int subclass in Python; `port = true` must still be refused.
    if (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
        raise ConfigError(f"{source}: key '{dotted}' must be {_wanted(spec)}, got {type(value).__name__} {value!r}")
    if spec.items is not None:
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, spec.items)]
        if bad:
            raise ConfigError(
                f"{source}: key '{dotted}' must be a list of {spec.items.__name__}, "
                f"got {type(bad[0]).__name__} {bad[0]!r} in it"
            )
    if spec.values is not None and value not in spec.values:
        raise ConfigError(f"{source}: {dotted} must be one of {', '.join(spec.values)}, got {value!r}")
    return spec


def _wanted(spec: Key) -> str:
    if spec.want is not None:
        return spec.want
    if spec.items is not None:
        return f"a list of {spec.items.__name__}"
    return " or ".join(t.__name__ for t in spec.types)


def store(
    values: dict[str, dict[str, Any]], origin: dict[str, str], spec: Key, dotted: str, value: Any, source: str
) -> None:
    """Put a checked value where its Key says: ints widened to float for float keys, the file's
    word turned into the field's value, a group's list form into its switches. Raises ConfigError."""
    if spec.switches or spec.table_only:
        for item in value:
            if item not in spec.switches:
                raise ConfigError(
                    f"{source}: key '{dotted}': unknown {spec.name.removesuffix('s')} {item!r} "
                    f"(known: {', '.join(spec.switches)}; {', '.join(spec.table_only) or 'the others'} "
                    f"{'needs' if len(spec.table_only) == 1 else 'need'} the table form)"
                )
            values[spec.target][item] = True
            origin[f"{dotted}.{item}"] = source
        return
    if spec.values is not None:
        value = spec.values[value]
    values[spec.target][spec.name] = float(value) if float in spec.types else value
    origin[dotted] = source


# -- Command-line flags -----------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cls, section: str) -> dict[str, str]:
    """A flag for every setting of cls that declares one (its nested configs are tables of
    their own: see operator_tables); returns {argparse dest: dotted TOML key}. Every flag
    defaults to None: not given, the file's or the field's default holds."""
    hints = typing.get_type_hints(cls)
    dests: dict[str, str] = {}
    for f, s in settings_fields(cls):
        if s.flag is None:
            continue
        dest = flag_dest(s)
        dests[dest] = f"{section}.{key_name(f, s)}"
        help_text = s.help.replace("%", "%%")  # NOTE: argparse formats help with %
        if hints[f.name] is bool:
            parser.add_argument(s.flag, dest=dest, action=argparse.BooleanOptionalAction, help=help_text)
            if s.off_alias:
                parser.add_argument(
                    s.off_alias, dest=dest, action="store_const", const=False, help=f"the same as --no-{s.flag[2:]}"
                )
            continue
        accepted, items = toml_types(hints[f.name])
        value = {
            "dest": dest,
            "type": _list_of(items) if items is not None else accepted[-1],
            "choices": list(s.values) if s.values is not None else s.choices,
            "metavar": "A,B" if items is not None else None,
            "default": None,
        }
        parser.add_argument(s.flag, help=help_text, **value)
        # NOTE: an alias is an option of its own, so an error names the spelling given
        for alias in s.aliases:
            parser.add_argument(alias, help=f"the same as {s.flag}", **value)
    return dests


def flag_dest(s: Setting) -> str:
    return s.flag.removeprefix("--").replace("-", "_")


def given_flags(args: argparse.Namespace, dests: Mapping[str, str]) -> dict[str, Any]:
    """{dotted key: value} of the flags given (None: left out)."""
    return {key: getattr(args, dest) for dest, key in dests.items() if getattr(args, dest, None) is not None}


def given_fields(args: argparse.Namespace, cls) -> dict[str, Any]:
    """{field: value} of cls's flags that were given (the runtime's commands build cls from them)."""
    given = {f.name: getattr(args, flag_dest(s), None) for f, s in settings_fields(cls) if s.flag is not None}
    return {name: value for name, value in given.items() if value is not None}


def _list_of(items: type) -> Callable[[str], list]:
    """A flag's comma-separated list ("special, digits") as a list of `items`."""

    def comma_list(text: str) -> list:
        return [items(item.strip()) for item in text.split(",") if item.strip()]

    return comma_list
