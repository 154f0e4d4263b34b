"""The operator file's engine half, read the same way by every command.

`ridgefill serve --config FILE` and `ridgefill generate | score | eval | fit | tune --config FILE`
read one TOML schema: [model] (EngineConfig's own settings), a table per nested config
([cache], [scheduler], [speculative], [looped], [fill] with [fill.rows]), and, for `serve`
only, [server] (ServerConfig, in server/config.py; the runtime's commands skip that table).
Sources apply in order, each over the one before: the file, then whatever the caller puts
between (the server's $RIDGEFILL_API_KEY), then the command-line flags. An unknown key or a
value of the wrong type is a ConfigError naming the key and where it came from.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# NOTE: no torch at module level (fill.maps imports it): a bad flag or file must fail in well
# under a second, not after a 4-8 s torch import.
from .config import EngineConfig, FillConfig
from .errors import ConfigError, ModelLoadError
from .fill.settings import (
    FILL_KEYS,
    MODE_OF_ARM,
    FillSettings,
    new_fill_values,
    put_fill_value,
    resolve_fill,
    rows_origin,
)
from .loader.embedded import model_path
from .settings_file import (
    Key,
    add_flags,
    checked_key,
    flatten,
    given_flags,
    nested_tables,
    operator_tables,
    read_toml,
    renamed_keys,
    store,
    table_keys,
)

Schema = dict[str, dict[str, Key]]


def _engine_schema() -> Schema:
    """[model] (EngineConfig's own settings) and a table per nested config of EngineConfig
    ([fill] is the runtime's schema, FILL_KEYS, with its groups and [fill.rows] as dotted keys)."""
    schema = {"model": table_keys(EngineConfig, "engine", nested=False)}
    for name, cls in nested_tables(EngineConfig):
        schema[name] = FILL_KEYS if cls is FillConfig else table_keys(cls, name)
    return schema


# section -> key -> Key (accepted types, the collected table the value goes to, its field)
ENGINE_SCHEMA: Schema = _engine_schema()
_RENAMED = renamed_keys(EngineConfig, "model", nested=False)  # "model.model" -> "model.path"
# the tables a nested config dataclass is collected in: EngineConfig's field name for it
_NESTED = {name: cls for name, cls in nested_tables(EngineConfig) if cls is not FillConfig}


@dataclass
class Gathered:
    """What the sources gave, checked key by key but not yet built into configs: values by the
    table they are collected in ("engine", "cache", ..., "fill", "rows", and any extra table),
    and where each dotted key came from (for errors found once the configs are built)."""

    source: str  # the file, or "command line": named in errors no single key explains
    values: dict[str, dict[str, Any]]
    origin: dict[str, str] = field(default_factory=dict)


def gather(
    path: str | Path | None,
    flags: Mapping[str, Any] | None = None,
    *,
    extra: Schema | None = None,
    skip: Iterable[str] = (),
    between: Iterable[tuple[str, Any, str]] = (),
) -> Gathered:
    """Read the file's keys (its tables in `skip` are left for another reader), then `between`
    ((dotted key, value, source) each), then the flags ({dotted key: value}; None is "not
    given"). `extra`: tables beyond the engine's, collected under their own names."""
    schema = {**ENGINE_SCHEMA, **(extra or {})}
    values = {"engine": {}, **{name: {} for name in _NESTED}, **new_fill_values(), **{t: {} for t in extra or {}}}
    g = Gathered(str(path) if path else "command line", values)
    skipped = set(skip)
    if path:
        for dotted, value in flatten(read_toml(Path(path))):
            if dotted.partition(".")[0] not in skipped:
                _put(g, schema, dotted, value, str(path))
    for dotted, value, source in between:
        _put(g, schema, dotted, value, source)
    for dotted, value in (flags or {}).items():
        if value is not None:
            _put(g, schema, dotted, value, "command line")
    return g


def _put(g: Gathered, schema: Schema, dotted: str, value: Any, source: str) -> None:
    if dotted.partition(".")[0] == "fill":
        put_fill_value(g.values, g.origin, dotted, value, source)  # the runtime's [fill] schema
        return
    store(g.values, g.origin, checked_key(schema, dotted, value, source, _RENAMED), dotted, value, source)


def build_engine(g: Gathered) -> tuple[EngineConfig, FillSettings]:
    """The EngineConfig of what was gathered, the fill resolved (a packaged model's split and
    maps, the shipped rows), and the files it names checked: model, maps, unigram counts."""
    fill_settings, fill = resolve_fill(g.values, g.origin, model=g.values["engine"].get("model"), source=g.source)
    try:
        nested = {name: cls(**g.values[name]) for name, cls in _NESTED.items()}
        engine = EngineConfig(fill=fill, **nested, **g.values["engine"])
    except ValueError as e:
        raise ConfigError(f"{g.source}: {e}") from None
    if fill.enabled and "unigram" in g.values["rows"]:
        _check_unigram_file(fill.rows.unigram, g.origin.get("fill.rows.unigram", rows_origin(g.origin, g.source)))
    if fill.arm == "ridgefill":
        # NOTE: a recipe may have chosen the arm, and the shipped maps need no key at all
        where = g.origin.get("fill.maps") or g.origin.get("fill.mode") or g.origin.get("fill.recipe", g.source)
        _check_maps_header(fill, where)
    _check_model_path(engine.model, g.origin)
    return engine, fill_settings


# -- The runtime's commands ------------------------------------------------------------------------


def add_engine_flags(parser: argparse.ArgumentParser, fill: bool = True) -> None:
    """--config and a flag for every engine setting that declares one, as `serve` has them
    (its [server] flags aside; the [fill] ones only with `fill`); `engine_config_of` reads them back."""
    parser.add_argument(
        "--config",
        default=None,
        help="operator TOML file, the one `serve --config` reads (examples/ridgefill.toml); flags "
        "override it. Its [server] table is serve's and is not read here",
    )
    dests: dict[str, str] = {}
    for cls, table in operator_tables(EngineConfig):
        if fill or table.partition(".")[0] != "fill":
            dests.update(add_flags(parser, cls, table))
    parser.set_defaults(engine_flags=dests)


def engine_config_of(args: argparse.Namespace, more: Mapping[str, Any] | None = None) -> EngineConfig:
    """The EngineConfig of --config and the engine flags; `more` ({dotted key: value}) goes over
    both (a command's own older spellings, e.g. --arm for fill.mode)."""
    flags = {**given_flags(args, args.engine_flags), **{k: v for k, v in (more or {}).items() if v is not None}}
    return build_engine(gather(args.config, flags, skip=("server",)))[0]


def fill_mode_of_arm(arm: str | None) -> str | None:
    """--arm's word (FillConfig.arm: exact, ridgefill, ...) as fill.mode's (off, plain, ...)."""
    return None if arm is None else MODE_OF_ARM.get(arm, arm)


# -- Checks of the files a setting names -----------------------------------------------------------


def _check_model_path(model: str | None, origin: dict[str, str]) -> None:
    """A model path that does not exist is an operator error at startup, not a load failure
    found after the server has started."""
    if model is None:
        return
    try:
        found = model_path(model).exists()
    except ModelLoadError as e:  # a packaged model whose packages are missing or damaged
        raise ConfigError(f"{origin['model.path']}: key 'model.path': {e}") from None
    if not found:
        raise ConfigError(f"{origin['model.path']}: key 'model.path': {model} not found")


def _check_unigram_file(path: str, where: str) -> None:
    """A counts file that does not exist is refused at startup, not when the first request needs it."""
    if not Path(path).is_file():
        raise ConfigError(f"{where}: key 'fill.rows.unigram': counts file {path} not found")


def _check_maps_header(fill: FillConfig, where: str) -> None:
    """Refuse a missing, foreign or other-split map file before the model loads; the model
    itself is checked against the maps when it loads (llm.load_fill_maps)."""
    from safetensors import safe_open

    from .fill.maps import MapMeta  # imports torch: only for mode = "plain"

    path = Path(fill.maps)
    if not path.is_file():
        raise ConfigError(f"{where}: key 'fill.maps': map file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            meta = MapMeta.from_strings(f.metadata() or {}, str(path))
    except ModelLoadError as e:
        raise ConfigError(f"{where}: key 'fill.maps': {e}") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(f"{where}: key 'fill.maps': {path}: unreadable map file ({type(e).__name__}: {e})") from None
    if meta.split != fill.split:
        raise ConfigError(
            f"{where}: key 'fill.maps': {path} holds maps fitted for split {meta.split}, but fill.split is {fill.split}"
        )


def check_device(engine: EngineConfig) -> None:
    """Refuse model.device = cuda[:N] on a machine without that GPU, naming the setting.
    Imports torch, so callers run it after the checks that do not need it."""
    device = engine.device
    if device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"model.device (--device) {device!r}: must be cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"model.device (--device) {device!r}: no CUDA device is available "
            f'(torch.cuda.is_available() is false); use "cpu"'
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(
            f"model.device (--device) {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
