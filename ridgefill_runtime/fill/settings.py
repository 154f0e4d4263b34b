"""Where fill settings come from when the user names only an arm: a TOML [fill] table, or the
maps shipped for the embedded default model."""

from __future__ import annotations

import tomllib
from pathlib import Path

from ..config import FillConfig
from ..errors import InputError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "maps"
SHIPPED_SPLIT, SHIPPED_TAIL = 15, 1024


def shipped_maps(split: int = SHIPPED_SPLIT) -> Path:
    return SHIPPED_DIR / f"smollm2-135m-instruct.split{split}.safetensors"


def fill_from_toml(path: Path) -> dict:
    try:
        table = tomllib.loads(path.read_text()).get("fill", {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"{path}: cannot read fill config ({e})") from None
    known = set(FillConfig.__dataclass_fields__)
    unknown = sorted(set(table) - known)
    if unknown:
        raise InputError(f"{path}: unknown key fill.{unknown[0]} (known: {', '.join(sorted(known))})")
    return table


def fill_for_arm(arm: str, config_file: Path | None) -> FillConfig:
    """The FillConfig for `arm`: the file's [fill] table, else the shipped split, tail and maps."""
    settings = {"split": SHIPPED_SPLIT, "tail": SHIPPED_TAIL}
    if config_file is not None:
        settings.update(fill_from_toml(config_file))
    settings["arm"] = arm
    if arm == "ridgefill" and not settings.get("maps"):
        settings["maps"] = str(shipped_maps(settings["split"]))
    try:
        return FillConfig(**settings)
    except (TypeError, ValueError) as e:
        raise InputError(f"fill settings: {e}") from None
