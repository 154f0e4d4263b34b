"""The [fill] settings: one schema for `ridgefill serve --config` and for `--fill-config`
(generate, score), and the maps, exact-row selectors and unigram counts shipped for the
embedded default model, which fill the settings a file leaves out.

The keys (examples/ridgefill.toml documents each): fill.mode, split, tail, maps, placement,
[fill.corrections] (value_rescale, key_rescale, rescale_rows; or `corrections = [names]`) and
[fill.rows] (every RowsConfig field). `put_fill_value` checks one key as it is given (file or
flag); `resolve_fill` turns what was given into the FillConfig, adding the shipped defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import SELECTORS, FillConfig, RowsConfig
from ..errors import ConfigError
from ..settings_file import Key, checked_key, flatten, read_toml, store
from .recipes import apply_recipe

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "maps"
SHIPPED_SPLIT = 15
# The exact-row selection used when the user gives no [fill.rows] table (RowsConfig fields;
# keys left out take RowsConfig's defaults). Read only by `shipped_rows`.
# NOTE: the best point measured on SmolLM2 (benchmarks/rows_tradeoff.md): special + lexical
# rows match exact's needle retrieval (16/42 each) at 1.2% of the prefix and keep the 1.37x
# prefill speedup at 4K; the probe adds no retrieval there and costs 0.2-0.35x of speedup for
# its key-token gain.
SHIPPED_ROWS = {"selectors": ["special", "lexical"]}
NEEDS_COUNTS = ("probe", "protected")  # selectors that read unigram counts (fill.rows.unigram)


# Maps shipped for packaged models (loader/packaged.py), by the model's name: (file stem, the
# split used when none is given). Fitted by scripts/fit_default_maps.py on the embedded model's
# calibration rule; Gemma's are derived from Gemma, so its terms come with them (GEMMA_NOTICE.md).
PACKAGED_MAPS = {"gemma3-270m": ("gemma3-270m", 9)}


def shipped_maps(split: int = SHIPPED_SPLIT, model: str | None = None) -> Path:
    """The maps shipped for the embedded model (model None) or a packaged model by name."""
    stem = "smollm2-135m-instruct" if model is None else PACKAGED_MAPS[model][0]
    return SHIPPED_DIR / f"{stem}.split{split}.safetensors"


def manifest_name(model: str | None = None) -> str:
    return "manifest.json" if model is None else f"{PACKAGED_MAPS[model][0]}.manifest.json"


def shipped_unigram() -> Path:
    """Token counts over the shipped maps' calibration text (scripts/count_unigrams.py)."""
    return SHIPPED_DIR / "smollm2-135m-instruct.unigram.json"


def shipped_rows() -> dict:
    """A fresh copy of SHIPPED_ROWS, safe to modify."""
    return {k: list(v) if isinstance(v, list) else v for k, v in SHIPPED_ROWS.items()}


def needs_counts(selectors: Sequence[str]) -> list[str]:
    return [s for s in NEEDS_COUNTS if s in selectors]


# -- The schema ----------------------------------------------------------------------------------

# Operator names for the prefill: "plain" is RidgeFill with the configured maps; "nofill" and
# "identity" are the paper's ablation arms, accepted for evaluation runs.
FILL_MODES = {"off": "exact", "plain": "ridgefill", "nofill": "nofill", "identity": "identity"}
MODE_OF_ARM = {arm: mode for mode, arm in FILL_MODES.items()}
CORRECTIONS = ("value_rescale", "key_rescale", "terminal_state")  # the boolean corrections a list may name


@dataclass(frozen=True)
class FillSettings:
    """fill.mode, the operator's name for the arm; everything else about the fill is FillConfig."""

    mode: str = "off"

    def __post_init__(self) -> None:
        if self.mode not in FILL_MODES:
            raise ValueError(f"fill.mode must be one of {', '.join(FILL_MODES)}, got {self.mode!r}")

    @property
    def arm(self) -> str:
        return FILL_MODES[self.mode]


# [fill.rows]: every RowsConfig field; tests/server/test_server_fill.py checks none is missing.
_ROWS_KEYS = {
    "selectors": Key((list,), "rows", "selectors", items=str),
    "attention_share": Key((int, float), "rows", "attention_share"),
    "attention_layers": Key((list,), "rows", "attention_layers", items=int),
    "window": Key((int,), "rows", "window"),
    "probe_window": Key((int,), "rows", "probe_window"),
    "budget_factor": Key((int, float), "rows", "budget_factor"),
    "base_attention_share": Key((int, float), "rows", "base_attention_share"),
    "protected_share": Key((int, float), "rows", "protected_share"),
    "lexical_cap": Key((int, float), "rows", "lexical_cap"),
    "lexical_sentence_rows": Key((int,), "rows", "lexical_sentence_rows"),
    "unigram": Key((str,), "rows", "unigram"),
    "control": Key((str,), "rows", "control"),
    "seed": Key((int,), "rows", "seed"),
}

# Keys inside [fill] (nested tables dotted). Target "fill" collects FillConfig fields plus "mode"
# (FillSettings); "rows" collects RowsConfig fields.
FILL_KEYS: dict[str, Key] = {
    "mode": Key((str,), "fill", "mode"),
    "recipe": Key((str,), "fill", "recipe"),  # fill/recipes.py: the seed's deployments as presets
    "split": Key((int,), "fill", "split"),
    "tail": Key((int,), "fill", "tail"),
    "maps": Key((str,), "fill", "maps"),
    "placement": Key((str,), "fill", "placement"),
    "reuse_filled": Key((str,), "fill", "reuse_filled"),  # what a filled request takes from the prefix cache
    # `corrections = ["value_rescale"]` (a list of names to switch on) or a table:
    "corrections": Key((list,), "fill", "corrections", want="list or table"),
    "corrections.value_rescale": Key((bool,), "fill", "value_rescale"),
    "corrections.key_rescale": Key((bool,), "fill", "key_rescale"),
    "corrections.rescale_rows": Key((int,), "fill", "rescale_rows"),
    "corrections.terminal_state": Key((bool,), "fill", "terminal_state"),
    **{f"rows.{name}": key for name, key in _ROWS_KEYS.items()},
}
_FILL_SCHEMA = {"fill": FILL_KEYS}

# Spellings --fill-config once took (FillConfig's field names); named in the unknown-key error.
_RENAMED = {
    "fill.arm": "fill.mode: off, plain, nofill or identity",
    "fill.value_rescale": "fill.corrections.value_rescale",
    "fill.key_rescale": "fill.corrections.key_rescale",
    "fill.rescale_rows": "fill.corrections.rescale_rows",
}


def new_fill_values() -> dict[str, dict[str, Any]]:
    """Where put_fill_value collects: "fill" (FillConfig fields and mode) and "rows"."""
    return {"fill": {}, "rows": {}}


def put_fill_value(
    values: dict[str, dict[str, Any]], origin: dict[str, str], dotted: str, value: Any, source: str
) -> None:
    """Check one [fill] key ("fill.split", "fill.rows.window", ...) and collect its value;
    `origin` records where each came from, for errors found later. Raises ConfigError."""
    if dotted in _RENAMED:
        raise ConfigError(f"{source}: unknown key '{dotted}' (use {_RENAMED[dotted]})")
    spec = checked_key(_FILL_SCHEMA, dotted, value, source)
    if dotted == "fill.rows.selectors":
        for item in value:
            if item not in SELECTORS:
                raise ConfigError(
                    f"{source}: key 'fill.rows.selectors': unknown selector {item!r} (known: {', '.join(SELECTORS)})"
                )
    if dotted == "fill.corrections":
        for item in value:
            if item not in CORRECTIONS:
                raise ConfigError(
                    f"{source}: key 'fill.corrections': unknown correction {item!r} "
                    f"(known: {', '.join(CORRECTIONS)}; rescale_rows needs the table form)"
                )
            values["fill"][item] = True
            origin[f"fill.{item}"] = source
        return
    store(values, origin, spec, dotted, value, source)


# -- From what was given to a FillConfig -----------------------------------------------------------


def resolve_fill(
    values: dict[str, dict[str, Any]], origin: dict[str, str], *, model: str | None, source: str
) -> tuple[FillSettings, FillConfig]:
    """The mode and FillConfig of the collected values. `model` None is the embedded default
    model: only it gets the shipped maps and unigram counts when none are given. `source` names
    the file (or "command line") in errors no single key explains."""
    given = dict(values["fill"])
    recipe = given.pop("recipe", None)
    if recipe is not None:
        try:
            given, rows_given = apply_recipe(recipe, given, values["rows"])
        except ValueError as e:
            raise ConfigError(f"{origin['fill.recipe']}: key 'fill.recipe': {e}") from None
        values = {**values, "rows": rows_given}
        origin = {"fill.mode": origin["fill.recipe"], **origin}
    try:
        settings = FillSettings(given.pop("mode", "off"))
    except ValueError as e:
        raise ConfigError(f"{origin['fill.mode']}: {e}") from None
    if settings.arm == "ridgefill":
        if model in PACKAGED_MAPS and "split" not in given:
            given["split"] = PACKAGED_MAPS[model][1]
        given["maps"] = _maps_path(model, given, origin)
    rows = _rows(model, settings, values["rows"], origin, source)
    try:
        return settings, FillConfig(arm=settings.arm, rows=rows, **given)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _maps_path(model: str | None, given: dict, origin: dict[str, str]) -> str:
    """The map file for mode = "plain": the configured one, else the maps shipped for the
    embedded default model (they fit no other model, so a model path needs its own maps)."""
    if given.get("maps"):
        return given["maps"]
    if model in PACKAGED_MAPS:
        return str(shipped_maps(given.get("split", FillConfig().split), model))
    if model is not None:
        raise ConfigError(
            f"{origin['fill.mode']}: key 'fill.maps' is required when fill.mode = \"plain\" "
            f"and model.path is set (the shipped maps fit only the embedded default model)"
        )
    return str(shipped_maps(given.get("split", FillConfig().split)))


def rows_origin(origin: dict[str, str], source: str) -> str:
    """Where the [fill.rows] settings came from (the first key given), for errors about them."""
    return next((origin[k] for k in origin if k.startswith("fill.rows.")), origin.get("fill.mode", source))


def _rows(
    model: str | None, settings: FillSettings, given: dict[str, Any], origin: dict[str, str], source: str
) -> RowsConfig:
    """The exact-row selection: the [fill.rows] keys given (others take RowsConfig's defaults),
    else SHIPPED_ROWS when the fill is on. With the fill on and no fill.rows.unigram, the
    embedded default model gets the shipped counts; another model must name its own when a
    selector reads them."""
    fill_on = settings.arm != "exact"
    rows = dict(given) if given else (shipped_rows() if fill_on else {})
    where = rows_origin(origin, source)
    try:
        config = RowsConfig(**rows)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not fill_on or config.unigram is not None:
        return config
    if model is None:
        return config.replace(unigram=str(shipped_unigram()))
    wanted = needs_counts(config.selectors)
    if wanted:
        raise ConfigError(
            f"{where}: key 'fill.rows.unigram' is required when fill.rows.selectors include "
            f"{' or '.join(wanted)} and model.path is set (the shipped counts fit only the embedded "
            f"default model; or choose selectors without {' or '.join(NEEDS_COUNTS)})"
        )
    return config


# -- --fill-config (generate, score) ---------------------------------------------------------------


def fill_for_arm(
    arm: str | None, config_file: Path | None, *, model: str | None = None, selectors: Sequence[str] | None = None
) -> FillConfig:
    """The FillConfig of `--fill-config`'s [fill] table (the keys of the server's [fill]; the
    file's other tables are not read), with `arm` (--arm, when given) replacing fill.mode and
    `selectors` (--selectors) replacing fill.rows.selectors. `model` None is the embedded
    default model (see resolve_fill)."""
    values, origin = new_fill_values(), {}
    if config_file is not None:
        for dotted, value in flatten(read_toml(config_file)):
            if dotted.partition(".")[0] == "fill":
                put_fill_value(values, origin, dotted, value, str(config_file))
    if arm is not None:
        put_fill_value(values, origin, "fill.mode", MODE_OF_ARM.get(arm, arm), "command line")
    if selectors is not None:
        put_fill_value(values, origin, "fill.rows.selectors", list(selectors), "command line")
    source = str(config_file) if config_file is not None else "command line"
    return resolve_fill(values, origin, model=model, source=source)[1]
