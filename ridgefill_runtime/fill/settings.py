"""The [fill] settings: one schema for the operator file's [fill] table, whichever command reads
it (operator_config.py), and for `fill_for_arm` (benchmarks, tests); and the maps, exact-row
selectors and unigram counts shipped for the embedded default model, which fill the settings a
file leaves out.

The keys are FillConfig's, RowsConfig's ([fill.rows]) and FillSettings' fields, declared there
(settings_file.setting; examples/ridgefill.toml, generated from them, documents each).
`put_fill_value` checks one key as it is given (file or flag); `resolve_fill` turns what was
given into the FillConfig, adding the shipped defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import FILL_MODES, SELECTORS, FillConfig, RowsConfig
from ..errors import ConfigError
from ..settings_file import Key, checked_key, flatten, read_toml, renamed_keys, setting, store, table_keys
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
PACKAGED_MAPS = {
    "gemma3-270m": ("gemma3-270m", 9),
    # Fitted on the standard library's top-level modules (code; fill/corpus.py), not the kernel docs.
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b", 12),
    "qwen2.5-coder-1.5b": ("qwen2.5-coder-1.5b", 14),
}
# Other [fill] keys a packaged model sets when the user gives none (e.g. {"tail": 512}); with the
# split above they apply to every arm, so arms compared on one model run at one split and tail.
PACKAGED_FILL: dict[str, dict[str, Any]] = {}


def packaged_fill_defaults(model: str | None) -> dict[str, Any]:
    """The [fill] keys a packaged model sets when they are not given: its split (and tail)."""
    if model not in PACKAGED_MAPS:
        return {}
    return {"split": PACKAGED_MAPS[model][1], **PACKAGED_FILL.get(model, {})}


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

MODE_OF_ARM = {arm: mode for mode, arm in FILL_MODES.items()}


@dataclass(frozen=True)
class FillSettings:
    """The [fill] table beside FillConfig: the recipe key, and the mode the fill resolved to in
    the file's words (FillConfig.arm's fill.mode; what the server reports and logs)."""

    mode: str = "off"
    recipe: str | None = setting(
        None,
        help="presets for the keys left out (seed 000 Table 4): qwen3.8-27b | flash-next | flash-next-quality; "
        "set split and maps for your model",
        example='"flash-next"',
    )


# Keys inside [fill] (nested tables dotted: "corrections.key_rescale", "rows.window"), from the
# fields of FillConfig, its RowsConfig (target "rows") and FillSettings (the recipe).
FILL_TABLES = (FillConfig, FillSettings)
FILL_KEYS: dict[str, Key] = {k: key for cls in FILL_TABLES for k, key in table_keys(cls, "fill").items()}
_FILL_SCHEMA = {"fill": FILL_KEYS}
RENAMED_FILL_KEYS = renamed_keys(FillConfig, "fill")  # "fill.arm" -> "fill.mode", named in the unknown-key error


def new_fill_values() -> dict[str, dict[str, Any]]:
    """Where put_fill_value collects: "fill" (FillConfig and FillSettings fields) and "rows"."""
    return {"fill": {}, "rows": {}}


def put_fill_value(
    values: dict[str, dict[str, Any]], origin: dict[str, str], dotted: str, value: Any, source: str
) -> None:
    """Check one [fill] key ("fill.split", "fill.rows.window", ...) and collect its value;
    `origin` records where each came from, for errors found later. Raises ConfigError."""
    spec = checked_key(_FILL_SCHEMA, dotted, value, source, RENAMED_FILL_KEYS)
    if dotted == "fill.rows.selectors":
        for item in value:
            if item not in SELECTORS:
                raise ConfigError(
                    f"{source}: key 'fill.rows.selectors': unknown selector {item!r} (known: {', '.join(SELECTORS)})"
                )
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
    arm = given.get("arm", FillConfig.arm)
    settings = FillSettings(MODE_OF_ARM[arm], recipe)
    # NOTE: every arm, not only ridgefill: identity or nofill at FillConfig's split 15 against
    # ridgefill at the model's split 9 is an unfair comparison (issue 31, finding 8).
    for key, value in packaged_fill_defaults(model).items():
        given.setdefault(key, value)
    if arm == "ridgefill":
        given["maps"] = _maps_path(model, given, origin)
    rows = _rows(model, arm != "exact", values["rows"], origin, source)
    try:
        return settings, FillConfig(rows=rows, **given)
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


def _rows(model: str | None, fill_on: bool, given: dict[str, Any], origin: dict[str, str], source: str) -> RowsConfig:
    """The exact-row selection: the [fill.rows] keys given (others take RowsConfig's defaults),
    else SHIPPED_ROWS when the fill is on. With the fill on and no fill.rows.unigram, the
    embedded default model gets the shipped counts; another model must name its own when a
    selector reads them."""
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


# -- One [fill] table alone (benchmarks, tests) ---------------------------------------------------------------


def fill_for_arm(
    arm: str | None,
    config_file: Path | None,
    *,
    model: str | None = None,
    selectors: Sequence[str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> FillConfig:
    """The FillConfig of a file's [fill] table (the keys of the operator file's [fill]; the
    file's other tables are not read), under the fill `flags` given ({dotted key: value}, as
    `serve`'s: --fill-mode, --fill-split, ...), with `arm` (--arm, FillConfig's word for
    fill.mode) and `selectors` (--selectors) over those. `model` None is the embedded default
    model (see resolve_fill)."""
    values = new_fill_values()
    origin: dict[str, str] = {}
    if config_file is not None:
        for dotted, value in flatten(read_toml(config_file)):
            if dotted.partition(".")[0] == "fill":
                put_fill_value(values, origin, dotted, value, str(config_file))
    for dotted, value in (flags or {}).items():
        put_fill_value(values, origin, dotted, value, "command line")
    if arm is not None:
        put_fill_value(values, origin, "fill.mode", MODE_OF_ARM.get(arm, arm), "command line")
    if selectors is not None:
        put_fill_value(values, origin, "fill.rows.selectors", list(selectors), "command line")
    source = str(config_file) if config_file is not None else "command line"
    return resolve_fill(values, origin, model=model, source=source)[1]
