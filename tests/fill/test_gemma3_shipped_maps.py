"""The maps shipped for Gemma 3 270M: they load for `--model gemma3-270m` (the server's settings
pick them and their split), fit the real model, and predict: on a real text, the fill's tail
loss is closer to exact than the identity fill's at the same split and tail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.fill.settings import PACKAGED_MAPS, resolve_fill, shipped_maps
from ridgefill_runtime.llm import LLM, load_fill_maps
from ridgefill_runtime.sequence import SamplingParams

TEXT = Path("/usr/share/common-licenses/GPL-3")
SPLIT, TAIL = PACKAGED_MAPS["gemma3-270m"][1], 256


@pytest.fixture(scope="module")
def exact(gemma3_gguf):
    return LLM(EngineConfig(model="gemma3-270m", cache=CacheConfig(kv_cache_gib=0.1)))


def _tail_nll(llm, fill: FillConfig, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    cfg = EngineConfig(model="gemma3-270m", cache=CacheConfig(kv_cache_gib=0.1), fill=fill)
    engine = Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model))
    seq = engine.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
    while engine.has_unfinished():
        engine.step()
    return -torch.tensor(seq.logprobs.prompt[-(TAIL - 1) :])  # [TAIL - 1] the tail rows' targets


def test_server_settings_pick_the_gemma_maps_and_split():
    values = {"fill": {"arm": "ridgefill"}, "rows": {}}
    _, fill = resolve_fill(values, {"fill.mode": "test"}, model="gemma3-270m", source="test")
    assert fill.split == SPLIT and Path(fill.maps) == shipped_maps(SPLIT, "gemma3-270m")


@pytest.mark.parametrize("split", [7, 9])
def test_shipped_maps_fit_the_model(exact, split):
    cfg = EngineConfig(
        fill=FillConfig(arm="ridgefill", split=split, tail=TAIL, maps=str(shipped_maps(split, "gemma3-270m")))
    )
    maps = load_fill_maps(cfg, exact.engine.model)  # refuses maps of another model or split
    assert maps.meta.split == split and maps.meta.num_layers == 18


def test_ridgefill_is_closer_to_exact_than_identity(exact):
    ids = exact.tokenizer.encode(TEXT.read_text())[:1536]
    base = _tail_nll(exact, FillConfig(), ids)
    maps = str(shipped_maps(SPLIT, "gemma3-270m"))
    ridge = _tail_nll(exact, FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=maps), ids)
    ident = _tail_nll(exact, FillConfig(arm="identity", split=SPLIT, tail=TAIL), ids)
    d_ridge, d_ident = (ridge - base).mean(), (ident - base).mean()
    assert torch.isfinite(ridge).all() and d_ridge < d_ident, (float(d_ridge), float(d_ident))
