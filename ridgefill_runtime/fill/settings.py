"""Where fill settings come from when the user names only an arm: a TOML [fill] table, or the
maps, exact-row selectors and unigram counts shipped for the embedded default model."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path

from ..config import FillConfig, RowsConfig
from ..errors import InputError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "maps"
SHIPPED_SPLIT, SHIPPED_TAIL = 15, 1024
# The exact-row selection used when the user gives no [fill.rows] table (RowsConfig fields;
# keys left out take RowsConfig's defaults). Read only by `shipped_rows`.
# NOTE: the best point measured on SmolLM2 (benchmarks/rows_tradeoff.md): special + lexical
# rows match exact's needle retrieval (16/42 each) at 1.2% of the prefix and keep the 1.37x
# prefill speedup at 4K; the probe adds no retrieval there and costs 0.2-0.35x of speedup for
# its key-token gain.
SHIPPED_ROWS = {"selectors": ["special", "lexical"]}
NEEDS_COUNTS = ("probe", "protected")  # selectors that read unigram counts (fill.rows.unigram)


def shipped_maps(split: int = SHIPPED_SPLIT) -> Path:
    return SHIPPED_DIR / f"smollm2-135m-instruct.split{split}.safetensors"


def shipped_unigram() -> Path:
    """Token counts over the shipped maps' calibration text (scripts/count_unigrams.py)."""
    return SHIPPED_DIR / "smollm2-135m-instruct.unigram.json"


def shipped_rows() -> dict:
    """A fresh copy of SHIPPED_ROWS, safe to modify."""
    return {k: list(v) if isinstance(v, list) else v for k, v in SHIPPED_ROWS.items()}


def fill_from_toml(path: Path) -> dict:
    try:
        table = tomllib.loads(path.read_text()).get("fill", {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"{path}: cannot read fill config ({e})") from None
    known = set(FillConfig.__dataclass_fields__)
    unknown = sorted(set(table) - known)
    if unknown:
        raise InputError(f"{path}: unknown key fill.{unknown[0]} (known: {', '.join(sorted(known))})")
    if "rows" in table:
        table["rows"] = _rows_table(path, table["rows"])
    return table


def _rows_table(path: Path, rows) -> dict:
    if not isinstance(rows, dict):
        raise InputError(f"{path}: fill.rows must be a table ([fill.rows]), got {type(rows).__name__}")
    known = set(RowsConfig.__dataclass_fields__)
    unknown = sorted(set(rows) - known)
    if unknown:
        raise InputError(f"{path}: unknown key fill.rows.{unknown[0]} (known: {', '.join(sorted(known))})")
    for name in ("selectors", "attention_layers"):
        if name in rows and not isinstance(rows[name], list):
            raise InputError(f"{path}: fill.rows.{name} must be a list, got {type(rows[name]).__name__}")
    return rows


def needs_counts(selectors: Sequence[str]) -> list[str]:
    return [s for s in NEEDS_COUNTS if s in selectors]


def fill_for_arm(arm: str, config_file: Path | None, *, model: str | None = None,
                 selectors: Sequence[str] | None = None) -> FillConfig:
    """The FillConfig for `arm`: the file's [fill] table, else the shipped split, tail and maps;
    its [fill.rows] table, else SHIPPED_ROWS. `selectors` (e.g. from --selectors) replaces the
    selectors either gives. `model` None is the embedded default model: only it gets the
    shipped unigram counts when no fill.rows.unigram is given."""
    settings = {"split": SHIPPED_SPLIT, "tail": SHIPPED_TAIL}
    if config_file is not None:
        settings.update(fill_from_toml(config_file))
    settings["arm"] = arm
    if arm == "ridgefill" and not settings.get("maps"):
        settings["maps"] = str(shipped_maps(settings["split"]))
    rows = dict(settings["rows"]) if "rows" in settings else shipped_rows()
    if selectors is not None:
        rows["selectors"] = list(selectors)
    wanted = needs_counts(rows.get("selectors", RowsConfig().selectors))
    if arm != "exact" and not rows.get("unigram"):
        if model is None:
            rows["unigram"] = str(shipped_unigram())
        elif wanted:
            raise InputError(
                f"fill.rows.unigram is required for the {' and '.join(wanted)} "
                f"selector with --model (the shipped counts fit only the embedded default model): "
                f"give it in a --fill-config [fill.rows] table, or choose --selectors without "
                f"{' or '.join(NEEDS_COUNTS)}")
    settings["rows"] = rows
    try:
        return FillConfig(**settings)
    except (TypeError, ValueError) as e:
        raise InputError(f"fill settings: {e}") from None
