"""A model family with a recurrent state cache plugs in through the registry and its cache spec
and runs through the real Engine: chunked prefill carries the state across chunks, decode
continues it, preemption frees its slot, batching changes nothing. Checked against a plain
float64 loop of the same math (toy_recurrent.reference_logits)."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.models import registry
from ridgefill_runtime.sequence import SamplingParams, SeqStatus
from toy_recurrent import NAME, TOY_FAMILY, reference_logits, toy_config, toy_weights


@pytest.fixture(scope="module")
def toy():
    registry.register(TOY_FAMILY)  # the one line that adds the family
    try:
        config = toy_config()
        tensors = toy_weights(config)
        model = registry.family(NAME).build_model(config, tensors, torch.float64, "cpu")
        yield dict(model=model, tensors=tensors)
    finally:
        registry.unregister(NAME)


def engine(toy, num_blocks: int = 64, block_size: int = 4, **scheduler) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), scheduler=SchedulerConfig(**scheduler)
    )
    return Engine(toy["model"], None, config)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, toy_config().vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int, score: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=score)


def reference_greedy(tensors, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(tensors, seq)[-1].argmax()))
    return seq[len(prompt) :]


def run(eng: Engine) -> None:
    while eng.has_unfinished():
        eng.step()


def test_cache_spec_builds_state_slots_and_attention_only_kv(toy):
    eng = engine(toy, max_num_seqs=3)
    assert eng.kv.layers == (1,)  # K/V only for the attention layer
    assert eng.caches.states.state(0)["sum"].shape == (3, toy_config().hidden_size)
    assert eng.stats().state_slots_total == 3


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_and_decode_match_the_loop(toy, chunk):
    prompt = ids(23, seed=1)
    eng = engine(toy, chunk_size=chunk)
    seq = eng.add_request(prompt, greedy(6, score=True))
    run(eng)
    want = reference_greedy(toy["tensors"], prompt, 6)
    assert seq.output_ids == want
    ref = reference_logits(toy["tensors"], prompt).log_softmax(-1)  # [L, V]
    ref_lp = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(seq.logprobs.prompt, dtype=torch.float64), ref_lp, atol=1e-5)
    assert eng.stats().state_slots_used == 0


def test_batched_sequences_give_what_each_gives_alone(toy):
    prompts = [ids(17, seed=2), ids(9, seed=3), ids(30, seed=4)]
    eng = engine(toy, chunk_size=7, max_num_batched_tokens=16)
    seqs = [eng.add_request(p, greedy(5)) for p in prompts]
    run(eng)
    for p, seq in zip(prompts, seqs):
        alone = engine(toy)
        one = alone.add_request(p, greedy(5))
        run(alone)
        assert seq.output_ids == one.output_ids == reference_greedy(toy["tensors"], p, 5)


def test_preemption_frees_the_state_slot(toy):
    old_prompt, young_prompt = ids(12, seed=5), ids(24, seed=6)
    # NOTE: 48 positions for 12 + 30 and 24 + 4; one row per step, so the old one's decode
    # outgrows the pool while the young one is still in its prefill
    eng = engine(toy, num_blocks=12, block_size=4, chunk_size=1)
    old = eng.add_request(old_prompt, greedy(30))
    while not old.output_ids:
        eng.step()
    young = eng.add_request(young_prompt, greedy(4))
    preempted = False
    while eng.has_unfinished():
        slot, before = young.state_slot, eng.stats().preemptions_total
        eng.step()
        if eng.stats().preemptions_total > before and not preempted:
            preempted = True
            stats = eng.stats()
            assert young.status is SeqStatus.WAITING and young.state_slot is None and not young.block_table
            assert stats.state_slots_used == 1 and stats.kv_blocks_used == len(old.block_table)
            assert not eng.caches.states.state(0)["sum"][slot].any(), "a freed slot keeps no state"
    assert preempted
    assert old.output_ids == reference_greedy(toy["tensors"], old_prompt, 30)
    assert young.output_ids == reference_greedy(toy["tensors"], young_prompt, 4)
    assert (eng.stats().state_slots_used, eng.stats().kv_blocks_used) == (0, 0)
