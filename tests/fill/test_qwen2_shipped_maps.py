"""The maps shipped for Qwen2.5-Coder-0.5B (fitted on the standard library's top-level modules):
`--model qwen2.5-coder-0.5b` picks them and split 12, they fit the real model at every shipped
split, and on code from an evaluation package (never calibration text) the fill's tail loss is
closer to exact than the identity fill's at the same split and tail. And every packaged model
with maps has its default split's file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.fill.corpus import CODE_EVAL_PACKAGES, stdlib_root
from ridgefill_runtime.fill.settings import PACKAGED_MAPS, resolve_fill, shipped_maps
from ridgefill_runtime.llm import LLM, load_fill_maps
from ridgefill_runtime.sequence import SamplingParams

MODEL = "qwen2.5-coder-0.5b"
SPLIT, TAIL = PACKAGED_MAPS[MODEL][1], 256


@pytest.fixture(scope="module")
def exact(qwen2_gguf):
    torch.set_num_threads(2)
    return LLM(EngineConfig(model=MODEL, cache=CacheConfig(kv_cache_gib=0.1)))


def _tail_nll(llm, fill: FillConfig, ids: list[int]) -> torch.Tensor:
    model = llm.engine.model
    cfg = EngineConfig(model=MODEL, cache=CacheConfig(kv_cache_gib=0.1), fill=fill)
    engine = Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model))
    seq = engine.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
    while engine.has_unfinished():
        engine.step()
    return -torch.tensor(seq.logprobs.prompt[-(TAIL - 1) :])  # [TAIL - 1] the tail rows' targets


@pytest.mark.parametrize("model", sorted(PACKAGED_MAPS))
def test_every_packaged_model_ships_its_default_split(model):
    assert shipped_maps(PACKAGED_MAPS[model][1], model).is_file()


def test_server_settings_pick_the_qwen_maps_and_split():
    values = {"fill": {"arm": "ridgefill"}, "rows": {}}
    _, fill = resolve_fill(values, {"fill.mode": "test"}, model=MODEL, source="test")
    assert fill.split == SPLIT == 12 and Path(fill.maps) == shipped_maps(SPLIT, MODEL)


@pytest.mark.parametrize("split", [8, 12, 16])
def test_shipped_maps_fit_the_model(exact, split):
    cfg = EngineConfig(fill=FillConfig(arm="ridgefill", split=split, tail=TAIL, maps=str(shipped_maps(split, MODEL))))
    maps = load_fill_maps(cfg, exact.engine.model)  # refuses maps of another model or split
    assert maps.meta.split == split and maps.meta.num_layers == 24


def test_ridgefill_is_closer_to_exact_than_identity_on_held_out_code(exact):
    assert "asyncio" in CODE_EVAL_PACKAGES  # never calibration text
    ids = exact.tokenizer.encode((stdlib_root() / "asyncio" / "base_events.py").read_text())[:1536]
    base = _tail_nll(exact, FillConfig(), ids)
    maps = str(shipped_maps(SPLIT, MODEL))
    ridge = _tail_nll(exact, FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=maps), ids)
    ident = _tail_nll(exact, FillConfig(arm="identity", split=SPLIT, tail=TAIL), ids)
    d_ridge, d_ident = (ridge - base).mean(), (ident - base).mean()
    assert torch.isfinite(ridge).all() and d_ridge < d_ident, (float(d_ridge), float(d_ident))
