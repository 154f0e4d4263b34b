"""Named fill recipes: the seed's deployments (seed 000 §2.6, Table 4) as presets for [fill].

A recipe fills in the [fill] keys the operator leaves out; every key given explicitly wins. The
split is not part of a recipe: it is a layer index of one model (the 27B's 16 of 64, Flash-Next's
24 of 48), and the maps are fitted for it, so the operator sets fill.split with fill.maps.

  qwen3.8-27b         the 27B in llama.cpp: probe + special + lexical exact rows, the value
                      rescale measured on the first 512 tail rows, a 4,096-token tail
  flash-next          Flash-Next in vLLM, plain: no exact prefix rows, no correction, a 2,048-token tail
  flash-next-quality  its quality mode: protected-token rows and the terminal-state correction
                      (the maps need ΔM: `ridgefill fit --terminal-state`)
"""

from __future__ import annotations

from typing import Any

# recipe -> ({fill key: value}, {fill.rows key: value}), keys as FillConfig / RowsConfig fields
RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3.8-27b": (
        {"arm": "ridgefill", "tail": 4096, "value_rescale": True, "rescale_rows": 512},
        {"selectors": ["special", "probe", "lexical"]},
    ),
    "flash-next": ({"arm": "ridgefill", "tail": 2048}, {"selectors": []}),
    "flash-next-quality": ({"arm": "ridgefill", "tail": 2048, "terminal_state": True}, {"selectors": ["protected"]}),
}


def apply_recipe(name: str, fill: dict[str, Any], rows: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The [fill] values (FillConfig fields) and [fill.rows] values with the recipe's
    settings under those given. Raises ValueError for an unknown recipe."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r} (known: {', '.join(RECIPES)})")
    preset_fill, preset_rows = RECIPES[name]
    return {**preset_fill, **fill}, {**preset_rows, **rows}
