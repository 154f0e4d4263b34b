"""The hybrids through the engine: scheduler, chunked prefill, batching, preemption and abort
over the state pool, against transformers' greedy continuations."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from ridgefill_runtime.llm import LLM, build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import HYBRID_CONFIGS, build_tiny_hybrid

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = build_tiny_hybrid(request.param, folder)
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 320, (n,), generator=rng).tolist() for n in (90, 37, 150, 5, 64, 121)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            # NOTE: an explicit mask: generate() would take prompt tokens equal to pad_token_id for padding.
            ids = torch.tensor([p])
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                               min_new_tokens=GREEDY.max_tokens, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return dict(name=request.param, folder=folder, prompts=prompts, expected=expected)


def _engine_config(tiny, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny["folder"]), **kw)


def test_batched_chunked_greedy_equals_transformers(tiny):
    """Six requests at once, prompts cut into 32-token chunks and sharing steps with decodes."""
    llm = LLM(_engine_config(tiny, cache=CacheConfig(num_blocks=128),
                             scheduler=SchedulerConfig(max_num_batched_tokens=80, chunk_size=32)))
    outs = llm.generate(tiny["prompts"], GREEDY)
    assert [o.token_ids for o in outs] == tiny["expected"]
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0


def test_preempted_sequences_restart_from_zero_state_and_match(tiny):
    """A cache too small for all six: the newest are preempted (their state slots freed) and
    recomputed; every output still equals transformers'."""
    llm = LLM(_engine_config(tiny, cache=CacheConfig(num_blocks=14, block_size=16),
                             scheduler=SchedulerConfig(max_num_batched_tokens=256, chunk_size=64)))
    outs = llm.generate(tiny["prompts"], GREEDY)
    stats = llm.engine.stats()
    assert stats.preemptions_total > 0, "the test must preempt to test preemption"
    assert [o.token_ids for o in outs] == tiny["expected"]
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0


def test_abort_frees_the_state_slot_and_others_go_on(tiny):
    engine = build_engine(_engine_config(tiny, cache=CacheConfig(num_blocks=64)))
    a = engine.add_request(tiny["prompts"][0], GREEDY)
    b = engine.add_request(tiny["prompts"][1], GREEDY)
    engine.step()
    engine.step()
    assert engine.stats().state_slots_used == 2
    engine.abort(a)
    while engine.has_unfinished():
        engine.step()
    assert a.finish_reason == "abort" and list(b.output_ids) == tiny["expected"][1]
    assert engine.stats().state_slots_used == 0


def test_speculation_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="recurrent layers \\[0, 1, 2\\]"):
        build_engine(_engine_config(tiny, speculative=SpeculativeConfig(method="ngram")))


def test_the_text_path_of_a_vision_language_checkpoint(tmp_path):
    """model_type qwen3_5: text settings under text_config, weights under model.language_model
    beside a vision tower; the text path gives the text checkpoint's outputs."""
    text = tmp_path / "text"
    build_tiny_hybrid("qwen3_5_text", text)
    raw = json.loads((text / "config.json").read_text())
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "tie_word_embeddings": False,
                                                "text_config": raw, "vision_config": {"depth": 1}}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(text / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, vl / "model.safetensors")
    prompts = [[5, 17, 99, 3] * 10, list(range(1, 60))]
    outs = {}
    for name, folder in (("text", text), ("vl", vl)):
        llm = LLM(EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=64)))
        outs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.model.config.architecture == {"text": "qwen3_5_text", "vl": "qwen3_5"}[name]
    assert outs["vl"] == outs["text"]
