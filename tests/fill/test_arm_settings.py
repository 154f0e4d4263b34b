"""Every arm of a packaged model runs at the model's split and tail (issue 31, finding 8): before,
`--arm identity` and `--arm nofill` took FillConfig's split 15 while `--arm ridgefill` took
gemma3-270m's split 9, so a comparison of arms on the command line was silently unfair."""

from __future__ import annotations

import pytest

from ridgefill_runtime.config import FILL_ARMS, FillConfig
from ridgefill_runtime.fill import settings
from ridgefill_runtime.fill.settings import PACKAGED_MAPS, fill_for_arm, resolve_fill

GEMMA = "gemma3-270m"


def _resolved(arm: str, model: str, **given) -> FillConfig:
    values = {"fill": {"arm": arm, **given}, "rows": {}}
    return resolve_fill(values, {"fill.mode": "test"}, model=model, source="test")[1]


def test_every_arm_of_gemma_resolves_to_its_split_and_tail():
    split = PACKAGED_MAPS[GEMMA][1]
    assert split != FillConfig().split  # else this test shows nothing
    resolved = {arm: _resolved(arm, GEMMA) for arm in FILL_ARMS}
    assert {(f.split, f.tail) for f in resolved.values()} == {(split, FillConfig().tail)}
    # The same through the command line's --arm (score, generate).
    by_flag = {arm: fill_for_arm(arm, None, model=GEMMA) for arm in FILL_ARMS}
    assert {(f.split, f.tail) for f in by_flag.values()} == {(split, FillConfig().tail)}


def test_a_packaged_tail_applies_to_every_arm_and_given_values_win(monkeypatch):
    monkeypatch.setitem(settings.PACKAGED_FILL, GEMMA, {"tail": 256})
    split = PACKAGED_MAPS[GEMMA][1]
    assert {(_resolved(arm, GEMMA).split, _resolved(arm, GEMMA).tail) for arm in FILL_ARMS} == {(split, 256)}
    # What the user sets is kept, on every arm.
    for arm in ("identity", "nofill"):
        fill = _resolved(arm, GEMMA, split=7, tail=128)
        assert (fill.split, fill.tail) == (7, 128)


@pytest.mark.parametrize("arm", FILL_ARMS)
def test_other_models_keep_fill_config_defaults(arm):
    fill = _resolved(arm, None)
    assert (fill.split, fill.tail) == (FillConfig().split, FillConfig().tail)
