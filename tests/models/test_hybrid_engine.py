"""The hybrids through the engine: scheduler, chunked prefill, batching, preemption and abort
over the state pool, against transformers' greedy continuations."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, SchedulerConfig, SpeculativeConfig
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
            out = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                min_new_tokens=GREEDY.max_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    return dict(name=request.param, folder=folder, prompts=prompts, expected=expected)


def _engine_config(tiny, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny["folder"]), **kw)


def test_batched_chunked_greedy_equals_transformers(tiny):
    """Six requests at once, prompts cut into 32-token chunks and sharing steps with decodes."""
    llm = LLM(
        _engine_config(
            tiny, cache=CacheConfig(num_blocks=128), scheduler=SchedulerConfig(max_num_batched_tokens=80, chunk_size=32)
        )
    )
    outs = llm.generate(tiny["prompts"], GREEDY)
    assert [o.token_ids for o in outs] == tiny["expected"]
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0


def test_preempted_sequences_restart_from_zero_state_and_match(tiny):
    """A cache too small for all six: the newest are preempted (their state slots freed) and
    recomputed; every output still equals transformers'."""
    llm = LLM(
        _engine_config(
            tiny,
            cache=CacheConfig(num_blocks=14, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, chunk_size=64),
        )
    )
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


@pytest.mark.parametrize("fill", [FillConfig(), FillConfig(arm="identity", split=2, tail=16)], ids=["exact", "filled"])
def test_speculative_steps_roll_the_gdn_states_back_to_plain_greedy_decoding(tiny, fill):
    """Drafts verified k+1 rows at a time: each GDN layer keeps its state after every verified
    row and a rejection rolls it back to the last accepted one, so the output is plain greedy's,
    with speculating and plain requests in the same steps. The random model never repeats
    itself, so n-gram drafts would all be rejected: an oracle proposer drafts the true greedy
    continuation with one token spoiled at a random place (or none), so every accepted-run
    length 0..k is verified and rolled back to. With the fill on, verifications share steps
    with other prompts' two-sweep prefills (their rows join the late part there)."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = tiny["prompts"]
    small = SchedulerConfig(chunk_size=32, max_num_batched_tokens=96)  # prefills spread over many steps
    want = [
        o.token_ids
        for o in LLM(_engine_config(tiny, cache=CacheConfig(num_blocks=160), fill=fill, scheduler=small)).generate(
            prompts, greedy
        )
    ]
    spec = LLM(
        _engine_config(
            tiny,
            cache=CacheConfig(num_blocks=160),
            fill=fill,
            scheduler=small,
            speculative=SpeculativeConfig(method="ngram", num_tokens=4),
        )
    )
    rng = random.Random(3)
    truth = {}

    def oracle(seq, limit: int) -> list[int]:
        done = len(seq.output_ids)
        draft = list(truth[seq.seq_id][done : done + limit])
        spoil = rng.randrange(len(draft) + 1)  # len(draft): nothing spoiled, the whole draft stands
        if spoil < len(draft):
            draft[spoil] = (draft[spoil] + 1) % 320
        return draft

    spec.engine.scheduler.propose = oracle
    off = dataclasses.replace(greedy, speculative=0)  # every third request does not speculate
    seqs = []
    for i, (p, w) in enumerate(zip(prompts, want)):
        seqs.append(spec.engine.add_request(p, greedy if i % 3 else off))
        truth[seqs[-1].seq_id] = w
    while spec.engine.has_unfinished():
        spec.engine.step()
    assert [list(s.output_ids) for s in seqs] == want
    stats = spec.engine.stats()
    assert stats.spec_steps_total > 0 and 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0


def test_the_text_path_of_a_vision_language_checkpoint(tmp_path):
    """model_type qwen3_5: text settings under text_config, weights under model.language_model
    beside a vision tower; the text path gives the text checkpoint's outputs."""
    text = tmp_path / "text"
    build_tiny_hybrid("qwen3_5_text", text)
    raw = json.loads((text / "config.json").read_text())
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": raw, "vision_config": {"depth": 1}}
        )
    )
    tensors = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(text / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, vl / "model.safetensors")
    prompts = [[5, 17, 99, 3] * 10, list(range(1, 60))]
    outs = {}
    for name, folder in (("text", text), ("vl", vl)):
        llm = LLM(EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=64)))
        outs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.model.config.architecture == {"text": "qwen3_5_text", "vl": "qwen3_5"}[name]
    assert outs["vl"] == outs["text"]
