"""Typed TOML settings: read a file, flatten it to dotted keys, check each value against a schema.

The server's operator file (server/config.py) and `--fill-config` (fill/settings.py) both read
through here, so a key is spelled, typed and refused the same way wherever it is given. Errors
name the key and where its value came from: a file path, "command line" or "$ENV".
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Key:
    """One settings key: the TOML value types it accepts and the dataclass field it fills."""

    types: tuple[type, ...]
    target: str  # which collected table the value goes to ("fill", "rows", "server", ...)
    name: str  # the field name there
    items: type | None = None  # list keys: the type every element must have
    want: str | None = None  # how a type error words what is accepted (default: from types)

    def __post_init__(self) -> None:
        if self.items is not None and list not in self.types:
            raise ValueError(f"settings key {self.target}.{self.name}: item type given for a non-list key")


# section -> key inside the section (dotted for nested tables: "rows.window") -> Key
Schema = Mapping[str, Mapping[str, Key]]


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


def checked_key(schema: Schema, dotted: str, value: Any, source: str) -> Key:
    """The Key of `dotted` ("section.key"), once `value` has a type it accepts."""
    section, _, key = dotted.partition(".")
    spec = schema.get(section, {}).get(key)
    if spec is None:
        if any(known.startswith(key + ".") for known in schema.get(section, {})):
            raise ConfigError(f"{source}: key '{dotted}' must be a table ([{dotted}]), got {type(value).__name__}")
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
    """Put a checked value where its Key says (ints widened to float for float keys)."""
    values[spec.target][spec.name] = float(value) if float in spec.types else value
    origin[dotted] = source
