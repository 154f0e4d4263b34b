"""fill.recipe: the seed's deployments (seed 000 Table 4) as presets under the keys given."""

from __future__ import annotations

import pytest

from ridgefill_runtime.errors import ConfigError
from ridgefill_runtime.fill.recipes import RECIPES
from ridgefill_runtime.fill.settings import fill_for_arm


def fill_of(tmp_path, text: str, model=None):
    cfg = tmp_path / "fill.toml"
    cfg.write_text(text)
    return fill_for_arm(None, cfg, model=model)


def test_each_recipe_sets_its_deployment(tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text("{}")
    maps = tmp_path / "m.safetensors"
    twenty_seven = fill_of(
        tmp_path,
        f'[fill]\nrecipe = "qwen3.8-27b"\nsplit = 16\nmaps = "{maps}"\n[fill.rows]\nunigram = "{counts}"\n',
        model="/m",
    )
    assert (
        twenty_seven.arm,
        twenty_seven.split,
        twenty_seven.tail,
        twenty_seven.value_rescale,
        twenty_seven.rescale_rows,
        twenty_seven.terminal_state,
    ) == ("ridgefill", 16, 4096, True, 512, False)
    assert twenty_seven.rows.selectors == ("special", "probe", "lexical")
    plain = fill_of(tmp_path, f'[fill]\nrecipe = "flash-next"\nsplit = 24\nmaps = "{maps}"\n', model="/m")
    assert (plain.arm, plain.tail, plain.value_rescale, plain.terminal_state, plain.rows.selectors) == (
        "ridgefill",
        2048,
        False,
        False,
        (),
    )
    quality = fill_of(
        tmp_path,
        f'[fill]\nrecipe = "flash-next-quality"\nsplit = 24\nmaps = "{maps}"\n[fill.rows]\nunigram = "{counts}"\n',
        model="/m",
    )
    assert (quality.terminal_state, quality.rows.selectors, quality.tail) == (True, ("protected",), 2048)


def test_keys_given_win_over_the_recipe(tmp_path):
    maps = tmp_path / "m.safetensors"
    fill = fill_of(
        tmp_path,
        f'[fill]\nrecipe = "flash-next"\ntail = 100\nmaps = "{maps}"\n[fill.rows]\nselectors = ["special"]\n',
        model="/m",
    )
    assert fill.tail == 100 and fill.rows.selectors == ("special",)
    assert fill_of(tmp_path, '[fill]\nrecipe = "flash-next"\nmode = "off"\n').arm == "exact"


def test_recipe_refusals_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"key 'fill.recipe': unknown recipe 'flash' \(known: " + ", ".join(RECIPES) + r"\)"
    ):
        fill_of(tmp_path, '[fill]\nrecipe = "flash"\n')
    maps = tmp_path / "m.safetensors"
    with pytest.raises(
        ConfigError, match="key 'fill.rows.unigram' is required when fill.rows.selectors include protected"
    ):
        fill_of(tmp_path, f'[fill]\nrecipe = "flash-next-quality"\nmaps = "{maps}"\n', model="/m")
    with pytest.raises(ConfigError, match="key 'fill.maps' is required when fill.mode = \"plain\""):
        fill_of(tmp_path, '[fill]\nrecipe = "flash-next"\n', model="/m")
